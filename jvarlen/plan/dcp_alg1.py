"""DCP-intra's Alg. 1 (§3.4, Eq. 4-6) and the dual-layer profile it reads (§3.5), answered by the
cost model: per (b, p), the most layers that skip recomputation within memory and the (b, p) of
highest throughput (:mod:`jvarlen.plan.dcp` chooses per bucket with it).

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Mapping, Optional

from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.memo import BoundedMemo
from jvarlen.plan.sp_groups import GroupCosts
from jvarlen.plan.strategy import Scheme


@dataclasses.dataclass(frozen=True)
class ProfileEntry:
    """Alg. 1's profile of one (b, p) (§3.5): ``t_f`` seconds to recompute one layer of the batch,
    ``m`` bytes per device one layer keeps beyond its checkpoint when not recomputed, ``T`` seconds
    and ``M`` bytes per device of the batch with every layer recomputed (Eq. 4, 6 with r = L).
    ``peaks``, where given: the bytes with ``k = 0 .. L`` layers not recomputed, which Alg. 1 then
    reads instead of Eq. 6's ``M + k·m`` (the cost model is not linear in ``k``: a backward that
    recomputes a layer holds that layer's activations, one that recomputes none does not)."""

    t_f: float
    m: float
    T: float
    M: float
    peaks: tuple = ()


@dataclasses.dataclass(frozen=True)
class Setting:
    """A chosen (b, p, r): batch size, SP degree, recomputed layers, time of one batch, throughput."""

    b: int
    p: int
    r: int
    time: float
    throughput: float


def alg1(
    capacity: float, layers: int, candidates: Mapping[tuple[int, int], ProfileEntry], seq_len: float
) -> Optional[Setting]:
    """DCP-intra, Alg. 1: for each (b, p), the most layers that can skip recomputation within the
    memory ``capacity`` (``M + k·m <= capacity``, Eq. 6, or the entry's exact ``peaks``; ``r = L - k``
    recomputed layers), the
    time ``T - k·t_f`` (Eq. 4-5), and the (b, p) of highest throughput ``b·s / (p·time)`` (Eq. 1;
    ties: smaller p, then smaller b). The paper's loop breaks at the *first* k that fits, which
    would keep a single layer; we take the largest (what the text describes). (b, p) whose fully
    recomputed batch exceeds the capacity are skipped; None when none fits."""
    best = None
    for (b, p), e in sorted(candidates.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if e.peaks:
            fitting = [k for k, peak in enumerate(e.peaks) if peak <= capacity]
            if not fitting:
                continue
            k = max(fitting)
        elif e.M > capacity:
            continue
        else:
            k = layers if e.m <= 0 else int(min(layers, math.floor((capacity - e.M) / e.m)))
        t = e.T - k * e.t_f
        thr = b * seq_len / (p * t)
        if best is None or thr > best.throughput * (1 + 1e-12):
            best = Setting(b, p, layers - k, t, thr)
    return best


_PROFILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per GroupCosts (one planning call)


def profile_entry(gc: GroupCosts, scheme: Scheme, seq_len: int, b: int) -> ProfileEntry:
    """The cost model's answer to DCP's dual-layer profile for ``b`` sequences of ``seq_len`` on
    ``scheme`` (kept per ``gc``: DCP asks the same (p, s, b) for every bucketing it tries)."""
    memo = _PROFILES.get(gc)
    if memo is None:
        memo = _PROFILES[gc] = BoundedMemo(4096)
    key = (scheme, int(seq_len), int(b))
    got = memo.get(key)
    return memo.put(key, _profile_entry(gc, scheme, *key[1:])) if got is None else got


def _profile_entry(gc: GroupCosts, scheme: Scheme, seq_len: int, b: int) -> ProfileEntry:
    cost = gc.costs.cost(scheme)
    chunk = ChunkShape(0, (seq_len,) * b)
    L = gc.layers
    floor = cost.memory_floor(0)
    stored = [cost.peak_memory(chunk, L - k, 0) for k in range(L + 1)]  # k layers not recomputed
    return ProfileEntry(
        t_f=cost.recompute_time(chunk, 1),
        m=stored[1] - stored[0],
        T=gc.micro_batch_time(chunk.slices, scheme, L),
        M=floor + stored[0],
        peaks=tuple(floor + x for x in stored),
    )


def batch_grid(n: int, cap: int) -> list[int]:
    """Batch sizes profiled: 1, 2, 3, 4, 6, 8, 12, ... up to ``min(n, cap)``, and that bound itself."""
    hi = max(1, min(n, cap))
    out, x = {1, hi}, 2
    while x < hi:
        out.add(x)
        out.add(min(hi, x * 3 // 2))
        x *= 2
    return sorted(out)


__all__ = ["ProfileEntry", "Setting", "alg1", "batch_grid", "profile_entry"]
