"""Live ranges of the pipeline executor's buffer slots (numpy only, no JAX): greedy interval
colouring, the most ranges live at once and where, and the context pool's first fit.

A range is closed, ``(start, end)`` in the phases of a paired tick table (``3t`` lane 0,
``3t + 1`` lane 1, ``3t + 2`` the filing of what arrived; :mod:`jvarlen.plan.buffers`). Greedy
colouring in order of start uses exactly as many slots as the most ranges that meet at one phase
(interval graphs), so a slot count needs no colouring: :class:`Live` counts by a sweep and colours
only when the executor's tables ask for the slots.
"""

from __future__ import annotations

import heapq
from typing import Optional, Sequence

import numpy as np


def colour(intervals: Sequence[tuple[int, int, object]]) -> tuple[dict, int]:
    """Greedy interval colouring: in order of (start, end), each interval takes the lowest slot whose
    holder has ended before it starts. {key: slot}, number of slots. Closed intervals (start, end,
    key). Heaps of holders and of free slots: O(N log N) (planning colours up to ~10^4 intervals
    per stage and repair step)."""
    holders: list[tuple[int, int]] = []  # (end, slot) of each slot's current holder
    free: list[int] = []  # slots whose holder ended before the current start (starts only grow)
    out, n = {}, 0
    for start, end, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        while holders and holders[0][0] < start:
            heapq.heappush(free, heapq.heappop(holders)[1])
        if free:
            slot = heapq.heappop(free)
        else:
            slot, n = n, n + 1
        out[key] = slot
        heapq.heappush(holders, (end, slot))
    return out, n


def context_pool(intervals: Sequence[Sequence[tuple[int, int, int]]], rows: dict) -> tuple[int, list[dict]]:
    """Base rows of the split documents' regions in the context pool, and the pool's rows.

    ``intervals[p]``: (start, end, root) per document live on stage p (closed phase ranges);
    ``rows[root]``: its region's rows. First fit in order of start: each region takes the lowest
    base where it overlaps no region live at the same time (regions of documents whose live
    ranges do not meet may share rows). Where first fit fragments past what equal slots of the
    largest region would take (one per document in flight), the slots are used instead, so the
    pool never exceeds them. -> (rows, ``[{root: base}]`` per stage)."""
    biggest = max(rows.values(), default=0)
    fit, slotted, fit_rows, slot_rows = [], [], 0, 0
    for iv in intervals:
        placed: list[tuple[int, int, int]] = []  # (base, rows, end) of the regions placed so far
        bases = {}
        for start, end, r in sorted(iv, key=lambda x: (x[0], x[1])):
            live = sorted((b, b + size) for b, size, e in placed if e >= start)
            base = 0
            for lo, hi in live:
                if base + rows[r] <= lo:
                    break
                base = max(base, hi)
            bases[r] = base
            placed.append((base, rows[r], end))
            fit_rows = max(fit_rows, base + rows[r])
        fit.append(bases)
        col, c = colour(iv)
        slotted.append({r: s * biggest for r, s in col.items()})
        slot_rows = max(slot_rows, c * biggest)
    return (fit_rows, fit) if fit_rows <= slot_rows else (slot_rows, slotted)


def peak_of(intervals) -> tuple[int, list]:
    """(tick, holders) at the first phase where the most intervals are live: of the intervals' starts,
    in their order, the first where most closed intervals hold it (where the maximum is reached)."""
    if not intervals:
        return 0, []
    starts = np.array([s for s, _, _ in intervals], np.int64)
    ends = np.array([e for _, e, _ in intervals], np.int64)
    valid = starts <= ends  # an empty range is never live
    # live at x: valid intervals started by x and not ended before it
    live = np.searchsorted(np.sort(starts[valid]), starts, "right") - np.searchsorted(
        np.sort(ends[valid]), starts, "left"
    )
    i = int(np.argmax(live))
    at = int(starts[i])
    return at // 3, sorted(key for s, e, key in intervals if s <= at <= e)


class Live:
    """One stage's live ranges of one slot kind: chunk ``chunks[i]`` holds one slot per layer of
    ``layers[i] = (lo, hi)`` (keys ``(k, l)``), or one slot (key ``k``, ``layers`` None), over the
    closed phase range ``[start[i], end[i]]``. The count and the peak come from a sweep over the
    chunks; the greedy colouring (:func:`colour`), which has that many slots, only when asked."""

    def __init__(self, chunks, start, end, layers=None):
        chunks = np.asarray(chunks, np.int64)
        layers = None if layers is None else np.asarray(layers, np.int64).reshape(-1, 2)  # rows (lo, hi)
        weight = np.ones(len(chunks), np.int64) if layers is None else layers[:, 1] - layers[:, 0]
        held = weight > 0
        self._chunks = chunks[held]
        self.chunks = self._chunks.tolist()
        self.layers = None if layers is None else layers[held]
        self.start = np.asarray(start, np.int64)[held]
        self.end = np.asarray(end, np.int64)[held]
        self.weight = weight[held]
        self.count, self._first = 0, -1
        if len(self.chunks):
            if (self.start > self.end).any():  # (not from a tick table) an empty range still takes a slot
                self.count = colour(self.intervals())[1]
                self._first = int(np.argmax(self._live_at_starts()))
            else:
                live = self._live_at_starts()
                self._first = int(np.argmax(live))
                self.count = int(live[self._first])
        self._slots: Optional[dict] = None
        self._peak: Optional[tuple[int, list]] = None
        self._arrays: Optional[tuple[np.ndarray, np.ndarray]] = None

    def _live_at_starts(self) -> np.ndarray:
        """Weight of the (non-empty) ranges that hold each chunk's start."""
        ok = self.start <= self.end
        by_start, by_end = np.argsort(self.start[ok], kind="stable"), np.argsort(self.end[ok], kind="stable")
        started = np.concatenate([[0], np.cumsum(self.weight[ok][by_start])])
        ended = np.concatenate([[0], np.cumsum(self.weight[ok][by_end])])
        s, e = self.start[ok][by_start], self.end[ok][by_end]
        return started[np.searchsorted(s, self.start, "right")] - ended[np.searchsorted(e, self.start, "left")]

    def intervals(self) -> list:
        if self.layers is None:
            return [(s, e, k) for k, s, e in zip(self.chunks, self.start.tolist(), self.end.tolist())]
        return [
            (s, e, (k, l))
            for k, s, e, (lo, hi) in zip(self.chunks, self.start.tolist(), self.end.tolist(), self.layers.tolist())
            for l in range(lo, hi)
        ]

    def peak(self) -> tuple[int, list]:
        """(tick, holders) at the first chunk start (in order) where the most slots are held, as
        :func:`peak_of` finds on :meth:`intervals` (computed once: a memo serves one range set to
        many calls)."""
        if self._peak is None:
            at, chunks = self._at_peak()
            if self.layers is None:
                keys = sorted(chunks.tolist())
            else:  # (chunk, layer) for the layers lo..hi-1 of each live chunk, sorted
                lo, hi = self.layers[self._live_at(at)].T
                k = np.repeat(chunks, hi - lo)
                layer = np.arange(len(k)) - np.repeat(np.cumsum(hi - lo) - (hi - lo) - lo, hi - lo)
                order = np.lexsort((layer, k))
                keys = list(zip(k[order].tolist(), layer[order].tolist()))
            self._peak = at // 3, keys
        return self._peak

    def peak_chunks(self) -> list[int]:
        """The chunks among :meth:`peak`'s holders, ascending (without a key per layer)."""
        return sorted(self._at_peak()[1].tolist())

    def _at_peak(self) -> tuple[int, np.ndarray]:
        """(phase of the peak, chunks live there); (0, none) without ranges."""
        if self._first < 0:
            return 0, self._chunks[:0]
        at = int(self.start[self._first])
        return at, self._chunks[self._live_at(at)]

    def _live_at(self, at: int) -> np.ndarray:
        return (self.start <= at) & (at <= self.end)

    @property
    def slots(self) -> dict:
        if self._slots is None:
            self._slots, count = colour(self.intervals())
            assert count == self.count, (count, self.count)  # greedy in order of start is optimal
        return self._slots

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys ``[m, 1 or 2]``: chunk, or chunk and layer; their slots ``[m]``)."""
        if self._arrays is None:
            keys = np.array(list(self.slots), np.int64)
            keys = keys.reshape(len(keys), -1) if len(keys) else np.zeros((0, 1), np.int64)
            self._arrays = keys, np.fromiter(self.slots.values(), np.int32, len(self.slots))
        return self._arrays


__all__ = ["Live", "colour", "context_pool", "peak_of"]
