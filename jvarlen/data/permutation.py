"""A seeded random-access permutation of ``range(n)``: element ``i`` computed on demand.

The sampler's position is then a few integers (epoch, cursor, carry), with nothing per piece to
store or regenerate. Construction: a balanced Feistel network over the smallest domain of
``2·h`` bits that holds ``n`` (a bijection of that domain whatever its round function), and cycle
walking: a value outside ``range(n)`` is encrypted again until it falls inside, which restricts
the bijection to ``range(n)``. The domain holds at most ``4·n`` values, so a lookup takes at most
four encryptions on average.

Why not grain's ``MapDataset.shuffle`` (used until 2026-11-28): grain 0.2.18 sizes its domain from
``ceil(log2(n - 1))`` bits, so for ``n = 2^k + 1`` with even ``k ≥ 16`` (65,537; 262,145;
1,048,577 pieces) the domain misses index ``n - 1``: every epoch trained one piece twice and never
the last one. The arithmetic here is plain Python integers, the same on every platform and
version. Grain's shuffle still serves sampler states written before (:data:`LEGACY`).
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_M64 = (1 << 64) - 1
FEISTEL = "feistel-v1"  # the sampler state's name of this permutation
LEGACY = "grain"  # sampler states without a name: grain's shuffle, kept for runs resumed from them


def _mix(x: int) -> int:
    """A 64-bit integer hash (the splitmix64 finaliser)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class IndexPermutation:
    """``perm[i]`` for ``i`` in ``range(n)``: a permutation of ``range(n)`` fixed by ``seed``."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        self.half = max(1, ((self.n - 1).bit_length() + 1) // 2)  # 2·half bits hold n - 1
        self._mask = (1 << self.half) - 1
        self._keys = [int(k) for k in np.random.SeedSequence([int(seed), self.n]).generate_state(ROUNDS, np.uint64)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self.half) | right

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} outside a permutation of {self.n}")
        x = self._encrypt(int(i))
        while x >= self.n:
            x = self._encrypt(x)
        return x
