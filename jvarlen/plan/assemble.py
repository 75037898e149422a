"""Turning chunks + units into a validated-shape :class:`Plan`, and simulating a plan.

Shared by every policy (EPP, its ablations, the baselines), so that they differ only
in how they chunk and how they choose recomputation.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from jvarlen.plan.checkpointing import SolverOptions, build_problem
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.executor_memory import executor_memory, fit_executor
from jvarlen.plan.grouping import Unit, lockstep_order
from jvarlen.plan.options import LOCKSTEP
from jvarlen.plan.plan import Plan, stage_peak_memory
from jvarlen.plan.schedule import Op, Schedule
from jvarlen.plan.simulator import SimResult, simulate_in_parts
from jvarlen.plan.simulator import simulate as simulate_schedule
from jvarlen.plan.units import PlannedChunk, unit_schedule


def simulate(plan: Plan, cost, mode: str = "async", timeline: bool = True) -> SimResult:
    """Iteration time, bubble ratio and per-stage peak memory of ``plan`` under ``cost``; ``mode``:
    the simulator's execution model (``"async"``: InfiniPipe's; ``"ticks"``: lock-step, one op per tick; ``"paired"``: jvarlen's executor).
    ``timeline=False``: no events (:func:`jvarlen.plan.simulator.simulate`). A plan in parts:
    each part its own step (padded to its own bucket), one after the other."""
    if plan.parts:
        return simulate_in_parts(
            plan.schedule, plan.chunk_shapes(), np.asarray(plan.ckpt_layers), cost, plan.parts, mode, timeline=timeline
        )
    return simulate_schedule(
        plan.schedule, plan.chunk_shapes(), np.asarray(plan.ckpt_layers), cost, mode, timeline=timeline
    )


def assemble(
    policy: str,
    lengths: Sequence[int],
    chunks: Sequence[PlannedChunk],
    units: Sequence[Unit],
    cost,
    stats: dict | None = None,
    events: list | None = None,
    run_simulation: bool = True,
    simulation: str = "async",
    parts: tuple[int, ...] = (),
    gpipe_order: bool = False,
) -> Plan:
    """Orders chunks unit by unit (forward order), concatenates the unit schedules
    (:func:`jvarlen.plan.schedule.sequential`) and checkpointing tables, and fills
    ``stats`` with the iteration time, bubble ratio and peak memory simulated in ``simulation``
    mode (see :func:`simulate`). ``parts``: :attr:`Plan.parts`.

    ``gpipe_order`` (a pipeline, ``pp > 1``, in a lock-step ``simulation``): where units run faster
    in GPipe order (:func:`jvarlen.plan.grouping.lockstep_order`, which keeps every chunk of a unit
    in flight where memory allows), the plan in that order instead where it fits after the
    executor's buffers are fitted and simulates faster (or the plan as given does not fit). EPP's
    candidates and pipeline groups choose their order here.
    ``stats["gpipe_units"]``: the units reordered (0 for the plan as given)."""
    if gpipe_order:
        plan = assemble(policy, lengths, chunks, units, cost, stats, events, run_simulation, simulation, parts)
        plan.stats["gpipe_units"] = 0
        if not run_simulation or cost.layout.pp == 1 or simulation not in LOCKSTEP:
            return plan
        shapes = [c.shape(lengths) for c in chunks]
        ordered = [lockstep_order(u, shapes, cost, simulation) for u in units]
        reordered = sum(a is not b for a, b in zip(ordered, units))
        if reordered:
            alt = assemble(policy, lengths, chunks, ordered, cost, stats, events, run_simulation, simulation, parts)
            faster = alt.stats["iteration_time_s"] < plan.stats["iteration_time_s"]
            if alt.stats["fits_memory"] and (faster or not plan.stats["fits_memory"]):
                alt.stats["gpipe_units"] = reordered
                return alt
        return plan
    order = [k for u in units for k in u.chunk_ids]
    if sorted(order) != list(range(len(chunks))):
        raise ValueError("units must cover every chunk exactly once")
    schedule = concatenate([u.schedule for u in units])
    ckpt = np.concatenate([u.ckpt.table for u in units], axis=0).astype(np.int32)
    plan = Plan(
        policy=policy,
        layout=cost.layout,
        num_layers=cost.model.num_layers,
        lengths=tuple(int(x) for x in lengths),
        chunks=tuple(chunks[k].pieces for k in order),
        unit_sizes=tuple(len(u.chunk_ids) for u in units),
        schedule=schedule,
        ckpt_layers=ckpt,
        memory_budget_bytes=float(cost.memory_budget),
        stats=dict(stats or {}),
        events=list(events or []),
        parts=tuple(parts),
    )
    plan.stats.update(
        tokens_in=plan.tokens_in,
        tokens_planned=plan.tokens_planned,
        n_chunks=plan.n_chunks,
        n_units=len(units),
        ckpt_sources=[u.ckpt.source for u in units],
    )
    for i, u in enumerate(units):
        if u.ckpt.source == "greedy":
            plan.events.append(f"unit {i}: greedy checkpointing ({u.ckpt.status})")
    if run_simulation and simulation in ("ticks", "paired"):  # both run on the paired executor
        plan = fit_executor_memory(plan, cost, simulation)
    if run_simulation:
        record_simulation(plan, cost, simulation)
    return plan


def fit_executor_memory(plan: Plan, cost, simulation: str = "paired") -> Plan:
    """``plan`` with the recomputation under which the pipeline executor's account of it (its
    static buffers and largest op, :func:`jvarlen.plan.executor_memory.executor_memory`) fits the
    budget, raised where the simulator's time line fits but the executor's buffers do not; the
    account goes into ``stats`` (``executor_memory_bytes``, per term ``executor_memory``), and a
    plan that does not fit even when everything is recomputed keeps its table."""
    ckpt, least, changed = fit_executor(plan, cost, mode=simulation)
    account = least
    if changed and least.total <= cost.memory_budget:
        added = int((ckpt - np.asarray(plan.ckpt_layers)).sum())
        plan = dataclasses.replace(plan, ckpt_layers=ckpt)
        plan.events.append(
            f"executor memory: {len(changed)} (chunk, stage) pairs recompute {added} more layers so that "
            f"the executor's buffers fit the budget: {least.describe()}"
        )
    elif changed:
        account = executor_memory(plan, cost)  # the plan keeps its own table
    if least.total > cost.memory_budget:
        plan.events.append(
            f"executor memory: {least.describe()} does not fit the budget even recomputing all it can "
            f"({cost.memory_budget / 1e6:,.1f} MB)"
        )
        plan.stats["executor_memory_least_bytes"] = least.total
    plan.stats.update(executor_memory_bytes=account.total, executor_memory=account.terms)
    return plan


def concatenate(schedules: Sequence[Schedule]) -> Schedule:
    """Units back to back on the same stages, chunk ids offset (what
    :func:`jvarlen.plan.schedule.sequential` builds, without re-validating each time:
    unit schedules are valid by construction and :meth:`Plan.validate` checks the result)."""
    if len(schedules) == 1:
        return schedules[0]
    pp = schedules[0].pp
    stages: list[list[Op]] = [[] for _ in range(pp)]
    prev: list[int] = []
    offset = 0
    for u in schedules:
        for p in range(pp):
            stages[p].extend(Op(op.kind, op.chunk + offset) for op in u.stages[p])
        prev.extend(j + offset if j >= 0 else -1 for j in u.chunk_prev)
        offset += u.n_chunks
    return Schedule(tuple(map(tuple, stages)), tuple(prev))


def record_simulation(plan: Plan, cost, mode: str = "async") -> SimResult:
    t0 = time.perf_counter()
    sim = simulate(plan, cost, mode, timeline=False)
    plan.stats.update(
        simulation=mode,
        iteration_time_s=float(sim.iteration_time),
        makespan_s=float(sim.makespan),
        bubble_ratio=float(sim.bubble_ratio),
        peak_memory_bytes=[float(x) for x in sim.peak_memory],
        memory_budget_bytes=float(sim.memory_budget),
        fits_memory=bool(sim.fits) and plan.stats.get("executor_memory_bytes", 0.0) <= sim.memory_budget,
        recompute_s=[float(x) for x in sim.stage_recompute],
        stage_busy_s=[float(x) for x in sim.stage_busy],
        simulate_seconds=time.perf_counter() - t0,
    )
    return sim


def uniform_unit(
    families: Sequence[Sequence[int]],
    shapes: Sequence[ChunkShape],
    cost,
    layers: int | None = None,
) -> tuple[Unit, bool]:
    """One token-level 1F1B unit with the same recomputation for every chunk and stage
    (Seq1F1B/DAPPLE practice). ``layers=None``: the least uniform count that fits every
    window. Returns (unit, fits); when nothing fits, full recomputation and ``fits=False``."""
    from jvarlen.plan.checkpointing import make_solution

    pp = cost.layout.pp
    lps = cost.layers_per_stage
    ids, schedule = unit_schedule(families, pp)
    problem = build_problem([shapes[k] for k in ids], schedule, cost, lps)
    candidates = range(lps + 1) if layers is None else [layers]
    for l in candidates:
        c = np.full(problem.n_vars, l, dtype=np.int64)
        if problem.feasible(c):
            return Unit(
                tuple(tuple(f) for f in families), tuple(ids), schedule, make_solution(problem, c, "uniform", f"l={l}")
            ), True
    c = np.full(problem.n_vars, lps if layers is None else layers, dtype=np.int64)
    return Unit(
        tuple(tuple(f) for f in families), tuple(ids), schedule, make_solution(problem, c, "uniform", "oom")
    ), False


__all__ = ["assemble", "simulate", "record_simulation", "uniform_unit", "SolverOptions", "stage_peak_memory"]
