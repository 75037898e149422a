"""Replicated or sharded stage weights for a strategy policy's groups (``parallel.stage_weights=auto``).

A group's step holds its layers replicated on every device of the group or sharded over them
(ZeRO-3 within the group). Sharding leaves every group more memory for activations and lets a
one-stage group hold a model whose replicated states exceed the budget (13B on A800s: 115 GB per
device replicated, 33 GB sharded over 8). It costs time: every op gathers each layer and a backward
reduce-scatters each layer's gradient, a layer ahead of (and behind) the compute that hides them,
and the cost model charges what a layer's compute does not hide
(:meth:`~jvarlen.plan.cost.CostModel.weight_comm_times`): short micro-batches on wide groups wait.
The run (``jvarlen.runtime.strategies.groups.choose_stage_weights``) and ``python -m jvarlen.plan``
choose once with :func:`choose` (``auto``), or every iteration with :func:`plan_each`
(``per_iteration``): a batch whose longest document needs the room that sharding leaves runs
sharded, the others replicated (docs/design/heterogeneous.md, "Stage weights chosen per run").
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

from jvarlen.plan import cpsat
from jvarlen.plan.options import PlanningError

CHOICES = ("replicated", "sharded")  # ties keep the first, which gathers nothing


def choose(policy: str, samples: Sequence[Sequence[int]], variant: Callable) -> tuple[str, str]:
    """(choice, a line saying why): ``policy`` plans every batch of ``samples`` under each of
    :data:`CHOICES`, ``variant(choice) -> (SchemeCosts, options)``; the choice that plans more
    of them wins, then the shorter mean predicted iteration. Planned in CP-SAT's reproducible mode:
    every process of a run, and its resumption, must choose alike."""
    from jvarlen.plan.strategy import plan_strategy

    planned = {}  # choice -> predicted iteration seconds of the batches it plans
    for choice in CHOICES:
        costs, options = variant(choice)
        planned[choice] = []
        for lengths in samples:
            try:
                plan = cpsat.call_reproducibly(plan_strategy, policy, list(lengths), costs, options)
            except PlanningError:
                continue
            planned[choice].append(plan.stats["iteration_time_s"])

    def rank(choice):  # more batches planned, then faster; the sort is stable
        times = planned[choice]
        return -len(times), statistics.fmean(times) if times else math.inf

    def outcome(choice):
        times = planned[choice]
        if not times:
            return "no plan"
        return f"{statistics.fmean(times):.4g} s" + (f" on {len(times)} of them" if len(times) < len(samples) else "")

    chosen, other = sorted(CHOICES, key=rank)
    if not planned[chosen]:
        return CHOICES[0], f"{CHOICES[0]}; neither plans any of {len(samples)} sample batches"
    why = f"{chosen} (mean predicted iteration over {len(samples)} sample batches {outcome(chosen)}; "
    return chosen, why + f"{other}: {outcome(other)})"


def _bounded(policy: str, options, ceiling):
    """``options`` of ``policy`` with ``ceiling`` as its own (a policy whose options take one: ``auto``,
    ``hydraulis``, ``epp-pipelines``), else as given."""
    from jvarlen.plan.auto import with_ceiling
    from jvarlen.plan.strategy import strategy_policies

    return with_ceiling(strategy_policies()[policy][1], options, ceiling)


def plan_each(policy: str, lengths: Sequence[int], variants: Mapping[str, tuple[Any, Any]]):
    """One iteration planned under each of :data:`CHOICES` (``variants[choice] -> (SchemeCosts,
    options)``): the plan that fits memory by the planner's account, then the faster (a tie keeps
    replicated), its ``stage_weights`` the choice, ``stats["stage_weights_estimates"]`` each
    choice's predicted iteration (or why it could not plan) and ``stats["solve_seconds"]`` both
    solves. The second is planned with the first's time as a ceiling where the policy takes one
    (``hydraulis``, ``epp-pipelines``, and ``auto`` for those two: they search only for a faster
    plan; ``not_faster_than_s`` otherwise): the same choice as planning both in full. Raises
    :class:`PlanningError` naming both reasons when neither plans."""
    from jvarlen.plan.options import SlowerThanCeiling
    from jvarlen.plan.sp_assemble import fits_memory
    from jvarlen.plan.strategy import plan_strategy

    start, best, estimates = time.perf_counter(), None, {}
    for choice in CHOICES:
        costs, options = variants[choice]
        ceiling = None if best is None or best[0][0] else best[0][1]  # a plan that does not fit bounds nothing
        try:
            plan = plan_strategy(policy, list(lengths), costs, _bounded(policy, options, ceiling))
        except SlowerThanCeiling:
            estimates[choice] = {"not_faster_than_s": ceiling}
            continue
        except PlanningError as error:
            estimates[choice] = {"error": str(error)[:300]}
            continue
        estimates[choice] = {
            "iteration_time_s": float(plan.stats["iteration_time_s"]),
            "fits_memory": fits_memory(plan),
        }
        rank = (not fits_memory(plan), float(plan.stats["iteration_time_s"]))
        if best is None or rank < best[0]:
            best = (rank, plan)
    if best is None:
        reasons = "; ".join(f"{c}: {e['error']}" for c, e in estimates.items())
        raise PlanningError(f"{policy} plans this batch with neither stage weights: {reasons}")
    plan = best[1]
    plan.stats["stage_weights_estimates"] = estimates
    plan.stats["solve_seconds"] = time.perf_counter() - start
    return plan


__all__ = ["CHOICES", "choose", "plan_each"]
