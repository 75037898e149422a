"""Two strategy policies that sit on top of the others.

* ``epp-pipelines``: InfiniPipe's elastic pipelines as a strategy, ``d`` identical pipelines of a
  scheme ``P = (pp, sp)`` with ``pp ≥ 2``: the documents are dispatched longest first to the least
  loaded pipeline (load: ``T(l, P)``, Hydraulis App. B.2), and each pipeline's documents are planned
  by EPP (:func:`jvarlen.plan.api.plan_iteration`: chunks that split long documents, units,
  recomputation MILP). Without a fixed scheme the fastest ``P`` is kept.
* ``auto``: plans the iteration with every policy of ``AutoOptions.policies`` (the best homogeneous
  layout, EPP pipelines, Hydraulis, FlexSP, DCP), estimates each with the cost model (their
  ``iteration_time_s``, simulated in the executor's lock-step model) and returns the fastest, with
  every estimate in ``stats["auto_estimates"]`` and the winner in ``stats["policy_chosen"]``. A
  policy that cannot plan the batch (no layout fits, say) is skipped and its reason recorded.

Pure Python: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import numpy as np

from jvarlen.plan.api import PlannerOptions, PlanningError, plan_iteration
from jvarlen.plan.checkpointing import SolverOptions
from jvarlen.plan.strategy import (
    GroupPlan,
    Scheme,
    SchemeCosts,
    StrategyPlan,
    enumerate_schemes,
    place_groups,
    plan_strategy,
    predicted_time,
    register_policy,
)

AUTO_POLICIES = ("homogeneous", "epp-pipelines", "hydraulis", "flexsp", "dcp")


@dataclasses.dataclass(frozen=True)
class EPPPipelinesOptions:
    """``scheme``: the pipelines' scheme (None: the ``pp ≥ 2`` schemes of the device count, the
    fastest kept). ``screen``: without a scheme, only the ``screen`` schemes whose longest-first
    dispatch has the smallest largest pipeline load ``Σ T(l, P)`` are planned by EPP (an EPP plan
    per pipeline and scheme is what costs time: all 12 schemes of 64 devices took 24 s of CPU per
    iteration; 0 plans every scheme). A scheme that cannot plan the batch (its model states do
    not fit, a pipeline's plan does not) does not count: the next one in the ranking is planned.
    ``planner``: EPP's options (the executor's model, ``"paired"``: EPP then cuts bucket-sized
    slices, which the executor pads least)."""

    scheme: Optional[Scheme] = None
    max_pp: int = 8
    max_sp: int = 8
    screen: int = 2
    planner: PlannerOptions = PlannerOptions(
        min_slice_tokens=512,
        n_candidates=2,
        simulation="paired",
        solver=SolverOptions(time_limit_s=5.0, deterministic_time=0.2),
    )


def dispatch_longest_first(
    lengths: Sequence[int], costs: SchemeCosts, scheme: Scheme, pipelines: int
) -> list[list[int]]:
    """Documents to ``pipelines`` identical pipelines: longest first, each to the least loaded by
    ``T(l, P)`` (LPT). Returns each pipeline's document indices (ascending)."""
    load = np.zeros(pipelines)
    out: list[list[int]] = [[] for _ in range(pipelines)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = int(np.argmin(load))
        out[j].append(i)
        load[j] += costs.T(int(lengths[i]), scheme)
    return [sorted(docs) for docs in out]


def _epp_groups(lengths, costs: SchemeCosts, scheme: Scheme, options: EPPPipelinesOptions) -> list[GroupPlan]:
    d = costs.num_devices // scheme.num_devices
    docs = [g for g in dispatch_longest_first(lengths, costs, scheme, d) if g]
    devices = place_groups([scheme] * len(docs), costs.num_devices)
    groups = []
    for ids, devs in zip(docs, devices):
        plan = plan_iteration([lengths[i] for i in ids], cost=costs.cost(scheme), policy="epp", options=options.planner)
        groups.append(GroupPlan(scheme, devs, tuple(ids), plan))
    return groups


@register_policy("epp-pipelines", EPPPipelinesOptions)
def plan_epp_pipelines(lengths: list[int], costs: SchemeCosts, options: EPPPipelinesOptions) -> StrategyPlan:
    """EPP pipelines of the fastest (or the given) pipeline scheme; see the module docstring."""
    t0 = time.perf_counter()
    m = costs.model
    if options.scheme is not None:
        schemes = [options.scheme]
    else:
        schemes = [
            s
            for s in enumerate_schemes(
                costs.num_devices, m.num_layers, m.num_heads, max_pp=options.max_pp, max_sp=options.max_sp
            )
            if s.pp >= 2 and costs.num_devices % s.num_devices == 0
        ]
    screened, wanted = {}, len(schemes)
    if options.scheme is None and 0 < options.screen < len(schemes):
        for scheme in schemes:
            d = costs.num_devices // scheme.num_devices
            loads = [
                sum(costs.T(int(lengths[i]), scheme) for i in g)
                for g in dispatch_longest_first(lengths, costs, scheme, d)
            ]
            screened[scheme] = max(loads)
        schemes, wanted = sorted(schemes, key=lambda s: (screened[s], s.pp, s.sp)), options.screen
    best, tried, errors = None, {}, []
    for scheme in schemes:
        if len(tried) == wanted:
            break  # the screen's best schemes that plan; one that cannot hands its turn to the next
        try:
            groups = _epp_groups(lengths, costs, scheme, options)
        except PlanningError as error:
            errors.append(f"{scheme}: {error}")
            continue
        if not all(g.plan.stats.get("fits_memory", True) for g in groups):
            errors.append(f"{scheme}: a pipeline's plan does not fit memory")
            continue
        t = predicted_time(groups, costs)
        tried[str(scheme)] = t
        if best is None or t < best[0]:
            best = (t, groups)
    if best is None:
        raise PlanningError("epp-pipelines: no pipeline scheme can plan this batch: " + "; ".join(errors[:4]))
    t, groups = best
    plan = StrategyPlan("epp-pipelines", costs.num_devices, tuple(int(x) for x in lengths), tuple(groups))
    plan.stats.update(
        policy="epp-pipelines",
        iteration_time_s=t,
        strategy=plan.describe(),
        candidates=[{"strategy": s, "iteration_time_s": v} for s, v in tried.items()],
        screened_load_s={str(s): v for s, v in screened.items()},
        solve_seconds=time.perf_counter() - t0,
    )
    plan.events.extend(errors)
    return plan


@dataclasses.dataclass(frozen=True)
class AutoOptions:
    """``policies``: the strategy policies ``auto`` plans with every iteration; ``options``: per policy
    name, the options to plan with (``(name, options)`` pairs; the policy's defaults otherwise)."""

    policies: tuple[str, ...] = AUTO_POLICIES
    options: tuple = ()


@register_policy("auto", AutoOptions)
def plan_auto(lengths: list[int], costs: SchemeCosts, options: AutoOptions) -> StrategyPlan:
    """The fastest plan of every policy in ``options.policies`` (see the module docstring)."""
    t0 = time.perf_counter()
    given = dict(options.options)
    estimates, best = {}, None
    for name in options.policies:
        start = time.perf_counter()
        try:
            plan = plan_strategy(name, lengths, costs, given.get(name))
        except (PlanningError, ValueError) as error:
            estimates[name] = {"error": str(error)[:300], "solve_seconds": time.perf_counter() - start}
            continue
        t = float(plan.stats["iteration_time_s"])
        estimates[name] = {
            "iteration_time_s": t,
            "strategy": plan.describe(),
            "solve_seconds": time.perf_counter() - start,
        }
        if best is None or t < float(best.stats["iteration_time_s"]):
            best = plan
    if best is None:
        raise PlanningError(
            "auto: no policy can plan this batch: " + "; ".join(f"{k}: {v['error']}" for k, v in estimates.items())
        )
    best.stats["policy_chosen"] = best.policy
    best.stats["auto_estimates"] = estimates
    best.stats["solve_seconds"] = time.perf_counter() - t0
    best.policy = "auto"
    return best


__all__ = [
    "AUTO_POLICIES",
    "AutoOptions",
    "EPPPipelinesOptions",
    "dispatch_longest_first",
    "plan_auto",
    "plan_epp_pipelines",
]
