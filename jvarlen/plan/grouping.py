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
from typing import Sequence

import numpy as np

from jvarlen.plan.checkpointing import (
    KIB,
    CkptSolution,
    MemoryTable,
    SolverOptions,
    build_problem,
    make_solution,
    solve,
)
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.schedule import Schedule
from jvarlen.plan.units import unit_schedule


@dataclasses.dataclass(frozen=True)
class Unit:
    """One pipeline (1F1B; GPipe order after :func:`lockstep_order`): ``families`` in forward
    order, ``chunk_ids`` (global ids in forward order), its schedule over local ids and its
    checkpointing (``ckpt.table [n, pp]``)."""

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


def order_families(
    families: Sequence[Sequence[int]], shapes: Sequence[ChunkShape], cost, bwd_s: Sequence[float] | None = None
) -> list[tuple[int, ...]]:
    """Forward order inside a unit: larger families first, then the slower backward; ties by first
    chunk id. ``bwd_s[k]``: chunk k's ``cost.bwd_time``, where already computed."""
    bwd = (lambda k: bwd_s[k]) if bwd_s is not None else (lambda k: cost.bwd_time(shapes[k]))
    return sorted((tuple(f) for f in families), key=lambda f: (-len(f), -sum(bwd(k) for k in f), f[0]))


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
    if table is None:
        table = MemoryTable.build(shapes, cost, max_layers)
    fams = order_families(families, shapes, cost, table.bwd)
    ids, schedule = unit_schedule(fams, pp)
    problem = build_problem([shapes[k] for k in ids], schedule, cost, max_layers, table, ids)
    if ckpt_mode in ("none", "full"):
        c = np.full(problem.n_vars, 0 if ckpt_mode == "none" else max_layers, dtype=np.int64)

        sol = make_solution(problem, c, ckpt_mode if problem.feasible(c) else "infeasible", ckpt_mode)
    else:
        opts = options if ckpt_mode == "milp" else dataclasses.replace(options, time_limit_s=0.0)
        sol = solve(problem, opts)
    return Unit(tuple(fams), tuple(ids), schedule, sol)


def solve_range(
    families: Sequence[Sequence[int]],
    shapes: Sequence[ChunkShape],
    cost,
    pp: int,
    max_layers: int,
    options: SolverOptions,
    ckpt_mode: str = "milp",
    table: MemoryTable | None = None,
    memo: dict | None = None,
) -> list[Unit] | None:
    """Units for one DP range: a single unit if it fits, else the families (in unit order)
    halved recursively until every part fits — several long documents of the same size
    then need not share a pipeline. None when a single family does not fit.

    ``memo``: results by (set of families, mode) over one grouping's calls, whose ranges and halves
    share families (about 40 % of the solves on GPT-30B at 192K); a unit depends on the set only,
    as :func:`order_families` orders it totally."""
    key = (frozenset(tuple(f) for f in families), ckpt_mode)
    if memo is not None and key in memo:
        return memo[key]
    unit = solve_unit(families, shapes, cost, pp, max_layers, options, ckpt_mode, table)
    if unit.ckpt.feasible:
        units = [unit]
    elif len(families) == 1:
        units = None
    else:
        fams, half = list(unit.families), len(families) // 2
        left = solve_range(fams[:half], shapes, cost, pp, max_layers, options, ckpt_mode, table, memo)
        right = (
            solve_range(fams[half:], shapes, cost, pp, max_layers, options, ckpt_mode, table, memo) if left else None
        )
        units = None if right is None else left + right
    if memo is not None:
        memo[key] = units
    return units


def resolve_unit(unit: Unit, shapes: Sequence[ChunkShape], cost, max_layers: int, options: SolverOptions) -> Unit:
    """Re-solves a unit's checkpointing with the MILP (Alg. 2), keeping its order and schedule."""
    ids = list(unit.chunk_ids)
    problem = build_problem([shapes[k] for k in ids], unit.schedule, cost, max_layers)
    sol = solve(problem, options)
    if not sol.feasible or sol.cost_s > unit.ckpt.cost_s:
        return unit
    return dataclasses.replace(unit, ckpt=sol)


def least_peak_memory(family: Sequence[int], shapes: Sequence[ChunkShape], cost, pp: int, max_layers: int, table=None):
    """Peak bytes per device of ``family`` as a unit of its own with every layer recomputed: the
    least any checkpointing of it keeps (the worst window of Eq. 20, model states included)."""
    ids, schedule = unit_schedule([tuple(family)], pp)
    problem = build_problem([shapes[k] for k in ids], schedule, cost, max_layers, table, ids if table else None)
    over = problem.violation(np.full(problem.n_vars, max_layers, dtype=np.int64))
    states = np.array([cost.model_state_memory(p) for p in range(pp)])
    return float(np.max((over + problem.cap) * KIB + states[problem.row_stage]))


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
    max_levels: int = 8,
) -> Grouping:
    """Eq. 14 over family-size levels. Raises ValueError when no grouping fits in memory.

    With more than ``max_levels`` distinct sizes, neighbouring sizes are merged into
    ``max_levels`` levels (equal numbers of distinct sizes each), bounding the DP at
    max_levels·(max_levels+1)/2 range solves.
    """
    delta = warmup_cost(shapes, cost, pp) if delta is None else delta
    table = MemoryTable.build(shapes, cost, max_layers)
    distinct = sorted({len(f) for f in families})
    bins = np.array_split(np.array(distinct), min(len(distinct), max_levels))
    level_of = {int(x): i for i, b in enumerate(bins) for x in b}
    sizes = list(range(len(bins)))
    by_size = {lv: [f for f in families if level_of[len(f)] == lv] for lv in sizes}
    levels = len(sizes)
    memo: dict = {}
    # Quick infeasibility check: the largest families (the longest documents) must each fit alone.
    check = "greedy" if ckpt_mode == "milp" else ckpt_mode
    for fam in by_size[sizes[-1]]:
        if solve_range([fam], shapes, cost, pp, max_layers, options, check, table, memo) is None:
            need = least_peak_memory(fam, shapes, cost, pp, max_layers, table)
            raise ValueError(
                f"a document split into {len(fam)} chunks does not fit the memory budget on its own: it needs "
                f"{need / 2**30:.4g} GiB per device recomputing every layer, over the budget "
                f"({cost.memory_budget / 2**30:.4g} GiB)"
            )
    dp = [0.0] + [math.inf] * levels
    back: list[tuple[int, list[Unit]]] = [(0, [])] * (levels + 1)
    solves = 0
    for i in range(1, levels + 1):
        for k in range(i):
            if dp[k] == math.inf:
                continue
            fams = [f for s in sizes[k:i] for f in by_size[s]]
            units = solve_range(fams, shapes, cost, pp, max_layers, options, ckpt_mode, table, memo)
            solves += 1
            if units is None:
                continue
            value = dp[k] + sum(delta + u.ckpt.cost_s for u in units)
            if value < dp[i]:
                dp[i], back[i] = value, (k, units)
    if dp[levels] == math.inf:
        raise ValueError("no sequence grouping fits the memory budget; use more slices (larger N)")
    chosen: list[list[Unit]] = []
    i = levels
    while i > 0:
        k, part = back[i]
        chosen.append(part)
        i = k
    units = [u for part in reversed(chosen) for u in part]
    return Grouping(tuple(units), dp[levels], solves, tuple(u.ckpt.source for u in units))


def lockstep_order(unit: Unit, shapes: Sequence[ChunkShape], cost, mode: str = "ticks") -> Unit:
    """The unit in GPipe order (every stage runs all its forwards, then all its backwards, later
    slices first) when that runs faster in the lock-step executor and still fits memory with the
    unit's checkpointing; else the unit unchanged.

    In lock-step every tick lasts as long as its slowest op, so 1F1B's steady state, where one
    stage's forward shares a tick with its neighbour's backward, runs every tick at backward
    speed; GPipe order pairs forwards with forwards and backwards with backwards. It keeps every
    chunk of the unit in flight, which only fits when memory is not binding (Eq. 10 per chunk,
    replayed in schedule order by the simulator). ``mode``: the lock-step model, ``"ticks"`` (one op
    per stage and tick) or ``"paired"`` (the executor's: a backward and a forward per tick, where
    1F1B's steady state wastes nothing; GPipe order still wins where a unit's chunks are few and
    uneven: 8 of 66 EPP units on 8 strategies-benchmark settings × 2 batches, and the pipeline
    groups of whole documents, ``assemble(..., gpipe_order=True)``, more often)."""
    from jvarlen.plan.schedule import gpipe
    from jvarlen.plan.simulator import simulate

    local = [shapes[k] for k in unit.chunk_ids]
    sched = unit.schedule
    alt = gpipe(sched.n_chunks, sched.pp, sched.chunk_prev, sched.chunk_docs)
    if alt.stages == sched.stages:  # e.g. the slices of one document: 1F1B's window is all of them
        return unit
    now = simulate(sched, local, unit.ckpt.table, cost, mode, validate=False, timeline=False, memory=False)
    new = simulate(alt, local, unit.ckpt.table, cost, mode, validate=False, timeline=False)
    if new.fits and new.iteration_time < now.iteration_time:
        return dataclasses.replace(unit, schedule=alt)
    return unit
