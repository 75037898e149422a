"""The sampler's random-access permutation: a bijection of range(n) for every n (grain's shuffle,
used before, missed the last index for n = 2^k + 1 with even k >= 16), fixed by its seed, and
shuffled well enough to order an epoch."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jvarlen.data.permutation import IndexPermutation
from jvarlen.data.sampler import TokenBudgetSampler


def _all(perm: IndexPermutation) -> list[int]:
    return [perm[i] for i in range(len(perm))]


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1))
def test_a_bijection_of_range_n(n, seed):
    assert sorted(_all(IndexPermutation(n, seed))) == list(range(n))


@pytest.mark.parametrize("n", [2**k + d for k in (1, 2, 3, 8, 11, 12) for d in (-1, 0, 1)] + [2**16 + 1])
def test_a_bijection_at_powers_of_two(n):
    assert sorted(_all(IndexPermutation(n, 7))) == list(range(n))


def test_fixed_by_its_seed_and_far_from_the_identity():
    n = 10_000
    a, b, c = _all(IndexPermutation(n, 1)), _all(IndexPermutation(n, 1)), _all(IndexPermutation(n, 2))
    assert a == b and a != c
    # ranks of a random permutation: correlation with the index ~ N(0, 1/n), fixed points ~ Poisson(1)
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.05
    assert sum(int(x == i) for i, x in enumerate(a)) < 8
    # where index 0 lands over many seeds: spread over the range, not a few values
    firsts = [IndexPermutation(1000, seed)[0] for seed in range(2000)]
    assert len(set(firsts)) > 800 and max(collections.Counter(f // 100 for f in firsts).values()) < 300


def test_out_of_range_indices_are_refused():
    perm = IndexPermutation(5, 0)
    with pytest.raises(IndexError):
        perm[5]
    with pytest.raises(ValueError):
        IndexPermutation(0, 0)


def test_an_epoch_of_65537_pieces_trains_each_once():
    """2^16 + 1 pieces: grain's shuffle drew one piece twice and never the last one, every epoch."""
    n = 2**16 + 1
    sampler = TokenBudgetSampler(np.ones(n, np.int64), rows=64, seq_len=64, seed=0)
    seen = []
    while sampler.epoch == 0:
        seen.extend(sampler.next().piece_ids.tolist())
    assert len(seen) == n and len(set(seen)) == n
