"""SP groups of one iteration (:mod:`jvarlen.plan.sp_groups`) as a
:class:`~jvarlen.plan.strategy.StrategyPlan`: devices by :func:`~jvarlen.plan.strategy.place_groups`,
one executor plan per group by :func:`~jvarlen.plan.strategy.build_group_plan`, and, where a
policy has several candidates, the one whose plans simulate fastest.

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from jvarlen.plan.sp_groups import GroupChoice, GroupCosts
from jvarlen.plan.strategy import (
    GroupPlan,
    Scheme,
    StrategyPlan,
    build_group_plan,
    place_groups,
    predicted_time,
)


def describe_schemes(schemes: Sequence[Scheme]) -> str:
    """``"1×(pp=1, sp=32) + 4×(pp=1, sp=8)"`` for a list of schemes (StrategyPlan.describe's format)."""
    counts: dict[Scheme, int] = {}
    for s in schemes:
        counts[s] = counts.get(s, 0) + 1
    return " + ".join(f"{d}×{s}" for s, d in sorted(counts.items(), key=lambda kv: (-kv[0].num_devices, kv[0])))


def candidate_record(lengths: Sequence[int], gc: GroupCosts, choices: Sequence[GroupChoice], **extra) -> dict:
    return {
        "strategy": describe_schemes([c.scheme for c in choices]),
        "iteration_time_s": gc.strategy_time(lengths, choices),
        **extra,
    }


def assemble_strategy(
    policy: str,
    lengths: Sequence[int],
    gc: GroupCosts,
    choices: Sequence[GroupChoice],
    simulation: str,
    t0: float,
    stats: Optional[dict] = None,
    events: Optional[list] = None,
) -> StrategyPlan:
    """The :class:`StrategyPlan` of ``choices``: groups ordered largest first (ties by first
    document), devices by :func:`place_groups`, one executor plan per group. ``stats`` gets
    ``iteration_time_s`` (the slowest group's), ``solve_seconds`` (since ``t0``, without
    building the executor plans), ``policy``, ``strategy`` and ``idle_devices``."""
    lengths = [int(x) for x in lengths]
    choices = sorted(choices, key=lambda c: (-c.scheme.num_devices, min(c.documents)))
    solve_seconds = time.perf_counter() - t0
    devices = place_groups([c.scheme for c in choices], gc.num_devices)
    groups = []
    for c, devs in zip(choices, devices):
        local = [lengths[d] for d in c.documents]
        plan = build_group_plan(
            policy,
            c.scheme,
            local,
            [list(mb) for mb in c.micro_batches],
            gc.costs,
            ckpt=list(c.ckpt),
            simulation=simulation,
            parts=c.parts,
        )
        groups.append(GroupPlan(c.scheme, devs, c.documents, plan))
    out = StrategyPlan(policy, gc.num_devices, tuple(lengths), tuple(groups), events=list(events or []))
    idle = gc.num_devices - sum(c.scheme.num_devices for c in choices)
    out.stats.update(stats or {})
    out.stats.update(
        policy=policy,
        strategy=out.describe(),
        iteration_time_s=predicted_time(groups, gc.costs),
        group_times_s=[g.predicted_time_s for g in groups],
        micro_batches=[len(c.micro_batches) for c in choices],
        idle_devices=idle,
        solve_seconds=solve_seconds,
    )
    for g in groups:
        out.events.extend(e for e in g.plan.events if "does not fit" in e or "out of memory" in e)
    return out


def fits_memory(plan: StrategyPlan) -> bool:
    """Every group's plan fits its budget (the simulated time line and the executor's account)."""
    return all(g.plan.stats.get("fits_memory", True) for g in plan.groups)


def fastest_fitting(plans: Sequence[StrategyPlan], policy: str) -> int:
    """The index of the fastest plan that fits memory, else of the fastest (ties: the first); a plan
    kept although it does not fit gets an event saying so."""
    best = min(range(len(plans)), key=lambda i: (not fits_memory(plans[i]), plans[i].stats["iteration_time_s"], i))
    if not fits_memory(plans[best]):
        plans[best].events.append(
            f"{policy}: none of {len(plans)} candidate(s) fits memory by the planner's account; kept the fastest"
        )
    return best


def assemble_fastest(
    policy: str,
    lengths: Sequence[int],
    gc: GroupCosts,
    candidates: Sequence[tuple[Sequence[GroupChoice], dict]],
    simulation: str,
    t0: float,
    stats: Optional[dict] = None,
    events: Optional[list] = None,
) -> tuple[int, StrategyPlan]:
    """The candidates' :class:`StrategyPlan` (:func:`assemble_strategy`), the fastest simulated one
    that fits memory kept (:func:`fastest_fitting`; ties: the first). In the ``"paired"`` simulation the padded group model that ranks them
    is each ``pp = 1`` group's simulated time (``GroupCosts.group_time``); in the others it leaves
    out the executor's padding and the recomputation its memory fit adds, so candidates a few per
    cent apart by it may swap once simulated. Each candidate's record (its ``candidate_record``)
    gets ``simulated_s``.
    -> (index of the kept candidate, its plan); ``solve_seconds`` counts until the first
    assembly."""
    if not candidates:
        raise ValueError("assemble_fastest needs at least one candidate")
    solve_seconds = time.perf_counter() - t0
    plans: list[StrategyPlan] = []
    for i, (choices, _) in enumerate(candidates):
        same = next((j for j in range(i) if candidates[j][0] == choices), None)  # (the MILP may return the hint)
        plans.append(
            plans[same]
            if same is not None
            else assemble_strategy(policy, lengths, gc, choices, simulation, t0, stats, events)
        )
    for (_, record), plan in zip(candidates, plans):
        record["simulated_s"] = plan.stats["iteration_time_s"]
    best = fastest_fitting(plans, policy)
    plans[best].stats["solve_seconds"] = solve_seconds
    return best, plans[best]


__all__ = [
    "assemble_fastest",
    "assemble_strategy",
    "candidate_record",
    "describe_schemes",
    "fastest_fitting",
    "fits_memory",
]
