"""Stage-aware chunk-level adaptive checkpointing (InfiniPipe §3.3.3, Alg. 2, Eq. 15-20).

For one unit (a 1F1B pipeline of n chunks over d_p stages) choose how many layers
each stage recomputes for each chunk so that every stage's peak memory fits, with
the least recomputation. Eq. 15/16 tie the choice to n + d_p - 1 "diagonal"
integers C[j]: stage p (0-based) gives the chunk with backward rank k
``C[k + d_p - 1 - p]`` layers. Memory is linear in the layer count (Eq. 19):
``M_act(k, l) = I[k] - F[k] * l``; every chunk window W_p(t) gives one linear
constraint (Eq. 20). Beyond the paper, each window is taken where a backward starts and also
holds that backward's transients (``CostModel.backward_memory``): a chunk's backward working
memory grows with its tokens, and without it a plan of long chunks "fits" a budget its steps
exceed. The working memory changes once, when the chunk recomputes any layer; a 0/1
variable per diagonal (``C[j] ≥ 1``) keeps that exact and the model linear.

Solver code in four steps (data → model → solve → extract): :func:`build_problem` (data), :func:`_cp_model`
(model), :func:`solve` (solve with a greedy hint, time limits, status checked,
solution re-verified) and :func:`ckpt_table` (extract); :func:`greedy` is both
the hint and the fallback.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional, Sequence

import numpy as np
from ortools.sat.python import cp_model

from jvarlen.plan import cpsat
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.schedule import Schedule
from jvarlen.plan.units import backward_rank, backward_windows

KIB = 1024
_US = 1e-6


@dataclasses.dataclass(frozen=True)
class SolverOptions:
    """Limits of one checkpointing solve. ``time_limit_s <= 0`` skips the solver (greedy only)."""

    time_limit_s: float = 0.05
    deterministic_time: float = 0.5  # CP-SAT deterministic-time units; keeps results reproducible
    workers: int = 1
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class CkptProblem:
    """Data of Eq. 20 for one unit, integerised conservatively.

    ``var_of [pp, n]`` C index used by (stage, chunk); ``rows [r, n_vars]`` memory
    freed per recomputed layer (KiB, F rounded down) by each variable in window r;
    ``base [r]`` window memory with no recomputation, plus the working memory of the backward
    that starts there (KiB, I and W rounded up); ``remat_rows [r, n_vars]`` what that working
    memory changes by (KiB) when the backward's variable is ≥ 1 (it recomputes);
    ``cap [r]`` budget minus that stage's model states (KiB, rounded down);
    ``weight_us [n_vars]`` cost of one layer on each diagonal (µs, ≥ 1);
    ``max_layers`` = L / d_p.
    """

    var_of: np.ndarray
    rows: np.ndarray
    base: np.ndarray
    cap: np.ndarray
    row_stage: np.ndarray
    weight_us: np.ndarray
    max_layers: int
    remat_rows: Optional[np.ndarray] = None

    @property
    def n_vars(self) -> int:
        return self.weight_us.shape[0]

    def violation(self, c: np.ndarray) -> np.ndarray:
        """``[r]`` KiB by which each window exceeds its budget (≤ 0 when satisfied)."""
        over = self.base - self.rows @ c - self.cap
        if self.remat_rows is not None:
            over = over + self.remat_rows @ (np.asarray(c) > 0).astype(np.int64)
        return over

    def feasible(self, c: np.ndarray) -> bool:
        return bool(np.all(c >= 0) and np.all(c <= self.max_layers) and np.all(self.violation(c) <= 0))

    def objective_us(self, c: np.ndarray) -> int:
        return int(self.weight_us @ c)


@dataclasses.dataclass(frozen=True)
class CkptSolution:
    """``values [n_vars]`` the C of Eq. 15; ``table [n, pp]`` layers per (chunk of the unit, stage).

    ``source``: "cp-sat" (status OPTIMAL/FEASIBLE, verified), "greedy" (fallback or no
    solver time), "trivial" (nothing to recompute) or "infeasible".
    """

    values: np.ndarray
    table: np.ndarray
    cost_s: float
    source: str
    status: str

    @property
    def feasible(self) -> bool:
        return self.source != "infeasible"


@dataclasses.dataclass(frozen=True)
class MemoryTable:
    """Per-chunk inputs of Eq. 19, evaluated once per iteration.

    ``act0 [pp, n]`` bytes with no recomputation, ``act1 [pp, n]`` with one layer
    recomputed (stage p, chunk k), ``rec1 [n]`` seconds to recompute one layer, ``work [2, n]``
    bytes of the chunk's backward transients without and with recomputation, ``bwd [n]`` seconds
    of the chunk's backward on a stage (what orders a unit's families).
    """

    act0: np.ndarray
    act1: np.ndarray
    rec1: np.ndarray
    work: np.ndarray
    bwd: np.ndarray

    @classmethod
    def build(cls, shapes: Sequence[ChunkShape], cost, max_layers: int) -> "MemoryTable":
        pp = cost.layout.pp
        act0 = np.array([[cost.activation_memory(s, 0, p) for s in shapes] for p in range(pp)], dtype=np.float64)
        act1 = np.array([[cost.activation_memory(s, 1, p) for s in shapes] for p in range(pp)], dtype=np.float64)
        if max_layers > 1:  # Eq. 19 is linear in l; check it against the cost model.
            actl = np.array([[cost.activation_memory(s, max_layers, p) for s in shapes] for p in range(pp)])
            if not np.allclose(actl, act0 - (act0 - act1) * max_layers, rtol=1e-6, atol=1024):
                raise ValueError("activation_memory is not linear in ckpt_layers; Eq. 19 does not hold")
        # what the pipeline executor pays for the recomputation (= recompute_time unless fitted)
        rec1 = np.array([cost.executor_recompute_time(s, 1) for s in shapes], dtype=np.float64)
        work = np.array([[cost.backward_memory(s, r) for s in shapes] for r in (0, 1)], dtype=np.float64)
        bwd = np.array([cost.bwd_time(s) for s in shapes], dtype=np.float64)
        return cls(act0.reshape(pp, len(shapes)), act1.reshape(pp, len(shapes)), rec1, work, bwd)


def build_problem(
    shapes: Sequence[ChunkShape],
    schedule: Schedule,
    cost,
    max_layers: int,
    table: MemoryTable | None = None,
    ids: Sequence[int] | None = None,
) -> CkptProblem:
    """Data step of Alg. 2 for one unit: windows W_p(t) at each backward of ``schedule`` (local
    chunk ids ``0..n-1``, ``shapes[k]`` the ChunkShape of chunk k), I[p, k] and F[p, k] (Eq. 19)
    from ``cost.activation_memory`` at 0 and 1 recomputed layers on stage p, the backward's
    transients from ``cost.backward_memory``. A precomputed
    ``table`` over global chunk ids (with ``ids[k]`` = global id of local chunk k) skips
    the cost-model calls.
    """
    pp, n = schedule.pp, len(shapes)
    n_vars = n + pp - 1
    if table is None:
        table, ids = MemoryTable.build(shapes, cost, max_layers), list(range(n))
    sel = np.asarray(ids, dtype=np.int64)
    act0, act1, rec1 = table.act0[:, sel], table.act1[:, sel], table.rec1[sel]
    i_kib = np.ceil(act0 / KIB).astype(np.int64)  # [pp, n]
    f_kib = np.floor((act0 - act1) / KIB).astype(np.int64)  # [pp, n]
    w_kib = np.ceil(table.work[:, sel] / KIB).astype(np.int64)  # [2, n]

    var_of = np.zeros((pp, n), dtype=np.int64)
    weight = np.zeros(n_vars, dtype=np.float64)
    rows, remat, base, cap, row_stage = [], [], [], [], []
    for p in range(pp):
        program = schedule.stages[p]
        for k, r in backward_rank(program).items():
            j = r + pp - 1 - p  # Eq. 16 with p 0-based
            var_of[p, k] = j
            weight[j] = max(weight[j], rec1[k])
        stage_cap = int((cost.memory_budget - cost.model_state_memory(p)) // KIB)
        windows = backward_windows(program)
        if not windows:
            continue
        sizes = [len(w) for w, _ in windows]  # >= 1: a window holds the chunk whose backward it is
        flat = np.fromiter(itertools.chain.from_iterable(w for w, _ in windows), dtype=np.int64, count=sum(sizes))
        row_id = np.repeat(np.arange(len(windows)), sizes)
        stage_rows = np.zeros((len(windows), n_vars), dtype=np.int64)
        # a stage's chunks have distinct variables (Eq. 16), so each (row, variable) is set once
        stage_rows[row_id, var_of[p, flat]] = f_kib[p, flat]
        ends = np.array([b for _, b in windows], dtype=np.int64)  # the backward of each window
        starts = np.concatenate([[0], np.cumsum(sizes[:-1])]).astype(np.int64)
        stage_base = w_kib[0, ends] + np.add.reduceat(i_kib[p, flat], starts)
        stage_remat = np.zeros_like(stage_rows)
        stage_remat[np.arange(len(windows)), var_of[p, ends]] = w_kib[1, ends] - w_kib[0, ends]
        rows.append(stage_rows)  # blocks, concatenated once (not row by row: many windows per unit)
        remat.append(stage_remat)
        base.append(stage_base)
        cap.append(np.full(len(windows), stage_cap, dtype=np.int64))
        row_stage.append(np.full(len(windows), p, dtype=np.int64))

    def stacked(blocks, width=None):
        if blocks:
            return np.concatenate(blocks).astype(np.int64, copy=False)
        return np.zeros((0, width) if width is not None else 0, dtype=np.int64)

    return CkptProblem(
        var_of=var_of,
        rows=stacked(rows, n_vars),
        base=stacked(base),
        cap=stacked(cap),
        row_stage=stacked(row_stage),
        weight_us=np.maximum(1, np.round(weight / _US)).astype(np.int64),
        max_layers=int(max_layers),
        remat_rows=stacked(remat, n_vars),
    )


def greedy(problem: CkptProblem) -> np.ndarray | None:
    """Fallback and hint: raise, for the most violated window, the variable freeing most KiB per µs.

    Returns ``values [n_vars]`` or None when even full recomputation does not fit.
    """
    c = np.zeros(problem.n_vars, dtype=np.int64)
    full = np.zeros(problem.n_vars, dtype=bool)  # variables at max_layers
    excess = problem.violation(c)  # kept up to date below (integers: exact, and O(windows) a step)
    while True:
        r = int(excess.argmax())
        if excess[r] <= 0:
            return c
        ratio = problem.rows[r] / problem.weight_us  # KiB freed per µs (weights ≥ 1)
        ratio[full] = 0.0
        j = int(ratio.argmax())
        if ratio[j] <= 0:
            return None
        # Raise by as many layers as this window needs from j alone (bounded; a first recomputed
        # layer may also change the backward's working memory), then re-check all windows.
        penalty = problem.remat_rows[r, j] if problem.remat_rows is not None and c[j] == 0 else 0
        need = int(math.ceil((excess[r] + max(0, penalty)) / int(problem.rows[r, j])))
        before = c[j]
        c[j] = min(problem.max_layers, c[j] + max(1, need))
        full[j] = c[j] >= problem.max_layers
        excess -= problem.rows[:, j] * (c[j] - before)
        if problem.remat_rows is not None and before == 0:
            excess += problem.remat_rows[:, j]


def _cp_model(problem: CkptProblem, hint: np.ndarray | None) -> tuple[cp_model.CpModel, list]:
    """Model step of Alg. 2 (Eq. 20): integer C[j] in [0, L/d_p], one constraint per window."""
    model = cp_model.CpModel()
    xs = [model.new_int_var(0, problem.max_layers, f"C{j}") for j in range(problem.n_vars)]
    remat = problem.remat_rows if problem.remat_rows is not None else np.zeros_like(problem.rows)
    ys = {}  # y_j = (C_j >= 1), where a window's working memory depends on it
    for j in np.flatnonzero(np.any(remat != 0, axis=0)):
        ys[j] = model.new_bool_var(f"R{j}")
        model.add(xs[j] >= 1).only_enforce_if(ys[j])
        model.add(xs[j] == 0).only_enforce_if(~ys[j])
    for row, extra, b, cap in zip(problem.rows, remat, problem.base, problem.cap):
        nz, nr = np.flatnonzero(row), np.flatnonzero(extra)
        need = int(b - cap)
        if need <= 0 and not np.any(extra[nr] > 0):
            continue  # satisfied by C = 0 already, and recomputing never adds to it
        terms = [xs[j] for j in nz] + [ys[j] for j in nr]
        model.add(
            cp_model.LinearExpr.weighted_sum(terms, [int(row[j]) for j in nz] + [-int(extra[j]) for j in nr]) >= need
        )
    model.minimize(cp_model.LinearExpr.weighted_sum(xs, [int(w) for w in problem.weight_us]))
    if hint is not None:
        for x, v in zip(xs, hint):
            model.add_hint(x, int(v))
    return model, xs


def ckpt_table(problem: CkptProblem, values: np.ndarray) -> np.ndarray:
    """Extract step (Eq. 16): ``[n, pp]`` layers recomputed for the unit's chunk k on stage p
    (the simulator's ``ckpt_layers`` layout)."""
    return values[problem.var_of].T.astype(np.int32)


def solve(problem: CkptProblem, options: SolverOptions = SolverOptions()) -> CkptSolution:
    """Solves Eq. 20 with CP-SAT (greedy hint, limits, status checked); falls back to the greedy solution."""
    zero = np.zeros(problem.n_vars, dtype=np.int64)
    if problem.feasible(zero):
        return make_solution(problem, zero, "trivial", "no window exceeds the budget")
    hint = greedy(problem)
    if options.time_limit_s <= 0:
        if hint is None:
            return make_solution(problem, zero, "infeasible", "greedy found no feasible point; solver skipped")
        return make_solution(problem, hint, "greedy", "solver skipped (no time)")
    model, xs = _cp_model(problem, hint)
    solver = cpsat.solver(options.time_limit_s, options.deterministic_time, options.workers, options.seed)
    status = solver.solve(model)
    name = solver.status_name(status)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        values = np.array([solver.value(x) for x in xs], dtype=np.int64)
        if problem.feasible(values) and (hint is None or problem.objective_us(values) <= problem.objective_us(hint)):
            return make_solution(problem, values, "cp-sat", name)
    if hint is not None:
        return make_solution(problem, hint, "greedy", f"solver status {name}")
    return make_solution(problem, zero, "infeasible", f"solver status {name}")


def make_solution(problem: CkptProblem, values: np.ndarray, source: str, status: str) -> CkptSolution:
    cost_s = math.inf if source == "infeasible" else problem.objective_us(values) * _US
    return CkptSolution(values, ckpt_table(problem, values), cost_s, source, status)
