"""Replicated or sharded stage weights for a strategy policy's groups (``parallel.stage_weights=auto``).

A group's step holds its layers replicated on every device of the group or sharded over them
(ZeRO-3 within the group). Sharding leaves every group more memory for activations and lets a
one-stage group hold a model whose replicated states exceed the budget (13B on A800s: 115 GB per
device replicated, 33 GB sharded over 8). It costs time: every op gathers each layer and a backward
reduce-scatters each layer's gradient, a layer ahead of (and behind) the compute that hides them,
and the cost model charges what a layer's compute does not hide
(:meth:`~jvarlen.plan.cost.CostModel.weight_comm_times`): short micro-batches on wide groups wait.
The run (``jvarlen.runtime.strategies.groups.choose_stage_weights``) and ``python -m jvarlen.plan``
choose with :func:`choose`.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Sequence

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


__all__ = ["CHOICES", "choose"]
