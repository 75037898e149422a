"""Chunks as token pieces, families of chunks, and the token-level 1F1B op order of a unit.

A *piece* is ``(doc, start, length)``: a contiguous token range of one document.
A :class:`PlannedChunk` is a list of pieces (InfiniPipe §3.1.1); a *family* is the
set of chunks one split document occupies (or one batched chunk); a *unit* is an
ordered list of families scheduled as one 1F1B pipeline (§3.3, Eq. 7).

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.schedule import Op, Schedule

Piece = tuple[int, int, int]  # (doc, start, length)


@dataclasses.dataclass(frozen=True)
class PlannedChunk:
    """One pipeline micro-batch: ``pieces[0]`` may continue a split document, the rest are whole documents."""

    pieces: tuple[Piece, ...]

    @property
    def tokens(self) -> int:
        return sum(p[2] for p in self.pieces)

    def shape(self, lengths: Sequence[int]) -> ChunkShape:
        """The cost-model view ``{C, S}``: C = start of the first piece; tail unless the first piece continues."""
        doc, start, length = self.pieces[0]
        tail = start + length == lengths[doc]
        return ChunkShape(start, tuple(p[2] for p in self.pieces), tail=tail)

    def split_doc(self, lengths: Sequence[int]) -> int | None:
        """The document this chunk holds a slice of (a piece that is not the whole document), if any."""
        doc, start, length = self.pieces[0]
        return None if (start == 0 and length == lengths[doc]) else doc


def families_of(chunks: Sequence[PlannedChunk], lengths: Sequence[int]) -> list[list[int]]:
    """Partitions chunk indices into families: the chunks of each split document in slice order, else singletons.

    Raises ValueError if a chunk holds a slice of a split document outside its first piece.
    """
    by_doc: dict[int, list[tuple[int, int]]] = {}
    families: list[list[int]] = []
    for k, chunk in enumerate(chunks):
        for doc, start, length in chunk.pieces[1:]:
            if start != 0 or length != lengths[doc]:
                raise ValueError(f"chunk {k}: piece {(doc, start, length)} is a slice but not the first piece")
        doc = chunk.split_doc(lengths)
        if doc is None:
            families.append([k])
        else:
            by_doc.setdefault(doc, []).append((chunk.pieces[0][1], k))
    for doc in sorted(by_doc):
        families.append([k for _, k in sorted(by_doc[doc])])
    return families


_OPS: dict[tuple[str, int], Op] = {}


def _op(kind: str, chunk: int) -> Op:
    """Interned (immutable) ops: building thousands of them dominates schedule construction."""
    op = _OPS.get((kind, chunk))
    if op is None:
        op = _OPS[(kind, chunk)] = Op(kind, chunk)
    return op


def unit_schedule(families: Sequence[Sequence[int]], pp: int) -> tuple[list[int], Schedule]:
    """Token-level 1F1B schedule of one unit (§3.3, Eq. 7; Seq1F1B's order).

    Returns the unit's chunk ids in forward order (families in order, slices in
    document order) and a :class:`Schedule` over *local* ids ``0..n-1``. Backward
    order: families in order, each family's slices reversed. Stage p (0-based)
    warms up with ``W_p = pp - 1 - p + N_prefill`` forwards (its window, Eq. 7)
    and then strictly alternates one backward, one forward, so that it stays
    ``W_p`` chunks ahead; N_prefill = the largest family.

    (:func:`jvarlen.plan.schedule.token_level_1f1b` runs only the forwards the next
    backward needs; with several multi-slice families in a row that drains the
    pipeline once per family, so the unit keeps the full Eq. 7 window instead.)
    """
    ids: list[int] = []
    prev: list[int] = []
    for fam in families:
        for i, k in enumerate(fam):
            prev.append(len(ids) - 1 if i > 0 else -1)
            ids.append(int(k))
    n = len(ids)
    border = [k for f in _local_families(families) for k in reversed(f)]
    n_prefill = max((len(f) for f in families), default=1)
    stages = []
    for p in range(pp):
        window = pp - 1 - p + n_prefill
        prog: list[Op] = []
        f_done = 0
        for i, b in enumerate(border):
            target = min(n, window + i)
            while f_done < target:
                prog.append(_op("F", f_done))
                f_done += 1
            prog.append(_op("B", b))
        stages.append(tuple(prog))
    return ids, Schedule(tuple(stages), tuple(prev))  # valid by construction; Plan.validate re-checks


def _local_families(families: Sequence[Sequence[int]]) -> list[list[int]]:
    out, i = [], 0
    for fam in families:
        out.append(list(range(i, i + len(fam))))
        i += len(fam)
    return out


def backward_windows(program: Sequence[Op]) -> list[tuple[tuple[int, ...], int]]:
    """(live chunks, chunk) at the start of each backward of one stage: the peaks of Eq. 8's
    windows W_p(t) plus that backward's transients (``CostModel.backward_memory``).

    A chunk is live from the start of its forward to the end of its backward. Every window right
    after a forward is also the live set of the next backward (the set changes only at forwards and
    backwards), so these constraints imply Eq. 8's.
    """
    live: list[int] = []
    windows: list[tuple[tuple[int, ...], int]] = []
    for op in program:
        if op.kind == "F":
            live.append(op.chunk)
        else:
            windows.append((tuple(live), op.chunk))
            live.remove(op.chunk)
    return windows


def backward_rank(program: Sequence[Op]) -> dict[int, int]:
    """f2b of Eq. 16: chunk id -> its position in this stage's backward order."""
    ks = [op.chunk for op in program if op.kind == "B"]
    return {k: r for r, k in enumerate(ks)}
