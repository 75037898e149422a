"""Workload-balanced chunking (InfiniPipe §3.2, Alg. 1).

Long documents are split along a *slice mesh* (the longest document cut into N
slices of equal backward time, so later slices are shorter); their non-final
slices become split chunks, their tail slices seed buckets, and short documents
are packed best-fit-decreasing into the buckets under a time threshold T_t and a
token threshold T_m, preferring buckets with low time/token, perturbing T_t when
nothing fits. Two tail slices never share a chunk. For an executor that pads every
chunk to one bucket the mesh may instead have bucket-sized slices (:func:`bucket_mesh`).

The cost model is used only through ``cost.bwd_time(ChunkShape)``.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import weakref
from typing import Sequence

import numpy as np

from jvarlen.plan.chunk import ChunkShape, document_lengths
from jvarlen.plan.units import Piece, PlannedChunk


@dataclasses.dataclass(frozen=True)
class Mesh:
    """Slice lengths of the longest document (``slices[0]`` longest) and the thresholds of Alg. 1 line 1."""

    slices: tuple[int, ...]
    time_threshold: float  # T_t: backward time of the slowest mesh slice
    token_threshold: int  # T_m: tokens of the longest mesh slice

    @property
    def boundaries(self) -> list[int]:
        out, acc = [], 0
        for s in self.slices:
            acc += s
            out.append(acc)
        return out


@dataclasses.dataclass(frozen=True)
class ChunkingResult:
    """Chunks of Alg. 1 and the thresholds actually used (T_t after perturbation)."""

    chunks: tuple[PlannedChunk, ...]
    mesh: Mesh
    time_threshold: float
    token_threshold: int
    perturbations: int


def longest_slice(cost, context: int, remaining: int, tau: float, tail_at_end: bool, hint: int = 0) -> int:
    """Longest s ≤ remaining with bwd_time({context, (s,)}) ≤ tau (at least 1 token).

    The time is nondecreasing in s. From ``hint`` (the previous slice of the same cut: successive
    slices differ little) the answer is bracketed by galloping and then bisected, O(log |s - hint|)
    cost evaluations; without a hint, a quadratic through three evaluations (Eq. 1 + Eq. 3 make
    the time quadratic in s for a fixed context) gives the starting guess.
    """

    def t(s: int) -> float:
        return cost.bwd_time(ChunkShape(context, (s,), tail=tail_at_end and s == remaining))

    if t(remaining) <= tau:
        return remaining
    if remaining == 1:
        return 1
    guess = hint
    if not 0 < guess < remaining and remaining >= 8:
        xs = (1.0, float(remaining // 2), float(remaining - 1))
        ys = [cost.bwd_time(ChunkShape(context, (int(x),), tail=False)) for x in xs]
        qa, qb, qc = np.polyfit(xs, ys, 2)
        disc = qb * qb - 4 * qa * (qc - tau)
        if qa > 0 and disc >= 0:
            guess = int(math.floor((-qb + math.sqrt(disc)) / (2 * qa)))
    guess = min(remaining - 1, max(1, guess or remaining // 2))
    # invariant: t(lo) <= tau (or lo == 1, the floor) and t(hi + 1) > tau
    if t(guess) <= tau:
        lo, step, hi = guess, 1, remaining - 1
        while lo < remaining - 1:
            probe = min(remaining - 1, lo + step)
            if t(probe) > tau:
                hi = probe - 1
                break
            lo, step = probe, 2 * step
    else:
        hi, step, lo = guess - 1, 1, 1
        while hi > 1:
            probe = max(1, hi - step)
            if t(probe) <= tau:
                lo = probe
                break
            hi, step = probe - 1, 2 * step
        else:
            return 1  # even one token costs more than tau: the floor
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if t(mid) <= tau:
            lo = mid
        else:
            hi = mid - 1
    return lo


def cut(cost, length: int, tau: float, max_slices: int | None = None) -> list[int] | None:
    """Slices of a ``length``-token document, each the longest whose backward time is ≤ ``tau``;
    None as soon as more than ``max_slices`` would be needed (bounds the work when ``tau`` is
    below what a short slice can cost, e.g. under the profile's smallest token bucket)."""
    slices, ctx = [], 0
    while ctx < length:
        if max_slices is not None and len(slices) >= max_slices:
            return None
        s = longest_slice(cost, ctx, length - ctx, tau, tail_at_end=True, hint=slices[-1] if slices else 0)
        slices.append(s)
        ctx += s
    return slices


def split_mesh(cost, max_length: int, n_slices: int, iters: int = 16) -> Mesh:
    """Alg. 1 line 1: N slices of the longest document with (nearly) equal backward time.

    Bisection on the time target τ: each slice is the longest one whose backward
    time (given its causal context) is ≤ τ; the least τ that needs ≤ N slices wins.
    Kept per cost model (its costs are fixed when it is built): the planner asks for the same
    mesh for each group of a layout and each batch whose longest document is the context cap.
    """
    if n_slices < 1 or max_length < 1:
        raise ValueError(f"need n_slices >= 1 and max_length >= 1, got {n_slices}, {max_length}")
    meshes = _MESHES.setdefault(cost, {})
    key = (int(max_length), min(int(n_slices), int(max_length)), int(iters))
    if key not in meshes:
        meshes[key] = _split_mesh(cost, *key)
    return meshes[key]


_MESHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cost model -> {(length, N, iters): Mesh}


def _split_mesh(cost, max_length: int, n_slices: int, iters: int) -> Mesh:
    # Equal-time slices take about T(whole)/N each (plus per-chunk constants): bracket around that.
    whole = cost.bwd_time(ChunkShape(0, (max_length,)))
    hi = 2.0 * whole / n_slices
    best = cut(cost, max_length, hi, n_slices)
    while best is None:  # terminates: at hi >= T(whole) one slice does
        hi *= 2.0
        best = cut(cost, max_length, hi, n_slices)
    lo = 0.5 * whole / n_slices
    for _ in range(64):  # a lower bracket: time targets no N-slice cut meets (bounded halvings)
        if lo <= 0 or cut(cost, max_length, lo, n_slices) is None:
            break
        lo *= 0.5
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        slices = cut(cost, max_length, mid, n_slices)
        if slices is not None:
            hi, best = mid, slices
        else:
            lo = mid
    ctx, times = 0, []
    for i, s in enumerate(best):
        times.append(cost.bwd_time(ChunkShape(ctx, (s,), tail=i == len(best) - 1)))
        ctx += s
    return Mesh(tuple(best), max(times), max(best))


def bucket_mesh(cost, max_length: int, tokens: int) -> Mesh:
    """The longest document cut into slices of ``tokens`` tokens and a shorter last one (not cut if
    it is no longer); T_m = ``tokens``, T_t = the backward time of the slowest slice or of one
    ``tokens``-token document, whichever is larger (so that short documents can fill a chunk).

    For an executor that pads every chunk of a step to one token bucket (jvarlen's pipeline
    executor) a chunk's matmuls cost the bucket whatever its tokens: Alg. 1's equal-time slices
    (shorter the more context they have) leave the later ones padded to the first one's length,
    and its T_m (the first slice) never packs chunks longer than the longest document; slices and
    packed chunks of the bucket's size fill it. :func:`jvarlen.plan.epp.plan_epp` tries both meshes under the
    ``"paired"`` simulation, which models that padding."""
    if tokens < 1 or max_length < 1:
        raise ValueError(f"need tokens >= 1 and max_length >= 1, got {tokens}, {max_length}")
    n = -(-max_length // tokens)
    slices = [tokens] * (n - 1) + [max_length - tokens * (n - 1)]
    ctx, times = 0, [cost.bwd_time(ChunkShape(0, (tokens,)))]
    for i, s in enumerate(slices):
        times.append(cost.bwd_time(ChunkShape(ctx, (s,), tail=i == n - 1)))
        ctx += s
    return Mesh(tuple(slices), max(times), tokens)


def split_document(length: int, mesh: Mesh) -> list[int]:
    """Alg. 1 line 2 for one document: ``mesh[:j] + [length - b_j]``, j the last boundary below ``length``.

    A document no longer than the first mesh slice is short: ``[length]``.
    """
    pieces, prev = [], 0
    for s, b in zip(mesh.slices, mesh.boundaries):
        if b >= length:
            break
        pieces.append(s)
        prev = b
    pieces.append(length - prev)
    return pieces


def _added_time(cost):
    """If the backward time of a chunk is a sum over its slices plus a per-chunk constant
    (Eq. 1 and Eq. 3 are), return ``t_doc -> extra time of adding that whole document``;
    else None (every candidate bucket is then re-evaluated with the cost model)."""
    t = lambda *sl, ctx=0: cost.bwd_time(ChunkShape(ctx, tuple(sl)))  # noqa: E731
    const = 2 * t(1) - t(1, 1)
    for ctx, a, b in ((5000, 1000, 3000), (0, 7, 20000), (123, 4096, 1)):
        direct = t(a, b, ctx=ctx)
        summed = t(a, ctx=ctx) + t(b) - const
        if abs(direct - summed) > 1e-9 * direct:
            return None
    return lambda doc_time: doc_time - const


class _Bucket:
    __slots__ = ("pieces", "context", "tail", "tokens", "time")

    def __init__(self, piece: Piece, context: int, tail: bool, cost):
        self.pieces = [piece]
        self.context = context
        self.tail = tail
        self.tokens = piece[2]
        self.time = cost.bwd_time(self.shape())

    def shape(self, extra: int | None = None) -> ChunkShape:
        slices = tuple(p[2] for p in self.pieces) + (() if extra is None else (extra,))
        return ChunkShape(self.context, slices, tail=self.tail)


def chunk_batch(
    lengths: Sequence[int],
    cost,
    n_slices: int,
    token_capacity: int | None = None,
    max_perturbation: float | None = 0.05,
    pack_tokens: int | None = None,
    slice_tokens: int | None = None,
) -> ChunkingResult:
    """Alg. 1: workload-balanced chunks of the documents ``lengths`` for slice number N = ``n_slices``.

    ``token_capacity`` (the cost model's max tokens per chunk) caps T_m.
    ``max_perturbation``: line 16 may raise T_t to at most ``(1 + max_perturbation)·τ``
    (τ = the mesh's slice time); a document that fits no bucket below that opens a new
    bucket instead. ``None`` keeps the paper's unbounded perturbation.
    ``pack_tokens`` further caps T_m for packing (memory of a full 1F1B window of
    batched chunks); an unsplit document longer than that becomes a chunk of its own.
    ``slice_tokens``: cut along :func:`bucket_mesh` slices of that many tokens instead of Alg. 1
    line 1's N equal-time slices (``n_slices`` is then unused).
    Returns split chunks (in document and slice order) followed by the buckets.
    """
    lengths = document_lengths(lengths)
    if slice_tokens is None:
        mesh = split_mesh(cost, max(lengths), n_slices)
    else:
        mesh = bucket_mesh(cost, max(lengths), slice_tokens)
    t_m = mesh.token_threshold if token_capacity is None else min(mesh.token_threshold, int(token_capacity))
    if token_capacity is not None and mesh.slices[0] > token_capacity:
        what = f"N={n_slices}" if slice_tokens is None else f"slices of {slice_tokens} tokens"
        fix = "raise n_slices" if slice_tokens is None else "use shorter slices"
        raise ValueError(f"{what}: longest mesh slice has {mesh.slices[0]} tokens > capacity {token_capacity}; {fix}")
    if pack_tokens is not None:
        t_m = max(1, min(t_m, int(pack_tokens)))
    t_t = mesh.time_threshold

    split_chunks: list[PlannedChunk] = []
    buckets: list[_Bucket] = []
    shorts: list[tuple[float, int, int]] = []  # (time, length, doc)
    for doc, length in enumerate(lengths):
        parts = split_document(length, mesh)
        if len(parts) == 1:
            shorts.append((cost.bwd_time(ChunkShape(0, (length,))), length, doc))
            continue
        start = 0
        for s in parts[:-1]:
            split_chunks.append(PlannedChunk(((doc, start, s),)))
            start += s
        buckets.append(_Bucket((doc, start, parts[-1]), start, True, cost))

    added = _added_time(cost)  # time of one more whole document in a bucket, if Eq. 1/3 are additive
    # Line 9's order: buckets by time/token (then index), kept sorted incrementally.
    order = sorted((b.time / b.tokens, i) for i, b in enumerate(buckets))

    def add_bucket(piece: Piece, time_: float | None = None) -> None:
        buckets.append(_Bucket(piece, 0, True, cost))
        bisect.insort(order, (buckets[-1].time / buckets[-1].tokens, len(buckets) - 1))

    shorts.sort(key=lambda x: (-x[0], -x[1], x[2]))  # line 4: descending time, deterministic ties
    perturbations = 0
    min_tokens = min((b.tokens for b in buckets), default=None)
    for short_time, length, doc in shorts:
        piece = (doc, 0, length)
        if min_tokens is None or min_tokens + length > t_m:  # lines 7-8 (also: a document longer than T_m)
            add_bucket(piece)
            min_tokens = min(b.tokens for b in buckets)
            continue
        while True:
            placed = False
            candidates = []
            for pos, (_, i) in enumerate(order):  # lines 10-14, lowest time/token first
                b = buckets[i]
                if b.tokens + length > t_m:
                    continue
                new_time = b.time + added(short_time) if added else cost.bwd_time(b.shape(length))
                candidates.append(new_time)
                if new_time <= t_t:
                    b.pieces.append(piece)
                    b.tokens += length
                    b.time = new_time
                    del order[pos]
                    bisect.insort(order, (b.time / b.tokens, i))
                    placed = True
                    break
            if placed:
                break
            # Line 16: perturb T_t to the least value that admits this document (token-feasible buckets only).
            least = min(candidates)
            if max_perturbation is not None and least > (1.0 + max_perturbation) * mesh.time_threshold:
                add_bucket(piece)
                break
            t_t = least
            perturbations += 1
        min_tokens = min(b.tokens for b in buckets)

    chunks = split_chunks + [PlannedChunk(tuple(b.pieces)) for b in buckets]
    return ChunkingResult(tuple(chunks), mesh, t_t, t_m, perturbations)
