"""Memory-balanced micro-batch chunking (FlexSP App. A, Eq. 23-24) for the SP-group policies.

A group's documents, sorted by length (FlexSP's takeaway #2), are cut into ``M`` *consecutive*
micro-batches so that the largest micro-batch (in tokens, i.e. in activation memory) is as
small as possible (Eq. 23)::

    DP[k][i] = min_{j ∈ [i-1, k-1]} max(DP[j][i-1], Σ_{l ∈ [j+1, k]} s_l)          (Eq. 24)

:func:`balanced_split` evaluates Eq. 24 exactly. ``DP[j][i-1]`` is non-decreasing in ``j`` and
the last part's sum ``P[k] - P[j]`` decreasing, so the minimising ``j`` sits where
``DP[j][i-1] + P[j]`` first reaches ``P[k]``: one ``searchsorted`` per part instead of a scan
(O(M·K log K) instead of O(M·K²); the test checks it against brute force).
:func:`min_parts` is the least ``M`` whose optimum fits a token cap (greedy, exact for
consecutive parts), and :func:`chunk_group` is how FlexSP, DCP and the homogeneous reference
cut one group's documents into micro-batches.

Balanced parts suit a time model without padding. Where every micro-batch of a step is padded to
one token bucket, micro-batches filled to the bucket with the remainder left small (so that it
may run as its own part over a smaller bucket) are often faster: :func:`packed_group` packs
first-fit decreasing into bins of a given size.

Pure numpy: nothing here imports JAX.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np


def balanced_split(tokens: Sequence[int], m: int) -> list[int]:
    """Eq. 23-24: the ends ``[j_1, ..., j_M]`` (``j_M = K``) of ``m`` consecutive non-empty parts of
    ``tokens`` (positive ints, in the given order) minimising the largest part's sum. Ties go to the
    smallest split point. ``1 <= m <= len(tokens)``."""
    s = np.asarray(tokens, dtype=np.int64)
    k_all = s.shape[0]
    if not 1 <= m <= k_all:
        raise ValueError(f"need 1 <= M <= K, got M={m} for K={k_all} items")
    if k_all and s.min() <= 0:
        raise ValueError("token counts must be positive")
    prefix = np.concatenate([[0], np.cumsum(s)])  # P[k] = Σ_{l < k} s_l, [K+1]
    inf = np.iinfo(np.int64).max // 4
    dp = np.full(k_all + 1, inf, dtype=np.int64)
    dp[0] = 0  # DP[0][0] = 0
    arg = np.zeros((m + 1, k_all + 1), dtype=np.int64)
    ks = np.arange(k_all + 1)
    for i in range(1, m + 1):
        new = np.full(k_all + 1, inf, dtype=np.int64)
        lo = i - 1  # j ∈ [i-1, k-1]; DP[j][i-1] is finite and non-decreasing for j >= i-1
        if i == 1:
            new[1:] = prefix[1:]
            arg[1, 1:] = 0
        else:
            f = dp[lo:] + prefix[lo:]  # non-decreasing in j
            kk = ks[i:]  # k ∈ [i, K]
            # max(DP[j][i-1], P[k] - P[j]) falls until f(j) reaches P[k], then never falls again
            jstar = lo + np.searchsorted(f, prefix[kk], side="left")
            best_val = np.full(kk.shape, inf, dtype=np.int64)
            best_j = np.zeros(kk.shape, dtype=np.int64)
            for cand in (jstar - 1, jstar):
                c = np.clip(cand, lo, kk - 1)
                val = np.maximum(dp[c], prefix[kk] - prefix[c])
                better = (val < best_val) | ((val == best_val) & (c < best_j))
                best_val = np.where(better, val, best_val)
                best_j = np.where(better, c, best_j)
            new[i:] = best_val
            arg[i, i:] = best_j
        dp = new
    ends = [k_all]
    k = k_all
    for i in range(m, 1, -1):
        k = int(arg[i, k])
        ends.append(k)
    return ends[::-1]


def split_max(tokens: Sequence[int], ends: Sequence[int]) -> int:
    """Largest part sum of the split of ``tokens`` at ``ends`` (the objective of Eq. 23)."""
    prefix = np.concatenate([[0], np.cumsum(np.asarray(tokens, dtype=np.int64))])
    starts = [0, *ends[:-1]]
    return int(max(prefix[e] - prefix[b] for b, e in zip(starts, ends)))


def min_parts(tokens: Sequence[int], cap: int) -> Optional[int]:
    """The least ``M`` for which Eq. 23's optimum is ``<= cap`` (greedy filling of consecutive parts
    is exact for this question); None when one item alone exceeds ``cap``."""
    count, cur = 0, 0
    for t in tokens:
        t = int(t)
        if t > cap:
            return None
        if count == 0 or cur + t > cap:
            count += 1
            cur = t
        else:
            cur += t
    return count


def sorted_order(lengths: Sequence[int]) -> list[int]:
    """Indices of ``lengths`` longest first (ties by index): the order micro-batches are cut in."""
    return sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))


def split_indices(order: Sequence[int], lengths: Sequence[int], m: int) -> list[list[int]]:
    """Eq. 23-24 over the documents ``order`` (indices into ``lengths``): ``m`` micro-batches of indices."""
    ends = balanced_split([lengths[i] for i in order], m)
    starts = [0, *ends[:-1]]
    return [list(order[b:e]) for b, e in zip(starts, ends)]


def chunk_group(lengths: Sequence[int], cap: int, min_batches: int = 1) -> list[list[int]]:
    """Micro-batches (lists of indices into ``lengths``) of one group, longest documents first.

    A document longer than ``cap`` (the tokens a micro-batch may hold without recomputation)
    is a micro-batch of its own (it will recompute the least layers that fit). The others,
    length-sorted, are split by Eq. 23-24 into the fewest micro-batches whose balanced maximum
    fits ``cap`` (:func:`min_parts`), at least ``min_batches`` when there are that many documents.
    """
    order = sorted_order(lengths)
    long = [i for i in order if lengths[i] > cap]
    rest = [i for i in order if lengths[i] <= cap]
    out = [[i] for i in long]
    if rest:
        m = min_parts([lengths[i] for i in rest], cap)
        m = max(int(m), min(int(min_batches) - len(long), len(rest)), 1)
        out.extend(split_indices(rest, lengths, m))
    return out


def packed_group(lengths: Sequence[int], cap: int) -> list[list[int]]:
    """Micro-batches (lists of indices into ``lengths``) packed first-fit decreasing into bins of
    ``cap`` tokens: each document, longest first, joins the first micro-batch it fits in, else opens
    a new one (a document longer than ``cap`` is a micro-batch of its own). Micro-batches in the
    order they were opened, each longest document first."""
    room: list[int] = []  # free tokens per open micro-batch
    out: list[list[int]] = []
    for i in sorted_order(lengths):
        n = int(lengths[i])
        first = next((j for j, free in enumerate(room) if free >= n), None) if n <= cap else None
        if first is not None:
            out[first].append(i)
            room[first] -= n
        else:
            room.append(max(0, int(cap) - n))
            out.append([i])
    return out


def ceil_div(a: int, b: int) -> int:
    return -(-int(a) // int(b)) if b > 0 else math.inf


__all__ = [
    "balanced_split",
    "chunk_group",
    "min_parts",
    "packed_group",
    "sorted_order",
    "split_indices",
    "split_max",
]
