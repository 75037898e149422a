"""The uniform chunk shape ``{C, S}`` of InfiniPipe §3.1.1, shared by the cost model and the planner.

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import operator
from typing import Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class ChunkShape:
    """What the cost model needs to know about one chunk (one pipeline micro-batch).

    ``context`` is C, the number of earlier tokens of the document that ``slices[0]``
    continues (0 for a batched chunk); ``slices`` are the token counts of the pieces
    packed into the chunk, ``slices[0]`` being s0 when ``context > 0``. ``tail`` is
    I_k of Eq. 5/9: the chunk holds the last slice of a split document (or no split
    slice at all), so it produces no K/V gradient for later slices.

    Batched chunk: ``ChunkShape(0, (a, b, c))``; split chunk: ``ChunkShape(C, (s,), tail=False)``;
    hybrid chunk: ``ChunkShape(C, (s0, a, b), tail=True)``.
    """

    context: int
    slices: tuple[int, ...]
    tail: bool = True

    def __post_init__(self):
        if self.context < 0:
            raise ValueError(f"ChunkShape.context must be >= 0, got {self.context}")
        if not self.slices or any(s <= 0 for s in self.slices):
            raise ValueError(f"ChunkShape.slices must be positive lengths, got {self.slices}")

    @property
    def tokens(self) -> int:
        return sum(self.slices)

    @property
    def attention_pairs(self) -> int:
        """Σ of squared terms in Eq. 1: (C+s0)² − C² for the first slice, s² for the rest."""
        s0, *rest = self.slices
        return (self.context + s0) ** 2 - self.context**2 + sum(s * s for s in rest)


def document_lengths(lengths) -> list[int]:
    """``lengths`` (token counts of one batch's documents) as a list of ints, or a ValueError naming
    the first entry that is not a positive whole number: a fractional, boolean or non-numeric entry
    would otherwise be truncated by ``int`` or fail deep inside a planner. Whole floats (1000.0)
    and numpy integers pass."""
    out = []
    for i, x in enumerate(lengths):
        n = None
        if not isinstance(x, (bool, np.bool_)):
            try:
                n = operator.index(x)
            except TypeError:
                if isinstance(x, numbers.Real) and float(x).is_integer():
                    n = int(x)
        if n is None or n < 1:
            raise ValueError(
                f"lengths must be a non-empty list of positive document lengths (whole token counts); "
                f"entry {i} is {x!r}"
            )
        out.append(n)
    if not out:
        raise ValueError("lengths must be a non-empty list of positive document lengths, got none")
    return out


BUCKET_STEPS = 8
"""Steps per power of two of the executor's token buckets. Eighths rather than quarters: on the
64-device H100 settings of ``scripts/bench_strategies.py`` homogeneous, Hydraulis and FlexSP plans
simulate 8-13 % faster (median), and with the runtime's reuse of compiled buckets a run compiles
about as many programs (``scripts/bucket_steps.py``; docs/design/pipeline.md, "Chunk buckets")."""


def executor_buckets(longest: int, sp: int = 1, steps: int | None = None) -> list[int]:
    """Token buckets the pipeline executor may pad a plan's chunks to, smallest first: every chunk of
    a step is padded to one bucket that holds the plan's longest chunk (``longest`` tokens), a
    multiple of ``1/steps`` of the next power of two p (at least 16 tokens) up to p, so padding
    stays under ``p/steps``. The step must be divisible by ``sp``: where it is not, coarser steps
    (halving ``steps``), and p itself where none is. ``steps``: :data:`BUCKET_STEPS` when None
    (read at call time, so that a what-if script may change it)."""
    steps = BUCKET_STEPS if steps is None else int(steps)
    top = max(16, sp, 1 << max(0, (max(longest, 1) - 1).bit_length()))
    step = max(16, top // steps)
    while step % sp and steps > 1:
        steps //= 2
        step = max(16, top // steps)
    if step % sp:
        return [top]
    first = -(-max(longest, 1) // step) * step
    return list(range(first, top + 1, step))


def executor_bucket(longest: int, sp: int = 1) -> int:
    """The bucket the executor pads a step to whose longest chunk holds ``longest`` tokens: the
    smallest of :func:`executor_buckets` (a compiled larger one may be reused at run time)."""
    return executor_buckets(longest, sp)[0]


def executor_bucket_below(tokens: int, sp: int = 1) -> Optional[int]:
    """The largest bucket the executor may pad a step to that is at most ``tokens`` (None: none is),
    so that a step whose chunks hold at most that many tokens pads to no more than ``tokens``."""
    bucket = executor_bucket(tokens, sp)
    if bucket <= tokens:
        return bucket
    top = executor_buckets(bucket, sp)[-1]
    below = [b for b in executor_buckets(top // 2 + 1, sp) if b <= tokens]  # the bucket's power of two
    if below:
        return below[-1]
    half = top // 2  # the top of the power of two below
    return half if half >= 1 and executor_bucket(half, sp) == half else None


def bucket_bins(longest: int, top: int, sp: int = 1) -> list[int]:
    """Bin sizes (tokens) worth packing documents into whose longest holds ``longest`` tokens, when
    a micro-batch may hold at most ``top``: every executor bucket from that document's up to
    ``top``, then ``top`` itself (its bucket fits where ``top`` was admitted), smallest first."""
    out, bucket = [], executor_bucket(int(longest), sp)
    while bucket <= top:
        out.append(bucket)
        bucket = executor_bucket(bucket + 1, sp)
    if top >= longest and (not out or out[-1] < top):
        out.append(int(top))
    return out


def executor_context(shapes: Sequence[ChunkShape], bucket: int) -> int:
    """Context tokens the pipeline executor's K/V buffers hold for a step of these chunks padded to
    ``bucket``: max(C + bucket) over chunks of split documents (with context, or continuing into a
    later slice), rounded up to a multiple of ``bucket``; 0 when no document is split (as
    ``PipelineChunks.context_bucket`` and ``prepare_batch`` size them)."""
    linked = [c.context for c in shapes if c.context > 0 or not c.tail]
    if not linked:
        return 0
    return -(-(max(linked) + bucket) // bucket) * bucket


@functools.lru_cache(maxsize=65536)
def tile_pairs(chunk: ChunkShape, block: int) -> float:
    """Attention work of a block-skipping kernel in units of ``attention_pairs``.

    Layout assumed (and used by the profiler's harness): the chunk's slices are consecutive
    from a block boundary, the ``C`` context keys fill whole blocks right before it. A
    ``block x block`` tile is visited when some document has a query in its row block and a
    visible key (causal) in its column block; it costs ``2·block²`` (``attention_pairs`` counts
    ``(C+s)² − C²``, twice the causal pairs). For one slice of ``n`` whole blocks this is
    ``block²·n(n+1) ≈ T² + T·block``.
    """
    b = block
    nq = -(-chunk.tokens // b)
    nctx = -(-chunk.context // b)
    if len(chunk.slices) == 1:  # the planner's hot path: one slice, nq(nq+1)/2 causal tiles
        return 2.0 * b * b * (nq * (nq + 1) // 2 + nctx * nq)
    # Row block i sees the columns [first(i), i], first(i) being the first block of the earliest
    # slice with a query in row block i (every slice's visible columns end at the diagonal):
    # O(blocks) instead of a blocks² mask (a 2M-token slice has 15,625 blocks of 128).
    ends = np.cumsum(chunk.slices)
    first = np.empty(nq, np.int64)
    for start, end in reversed(list(zip(ends - np.asarray(chunk.slices), ends))):
        first[start // b : (end - 1) // b + 1] = start // b
    tiles = int((np.arange(nq) - first + 1).sum())
    if chunk.context:
        tiles += nctx * ((chunk.slices[0] - 1) // b + 1)
    return 2.0 * b * b * tiles
