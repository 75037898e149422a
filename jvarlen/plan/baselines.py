"""Chunkers of the baselines and ablations, in the same framework as EPP (InfiniPipe §5.1, §5.5).

* DAPPLE (batch-level PP): whole documents packed first-fit-decreasing into
  micro-batches of at most ``budget`` tokens; no splitting.
* Seq1F1B (enhanced, §5.1): long documents cut into fixed-size slices, the tails and
  short documents packed first-fit-decreasing by tokens into chunks of that size.
* "w/o wbc" (§5.5): long documents split *evenly* into the fewest slices of at most
  the chunk size, the rest packed into fixed-length chunks by tokens.

Tail slices always open their own bucket (two tails never share a chunk). Chunks come
back split chunks first (document and slice order), then the packed buckets.
"""

from __future__ import annotations

import math
from typing import Sequence

from jvarlen.plan.units import Piece, PlannedChunk


def _ffd(seeds: list[tuple[Piece, ...]], items: list[Piece], budget: int) -> list[tuple[Piece, ...]]:
    """First-fit-decreasing by tokens: ``seeds`` are open buckets (a tail slice each), items whole documents."""
    buckets = [list(s) for s in seeds]
    loads = [sum(p[2] for p in s) for s in seeds]
    for item in sorted(items, key=lambda p: (-p[2], p[0])):
        for i, load in enumerate(loads):
            if load + item[2] <= budget:
                buckets[i].append(item)
                loads[i] += item[2]
                break
        else:
            buckets.append([item])
            loads.append(item[2])
    return [tuple(b) for b in buckets]


def _split(
    lengths: Sequence[int], slice_tokens: int, even: bool
) -> tuple[list[PlannedChunk], list[tuple[Piece, ...]], list[Piece]]:
    splits, tails, shorts = [], [], []
    for doc, length in enumerate(lengths):
        if length <= slice_tokens:
            shorts.append((doc, 0, int(length)))
            continue
        n = math.ceil(length / slice_tokens)
        if even:
            sizes = [length // n + (1 if i < length % n else 0) for i in range(n)]
        else:
            sizes = [slice_tokens] * (n - 1) + [length - slice_tokens * (n - 1)]
        start = 0
        for s in sizes[:-1]:
            splits.append(PlannedChunk(((doc, start, s),)))
            start += s
        tails.append(((doc, start, sizes[-1]),))
    return splits, tails, shorts


def dapple_chunks(lengths: Sequence[int], budget: int) -> list[PlannedChunk]:
    """Batch-level micro-batches: whole documents, FFD into ≤ ``budget`` tokens (a longer document stays alone)."""
    items = [(doc, 0, int(n)) for doc, n in enumerate(lengths)]
    return [PlannedChunk(b) for b in _ffd([], items, budget)]


def fixed_size_chunks(lengths: Sequence[int], chunk_tokens: int, even_split: bool = False) -> list[PlannedChunk]:
    """Seq1F1B-style (``even_split=False``) or "w/o wbc" (``even_split=True``) fixed-length chunks."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    splits, tails, shorts = _split([int(x) for x in lengths], chunk_tokens, even_split)
    return splits + [PlannedChunk(b) for b in _ffd(tails, shorts, chunk_tokens)]
