"""Sequence grouping into 1F1B units by dynamic programming (InfiniPipe §3.3.2, Eq. 12-14).

Families (the chunks of one split document, or one batched chunk) are grouped by
their size (number of chunks, the N_prefill they force, Eq. 7). A unit takes all
families whose size lies in a range (k, i]; ``dp[i] = min_k dp[k] + δ + T_ckpt(P_{k,i})``
(Eq. 14), an empty range costing nothing. δ is the warm-up/cool-down cost of one
extra pipeline and T_ckpt the recomputation cost of the unit's optimal
checkpointing (:mod:`jvarlen.plan.checkpointing`). This costs at most N(N+1)/2
checkpointing solves, N = the largest family size (§3.3.4).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.checkpointing import CkptSolution, MemoryTable, SolverOptions, build_problem, make_solution, solve
from jvarlen.plan.schedule import Schedule
from jvarlen.plan.units import unit_schedule

UnitSolver = Callable[[Sequence[Sequence[int]]], tuple[float, object]]


@dataclasses.dataclass(frozen=True)
class Unit:
    """One 1F1B pipeline: ``families`` in forward order, ``chunk_ids`` (global ids in forward
    order), its schedule over local ids and its checkpointing (``ckpt.table [n, pp]``)."""

    families: tuple[tuple[int, ...], ...]
    chunk_ids: tuple[int, ...]
    schedule: Schedule
    ckpt: CkptSolution


@dataclasses.dataclass(frozen=True)
class Grouping:
    units: tuple[Unit, ...]
    cost_s: float  # dp[N]: Σ (δ + T_ckpt) over units
    solves: int  # checkpointing problems solved
    sources: tuple[str, ...]  # solver source per unit


def order_families(families: Sequence[Sequence[int]], shapes: Sequence[ChunkShape], cost) -> list[tuple[int, ...]]:
    """Forward order inside a unit: larger families first, then slower first chunk; ties by first chunk id."""
    return sorted(
        (tuple(f) for f in families),
        key=lambda f: (-len(f), -sum(cost.bwd_time(shapes[k]) for k in f), f[0]),
    )


def solve_unit(
    families: Sequence[Sequence[int]],
    shapes: Sequence[ChunkShape],
    cost,
    pp: int,
    max_layers: int,
    options: SolverOptions,
    ckpt_mode: str = "milp",
    table: MemoryTable | None = None,
) -> Unit:
    """Builds the unit's op table and chooses its checkpointing.

    ``ckpt_mode``: "milp" (Alg. 2 with greedy fallback), "greedy", "none" (no
    recomputation; infeasible if over budget) or "full" (every layer recomputed).
    """
    fams = order_families(families, shapes, cost)
    ids, schedule = unit_schedule(fams, pp)
    if table is None:
        table = MemoryTable.build(shapes, cost, max_layers)
    problem = build_problem([shapes[k] for k in ids], schedule, cost, max_layers, table, ids)
    if ckpt_mode in ("none", "full"):
        c = np.full(problem.n_vars, 0 if ckpt_mode == "none" else max_layers, dtype=np.int64)
        from jvarlen.plan.checkpointing import _solution  # same extraction path as the solver

        sol = make_solution(problem, c, ckpt_mode if problem.feasible(c) else "infeasible", ckpt_mode)
    else:
        opts = options if ckpt_mode == "milp" else dataclasses.replace(options, time_limit_s=0.0)
        sol = solve(problem, opts)
    return Unit(tuple(fams), tuple(ids), schedule, sol)


def warmup_cost(shapes: Sequence[ChunkShape], cost, pp: int) -> float:
    """δ of Eq. 13/14: (d_p - 1) × mean per-stage forward+backward time of the iteration's chunks."""
    if not shapes:
        return 0.0
    mean = sum(cost.fwd_time(s) + cost.bwd_time(s) for s in shapes) / len(shapes)
    return (pp - 1) * mean


def group(
    families: Sequence[Sequence[int]],
    shapes: Sequence[ChunkShape],
    cost,
    pp: int,
    max_layers: int,
    options: SolverOptions = SolverOptions(),
    ckpt_mode: str = "milp",
    delta: float | None = None,
) -> Grouping:
    """Eq. 14 over family-size levels. Raises ValueError when no grouping fits in memory."""
    delta = warmup_cost(shapes, cost, pp) if delta is None else delta
    table = MemoryTable.build(shapes, cost, max_layers)
    sizes = sorted({len(f) for f in families})
    by_size = {s: [f for f in families if len(f) == s] for s in sizes}
    levels = len(sizes)
    dp = [0.0] + [math.inf] * levels
    back: list[tuple[int, Unit | None]] = [(0, None)] * (levels + 1)
    solves = 0
    for i in range(1, levels + 1):
        for k in range(i):
            if dp[k] == math.inf:
                continue
            fams = [f for s in sizes[k:i] for f in by_size[s]]
            unit = solve_unit(fams, shapes, cost, pp, max_layers, options, ckpt_mode, table)
            solves += 1
            if not unit.ckpt.feasible:
                continue
            value = dp[k] + delta + unit.ckpt.cost_s
            if value < dp[i]:
                dp[i], back[i] = value, (k, unit)
    if dp[levels] == math.inf:
        raise ValueError("no sequence grouping fits the memory budget; use more slices (larger N)")
    units: list[Unit] = []
    i = levels
    while i > 0:
        k, unit = back[i]
        units.append(unit)
        i = k
    units.reverse()
    return Grouping(tuple(units), dp[levels], solves, tuple(u.ckpt.source for u in units))
