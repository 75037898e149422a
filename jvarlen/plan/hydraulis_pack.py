"""Packing within one pipeline (Hydraulis §6.1, Eq. 1) with the pruned enumeration of V (App. C).

Given the ``U`` documents dispatched to a pipeline of scheme ``P``, choose the number of
micro-batches ``V`` and the micro-batch of every document to minimise Eq. 1::

    max_j ( Σ_i o_ij T(l_i, P) ) × (PP(P) - 1 + V)      s.t.  Σ_i o_ij l_i ≤ MaxLen(P)

Our reading of the terms: a micro-batch costs ``c + Σ_i o_ij w(l_i)`` (one launch constant per
micro-batch, :mod:`jvarlen.plan.hydraulis_costs`), and the capacity is the no-recomputation
capacity ``caps[0]``. A document longer than that (allowed up to ``MaxLen`` with
recomputation, ``recompute="auto"``) is a micro-batch of its own, priced with the layers it must
recompute; the ILP packs the rest, ``V = n_long + V'``. With jvarlen's lock-step executor a
micro-batch costs κ T in the steady state (κ ≈ 4/3 for pp > 1; 1 for the paper's asynchronous
1F1B). Two objectives (``PackOptions.objective``), with ``t_k`` the micro-batch times:

* ``"eq1"`` — Eq. 1: ``(PP - 1 + κ V) · max_k t_k``;
* ``"sum"`` (default) — ``(PP - 1) · max_k t_k + κ Σ_k t_k``: App. D.1's bound evaluated on the
  packing. Micro-batches are whole documents, so one long document often cannot be balanced
  against the rest; Eq. 1 then overestimates the pipeline 1.2-4.6× against the lock-step
  simulator, this one stays within −2 … +8 %.

For a fixed V both minimise the slowest micro-batch (the same ILP); they differ in which V wins.

``V'`` runs over App. C's range ``[max(Σl / cap, 1), min(Σl / UtilLen, U)]`` (``prune=False``:
``[⌈Σl / cap⌉, U]``), its upper end raised to at least ``min(⌈2 Σl / cap⌉, U)``: the most
micro-batches first-fit decreasing can need (every micro-batch but one more than half full), so
that the range always holds a packing within the capacity, first-fit decreasing's. (With a large
per-micro-batch constant ``UtilLen`` exceeds ``Σl`` and App. C's range is ``⌈Σl / cap⌉`` alone,
which no packing may reach; a packing of no ``V`` in the range would leave every document its own
micro-batch.) For each ``V'`` a lower bound (the objective with the slowest packed
micro-batch at ``c + max(max w, Σw / V')``) and an LPT packing (longest first into the
least-loaded micro-batch that has room) are cheap; the ILP runs only for the ``V'`` whose bound
beats the best packing found so far by more than ``gap`` and whose LPT packing is not already
within ``gap`` of that bound, in order of the bound (branch and bound over V), with CP-SAT's
relative gap limit set to ``gap``. So the result is within ``gap`` of the optimum (``gap = 0``:
the optimum) whenever every ILP it needed finished (``source`` "ilp" or "lpt").

Solver code in four steps (data → model → solve → extract): :func:`_data` → :func:`_cp_model` → :func:`_solve_v`
(CP-SAT with the LPT hint, deterministic time + wall-clock limit, one worker, fixed seed, status
checked, solution re-verified, LPT fallback) → :func:`_extract`.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from typing import Optional, Sequence

import numpy as np
from ortools.sat.python import cp_model

from jvarlen.plan import cpsat
from jvarlen.plan.chunking import packed_group
from jvarlen.plan.hydraulis_costs import SchemeTable

_REL = 1e-9  # relative tolerance when comparing objectives


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """Limits of one pipeline's packing. ``ilp=False``: LPT only (the per-candidate estimate)."""

    ilp: bool = True
    prune: bool = True  # App. C's upper end Σl / UtilLen for V
    gap: float = 0.01  # accept a packing within this fraction of Eq. 1's optimum (0: exact)
    time_limit_s: float = 0.1  # wall-clock safety per ILP (a hit makes the result timing-dependent)
    deterministic_time: float = 0.01  # CP-SAT deterministic-time units per ILP (reproducible)
    max_solves: int = 1  # ILPs per pipeline at most (branch and bound over V)
    max_vars: int = 4000  # larger models are not built (many documents: LPT is within a few % of the bound)
    seed: int = 0
    objective: str = "sum"  # "sum": (pp - 1)·slowest + κ·Σ micro-batches; "eq1": (pp - 1 + κ V)·slowest

    def __post_init__(self):
        if self.objective not in ("sum", "eq1"):
            raise ValueError(f"objective must be 'sum' or 'eq1', got {self.objective!r}")


@dataclasses.dataclass(frozen=True)
class PackResult:
    """``micro_batches``: indices into the pipeline's documents, one tuple per micro-batch, in
    execution order (slowest first); ``objective_s``: Eq. 1 (seconds); ``lower_bound_s``: the least
    bound over the V range; ``source``: "ilp" (every needed ILP optimal), "ilp-limit" (an ILP hit a
    limit, its best solution kept), "lpt" (no ILP needed or ``ilp=False``), "lpt-fallback"."""

    micro_batches: tuple[tuple[int, ...], ...]
    times_s: tuple[float, ...]  # one stage's time of each micro-batch
    objective_s: float
    lower_bound_s: float
    source: str
    solves: int = 0
    events: tuple[str, ...] = ()

    @property
    def V(self) -> int:
        return len(self.micro_batches)


@dataclasses.dataclass(frozen=True)
class _Data:
    """Step 1. Short documents sorted by work (descending): ``idx [Us]`` into the input, ``w [Us]``
    seconds, ``l [Us]`` tokens; long documents ``long_idx`` with their singleton times ``long_t``."""

    idx: np.ndarray
    w: np.ndarray
    l: np.ndarray
    long_idx: np.ndarray
    long_t: np.ndarray
    cap: int
    c: float
    pp: int
    steady: float
    v_range: tuple[int, int]
    kind: str  # "sum" or "eq1"

    @functools.cached_property
    def first_fit(self) -> np.ndarray:
        """``[Us]`` micro-batch of each short document packed first-fit decreasing (a packing within
        the capacity whose count is in the V range; built only where LPT finds no room)."""
        out = np.empty(self.idx.size, dtype=np.int64)
        for j, members in enumerate(packed_group(self.l.tolist(), self.cap)):
            out[members] = j
        return out

    def objective(self, v, max_load):
        """The pipeline's time with ``v`` packed micro-batches whose slowest load is ``max_load``
        (numpy-broadcasting in both)."""
        v = np.asarray(v, dtype=np.float64)
        top = np.maximum(float(self.long_t.max(initial=0.0)), np.where(v > 0, self.c + max_load, 0.0))
        if self.kind == "eq1":
            return (self.pp - 1 + self.steady * (len(self.long_idx) + v)) * top
        total = float(self.w.sum()) + v * self.c + float(self.long_t.sum())
        return (self.pp - 1) * top + self.steady * total

    def lower_bound(self, v):
        v = np.asarray(v, dtype=np.float64)
        if self.w.size == 0:
            return self.objective(v, 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            least = np.maximum(float(self.w.max()), float(self.w.sum()) / np.maximum(v, 1))
        return self.objective(v, least)


def _data(lengths: Sequence[int], table: SchemeTable, prune: bool, kind: str = "sum") -> _Data:
    l_all = np.asarray(lengths, dtype=np.int64)
    if l_all.size and l_all.max() > table.max_len:
        raise ValueError(f"document of {int(l_all.max())} tokens exceeds MaxLen({table.scheme}) = {table.max_len}")
    long = l_all > table.cap0
    short = np.flatnonzero(~long)
    w = table.work(l_all[short])
    order = np.lexsort((short, -l_all[short], -w))  # by work, then length, then index (deterministic)
    short, w = short[order], w[order]
    long_idx = np.flatnonzero(long)
    long_t = table.doc_time(l_all[long_idx])
    tot = int(l_all[short].sum())
    if short.size == 0:
        v_range = (0, 0)
    else:
        lo = max(1, math.ceil(tot / max(1, table.cap0)))
        hi = int(short.size)
        if prune:
            hi = min(hi, tot // max(1, table.util_len))
        hi = max(lo, hi, int(v_upper(tot, table.cap0, int(short.size))))
        v_range = (lo, hi)
    return _Data(short, w, l_all[short], long_idx, long_t, table.cap0, table.c, table.pp, table.steady, v_range, kind)


def v_upper(tokens, cap, count):
    """The least upper end of the V' range: ``min(⌈2 tokens / cap⌉, count)`` micro-batches, as many as
    first-fit decreasing may need for ``count`` documents of ``tokens`` tokens in bins of ``cap``
    (numpy-broadcasting)."""
    tokens, cap = np.asarray(tokens, dtype=np.float64), np.maximum(np.asarray(cap, dtype=np.float64), 1.0)
    return np.minimum(np.ceil(2.0 * tokens / cap), count).astype(np.int64)[()]


def _lpt(data: _Data, v: int) -> Optional[np.ndarray]:
    """Longest-processing-time first: each document into the least-loaded micro-batch with room
    (a heap of (load, micro-batch); ties to the lower index). Returns ``bin [Us]`` or None when some
    document finds no room."""
    heap = [(0.0, j) for j in range(v)]
    tokens = [0] * v
    out = np.empty(data.idx.size, dtype=np.int64)
    cap = data.cap
    for i, (w, l) in enumerate(zip(data.w.tolist(), data.l.tolist())):
        full = []
        while heap:
            load, j = heapq.heappop(heap)
            if tokens[j] + l <= cap:
                break
            full.append((load, j))
        else:
            return None
        tokens[j] += l
        out[i] = j
        heapq.heappush(heap, (load + w, j))
        for item in full:
            heapq.heappush(heap, item)
    return out


def _heuristic(data: _Data, v: int) -> Optional[np.ndarray]:
    """A packing of ``v`` micro-batches: LPT's, or first-fit decreasing's where LPT finds no room
    and first-fit needs exactly ``v``; None if neither."""
    if v == 0:
        return np.zeros(0, dtype=np.int64)
    bins = _lpt(data, v)
    if bins is None and data.first_fit.size and int(data.first_fit.max()) + 1 == v:
        bins = data.first_fit
    return bins


def _bounds(data: _Data, lo: int, hi: int) -> dict[int, float]:
    """``{V': lower bound}`` over App. C's range, vectorised (the loop visits V' in bound order)."""
    vs = np.arange(lo, hi + 1)
    return dict(zip(vs.tolist(), np.atleast_1d(data.lower_bound(vs)).tolist()))


def _max_load(data: _Data, bins: np.ndarray, v: int) -> float:
    return float(np.bincount(bins, weights=data.w, minlength=v).max()) if v else 0.0


def _feasible(data: _Data, bins: np.ndarray, v: int) -> bool:
    return bool(
        bins.shape == data.idx.shape
        and np.all((bins >= 0) & (bins < v))
        and np.all(np.bincount(bins, weights=data.l, minlength=v) <= data.cap)
    )


def _cp_model(data: _Data, v: int, hint: Optional[np.ndarray]):
    """Step 2 (Eq. 1 for one V): ``o_ij`` booleans (document i only in micro-batch j ≤ i: symmetry
    breaking on the sorted order), one micro-batch each, capacity per micro-batch, ``M ≥ load_j``."""
    unit = max(float(data.w.max()), 1e-30) / 1e6  # work in integer units, ≤ 1e6 per document
    wi = [max(0, int(round(x / unit))) for x in data.w.tolist()]
    model = cp_model.CpModel()
    o = [[model.new_bool_var(f"o{i}_{j}") for j in range(min(v, i + 1))] for i in range(len(wi))]
    floor_units = 0
    if data.long_t.size:  # below the longest singleton every packing is as good
        floor_units = max(0, int(math.floor((float(data.long_t.max()) - data.c) / unit)))
    m = model.new_int_var(max(max(wi), 0), max(sum(wi), floor_units, 1), "M")
    model.add(m >= floor_units)
    for row in o:
        model.add_exactly_one(row)
    for j in range(v):
        members = [(i, row[j]) for i, row in enumerate(o) if j < len(row)]
        if not members:
            continue
        xs = [x for _, x in members]
        model.add(cp_model.LinearExpr.weighted_sum(xs, [int(data.l[i]) for i, _ in members]) <= data.cap)
        model.add(cp_model.LinearExpr.weighted_sum(xs, [wi[i] for i, _ in members]) <= m)
    model.minimize(m)
    if hint is not None:  # a partial hint: the micro-batch of every document
        for i, row in enumerate(o):
            model.add_hint(row[int(hint[i])], 1)
    return model, o


def _canonical(bins: np.ndarray) -> np.ndarray:
    """Relabels micro-batches by first appearance (so that document i sits in a micro-batch ≤ i)."""
    relabel: dict[int, int] = {}
    return np.array([relabel.setdefault(int(b), len(relabel)) for b in bins], dtype=np.int64)


def _solve_v(data: _Data, v: int, hint: Optional[np.ndarray], options: PackOptions):
    """Step 3: CP-SAT for one V. Returns (bins or None, status name, limit hit)."""
    hint = None if hint is None else _canonical(hint)
    model, o = _cp_model(data, v, hint)
    solver = cpsat.solver(options.time_limit_s, options.deterministic_time, 1, options.seed)
    solver.parameters.relative_gap_limit = float(options.gap)
    status = solver.solve(model)
    name = solver.status_name(status)
    limit = status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE)  # (infeasible: no packing of V, proven)
    if limit and solver.wall_time >= 0.95 * options.time_limit_s:
        name += ", wall-clock limit: timing-dependent"
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        bins = np.array([next(j for j, x in enumerate(row) if solver.value(x)) for row in o], dtype=np.int64)
        if _feasible(data, bins, v):
            return bins, name, limit
    return None, name, limit


def _extract(data: _Data, bins: np.ndarray, v: int) -> list[list[int]]:
    """Step 4: micro-batches as input indices (singletons of long documents included)."""
    groups: list[list[int]] = [[] for _ in range(v)]
    for i, b in zip(data.idx.tolist(), bins.tolist()):
        groups[b].append(i)
    return [g for g in groups if g] + [[int(i)] for i in data.long_idx]


def pack(lengths: Sequence[int], table: SchemeTable, options: Optional[PackOptions] = None) -> PackResult:
    """Eq. 1 with V enumerated over App. C's range (branch and bound; see the module docstring)."""
    options = PackOptions() if options is None else options
    if len(lengths) == 0:
        return PackResult((), (), 0.0, 0.0, "trivial")
    data = _data(lengths, table, options.prune, options.objective)
    lo, hi = data.v_range
    slack = 1 + max(options.gap, _REL)
    bounds = _bounds(data, lo, hi)
    best: Optional[tuple[float, int, np.ndarray]] = None
    lpt_obj: dict[int, float] = {}
    lpt_bins: dict[int, np.ndarray] = {}
    for bound, v in sorted((b, v) for v, b in bounds.items()):
        if best is not None and bound * slack >= best[0]:
            break  # the best packing is within the gap of every V left
        bins = _heuristic(data, v)
        if bins is None:
            continue
        obj = float(data.objective(v, _max_load(data, bins, v)))
        lpt_obj[v], lpt_bins[v] = obj, bins
        if best is None or obj < best[0] * (1 - _REL):
            best = (obj, v, bins)
    events: list[str] = []
    source, solves = "lpt", 0
    if options.ilp:
        for bound, v in sorted((b, v) for v, b in bounds.items()):
            if best is not None and bound * slack >= best[0]:
                break  # the best packing is within the gap of every V left
            if v in lpt_obj and lpt_obj[v] <= bound * slack:
                continue  # LPT is within the gap of this V's bound
            if solves >= options.max_solves:
                source = "ilp-limit"
                events.append(f"packing {table.scheme}: stopped after {solves} ILPs")
                break
            n_vars = sum(min(v, i + 1) for i in range(data.idx.size))
            if n_vars > options.max_vars:
                events.append(f"packing {table.scheme} V={v}: ILP of {n_vars} variables skipped (LPT kept)")
                continue
            hint = lpt_bins.get(v)
            bins, status, limit = _solve_v(data, v, hint, options)
            solves += 1
            if limit:
                source = "ilp-limit"
                events.append(f"packing {table.scheme} V={v}: CP-SAT {status} (limit)")
            if bins is None:
                continue
            obj = float(data.objective(v, _max_load(data, bins, v)))
            if best is None or obj < best[0] * (1 - _REL):
                best = (obj, v, bins)
        if source == "lpt" and solves:
            source = "ilp"
    if best is None:
        if data.idx.size:
            # Nothing packs (cannot happen: first-fit's packing is in the range; stay total): singletons.
            v = int(data.idx.size)
            best = (float(data.objective(v, float(data.w.max()))), v, np.arange(v))
            source = "lpt-fallback"
        else:
            best = (float(data.objective(0, 0.0)), 0, np.zeros(0, dtype=np.int64))
    obj, v, bins = best
    groups = _extract(data, bins, v)
    l_all = np.asarray(lengths, dtype=np.float64)
    times = [float(table.micro_batch_time(float((l_all[g] ** 2).sum()), float(l_all[g].sum()))) for g in groups]
    order = sorted(range(len(groups)), key=lambda k: (-times[k], groups[k][0]))
    return PackResult(
        micro_batches=tuple(tuple(groups[k]) for k in order),
        times_s=tuple(times[k] for k in order),
        objective_s=float(obj),
        lower_bound_s=float(min(bounds.values(), default=obj)),
        source=source,
        solves=solves,
        events=tuple(events),
    )


def pipeline_time(
    lengths: Sequence[int], micro_batches: Sequence[Sequence[int]], table: SchemeTable, objective: str = "sum"
) -> float:
    """The packing objective of a given packing (tests and reports): ``"eq1"``, Eq. 1's
    ``(pp - 1 + κ V) ×`` the slowest micro-batch; ``"sum"``, ``(pp - 1) ×`` the slowest ``+ κ ×`` the sum."""
    l = np.asarray(lengths, dtype=np.float64)
    times = [
        float(table.micro_batch_time(float((l[list(g)] ** 2).sum()), float(l[list(g)].sum()))) for g in micro_batches
    ]
    slowest = max(times, default=0.0)
    if objective == "eq1":
        return (table.pp - 1 + table.steady * len(micro_batches)) * slowest
    return (table.pp - 1) * slowest + table.steady * sum(times)


__all__ = ["PackOptions", "PackResult", "pack", "pipeline_time"]
