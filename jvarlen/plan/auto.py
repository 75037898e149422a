"""Two strategy policies that sit on top of the others.

* ``epp-pipelines``: InfiniPipe's elastic pipelines as a strategy, ``d`` identical pipelines of a
  scheme ``P = (pp, sp)`` with ``pp ≥ 2``: the documents are dispatched longest first to the least
  loaded pipeline (load: ``T(l, P)``, Hydraulis App. B.2), and each pipeline's documents are planned
  by EPP (:func:`jvarlen.plan.api.plan_iteration`: chunks that split long documents, units,
  recomputation MILP). Without a fixed scheme the fastest ``P`` is kept: the schemes are planned
  from the best-ranked (:class:`EPPPipelinesOptions`) on, each with the best time so far as a
  ceiling (:func:`jvarlen.plan.epp.plan_epp`), and a scheme is given up as soon as one of its
  pipelines cannot beat it (``stats["candidates"]`` then records ``not_faster_than_s``).
* ``auto``: plans the iteration with every policy of ``AutoOptions.policies`` (the best homogeneous
  layout, EPP pipelines, Hydraulis, FlexSP, DCP), estimates each with the cost model (their
  ``iteration_time_s``, simulated in the executor's model: paired ticks, padded buckets) and returns the fastest, with
  every estimate in ``stats["auto_estimates"]`` and the winner in ``stats["policy_chosen"]``. A
  policy that cannot plan the batch (no layout fits, say) is skipped and its reason recorded.
  The policies that take a ceiling, EPP pipelines and then Hydraulis, are planned last, each with
  the best time of those before as its ceiling: their search then skips every candidate that cannot
  beat it, and records ``not_faster_than_s`` when none does (the same choice as planning every
  policy in full, unless two policies tie exactly: a tie goes to the policy planned first).

Pure Python: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import numpy as np

from jvarlen.plan.api import PlannerOptions, PlanningError, SlowerThanCeiling, plan_iteration
from jvarlen.plan.checkpointing import SolverOptions
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.sp_assemble import fits_memory
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
    strategy_policies,
)

AUTO_POLICIES = ("homogeneous", "epp-pipelines", "hydraulis", "flexsp", "dcp")


@dataclasses.dataclass(frozen=True)
class EPPPipelinesOptions:
    """``scheme``: the pipelines' scheme (None: the ``pp ≥ 2`` schemes of the device count, the
    fastest kept). Without a scheme, every scheme is ranked by its longest-first dispatch's largest
    pipeline load plus step overhead (the stage's pull and push, ``CostModel.step_overhead``; load:
    ``Σ T(l, P)``, a document too long for one chunk of the scheme as the slices memory forces,
    :func:`screened_time`) and planned by EPP in that order, each under the best time so far as
    its ceiling: a scheme none of whose chunkings can beat it costs only its lower bounds, so the
    ranking decides how soon the search has a tight ceiling, not which plan it returns.
    ``screen``: only the ``screen`` best-ranked schemes that plan (a scheme that cannot plan the
    batch, its model states or a pipeline's plan over memory, hands its turn to the next); 0
    plans every scheme. The ranking alone misses by far: on the 8-layer test model the fastest
    scheme, one (pp=2, sp=4) pipeline, was often ranked below two (pp=4, sp=1) pipelines, 1.25x
    slower at most (the ranking charges each short document its own micro-batch, where EPP packs
    them, and leaves out each pipeline's fill and drain).
    ``planner``: EPP's options (the executor's model, ``"paired"``: EPP then cuts bucket-sized
    slices, which the executor pads least). ``ceiling``: only a plan faster than that many seconds
    is wanted (``auto`` passes the other policies' best); the search skips what cannot beat it and
    raises :class:`SlowerThanCeiling` when no scheme does (with ``planner.prune``)."""

    scheme: Optional[Scheme] = None
    ceiling: Optional[float] = None
    max_pp: int = 8
    max_sp: int = 8
    screen: int = 0
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


def screened_time(costs: SchemeCosts, scheme: Scheme, length: int, cap: int) -> float:
    """What the screen charges a document on ``scheme``: ``T(l, P)`` where it fits one chunk of
    ``cap`` tokens (``CostModel.max_tokens`` with the pipeline's ``pp`` chunks in flight, fully
    recomputed); a longer one as the ``ceil(l / cap)`` equal slices EPP must cut it into at least,
    each recomputed and attending to the slices before it. Memory forces those slices on a scheme
    whose chunks hold few tokens, and each slice is an op that pays its own launches and, with
    sharded stage weights, its own layer gathers, which ``T(l, P)`` of the whole document hides."""
    if not 0 < cap < length:
        return costs.T(int(length), scheme)
    cost, last = costs.cost(scheme), scheme.pp - 1
    n = -(-int(length) // int(cap))
    bounds = [int(length) * i // n for i in range(n + 1)]
    total = 0.0
    for i in range(n):
        chunk = ChunkShape(bounds[i], (bounds[i + 1] - bounds[i],), tail=i == n - 1)
        total += cost.fwd_time(chunk, last) + cost.bwd_time(chunk, last)
        total += cost.recompute_time(chunk, cost.layers_per_stage)
    return total


def _epp_groups(
    lengths, costs: SchemeCosts, scheme: Scheme, options: EPPPipelinesOptions, ceiling: Optional[float] = None
) -> list[GroupPlan]:
    """An EPP plan per pipeline of ``scheme``; ``ceiling``: the time a faster scheme already has,
    so a pipeline that cannot beat it raises :class:`SlowerThanCeiling` (the most loaded pipelines
    are planned first: they are the likeliest to)."""
    d = costs.num_devices // scheme.num_devices
    docs = [g for g in dispatch_longest_first(lengths, costs, scheme, d) if g]
    devices = place_groups([scheme] * len(docs), costs.num_devices)
    load = [sum(costs.T(int(lengths[i]), scheme) for i in ids) for ids in docs]
    plans = {}
    for j in sorted(range(len(docs)), key=lambda j: (-load[j], j)):
        ids = docs[j]
        plans[j] = plan_iteration(
            [lengths[i] for i in ids], cost=costs.cost(scheme), policy="epp", options=options.planner, ceiling=ceiling
        )
    return [GroupPlan(scheme, devs, tuple(ids), plans[j]) for j, (ids, devs) in enumerate(zip(docs, devices))]


@register_policy("epp-pipelines", EPPPipelinesOptions)
def plan_epp_pipelines(lengths: list[int], costs: SchemeCosts, options: EPPPipelinesOptions) -> StrategyPlan:
    """EPP pipelines of the fastest (or the given) pipeline scheme; see the module docstring."""
    t0 = time.perf_counter()
    m = costs.model
    if options.scheme is not None:
        if options.scheme.num_devices > costs.num_devices:
            raise ValueError(
                f"epp-pipelines: scheme {options.scheme} needs more than the run's {costs.num_devices} devices"
            )
        schemes = [options.scheme]
    else:
        fitting = [
            s
            for s in enumerate_schemes(
                costs.num_devices, m.num_layers, m.num_heads, max_pp=options.max_pp, max_sp=options.max_sp
            )
            if s.pp >= 2 and s.num_devices <= costs.num_devices
        ]
        # pipelines that use every device; where none does (3, 5, 7 devices), some stay idle
        schemes = [s for s in fitting if costs.num_devices % s.num_devices == 0] or fitting
        if not schemes:
            raise PlanningError(
                f"epp-pipelines: no pipeline scheme (pp >= 2, pp <= {options.max_pp}, sp <= {options.max_sp}) fits "
                f"{costs.num_devices} devices and {m.num_layers} layers"
            )
    screened, wanted = {}, len(schemes)
    if options.scheme is None:
        for scheme in schemes:
            d = costs.num_devices // scheme.num_devices
            cap = costs.cost(scheme).max_tokens(in_flight=scheme.pp)
            loads = [
                sum(screened_time(costs, scheme, lengths[i], cap) for i in g)
                for g in dispatch_longest_first(lengths, costs, scheme, d)
            ]
            # what the groups' predicted time adds to the slowest pipeline: its stage's pull and push,
            # which halve with every doubling of pp where they cross a slow link
            screened[scheme] = max(loads) + costs.cost(scheme).step_overhead()
        schemes = sorted(schemes, key=lambda s: (screened[s], s.pp, s.sp))
        wanted = options.screen if 0 < options.screen < len(schemes) else len(schemes)
    best, tried, slower, errors = None, {}, {}, []
    for scheme in schemes:
        if len(tried) + len(slower) == wanted:
            break  # the ranking's best schemes that plan; one that cannot hands its turn to the next
        ceiling = options.ceiling if best is None else best[0]
        try:
            groups = _epp_groups(lengths, costs, scheme, options, ceiling)
        except SlowerThanCeiling:
            slower[str(scheme)] = ceiling
            continue
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
    if best is None and slower:
        raise SlowerThanCeiling(
            f"epp-pipelines: no scheme of {', '.join(slower)} is faster than {options.ceiling:.4g} s"
        )
    if best is None:
        raise PlanningError("epp-pipelines: no pipeline scheme can plan this batch: " + "; ".join(errors[:4]))
    t, groups = best
    plan = StrategyPlan("epp-pipelines", costs.num_devices, tuple(int(x) for x in lengths), tuple(groups))
    plan.stats.update(
        policy="epp-pipelines",
        iteration_time_s=t,
        strategy=plan.describe(),
        candidates=[{"strategy": s, "iteration_time_s": v} for s, v in tried.items()]
        + [{"strategy": s, "not_faster_than_s": v} for s, v in slower.items()],
        screened_estimate_s={str(s): v for s, v in screened.items()},
        solve_seconds=time.perf_counter() - t0,
    )
    plan.events.extend(errors)
    return plan


@dataclasses.dataclass(frozen=True)
class AutoOptions:
    """``policies``: the strategy policies ``auto`` plans with every iteration; ``options``: per policy
    name, the options to plan with (``(name, options)`` pairs; the policy's defaults otherwise).
    A policy whose options have a ``ceiling`` (``hydraulis``, ``epp-pipelines``) is planned after the
    others with their best time as its ceiling: it then searches only for a faster plan, and its estimate
    records ``not_faster_than_s`` when it has none. ``ceiling``: a time the caller already has for
    the batch (:func:`jvarlen.plan.stage_weights.plan_each`'s other variant), a ceiling of those
    policies too; where no policy plans at all and one was not faster than it,
    :class:`SlowerThanCeiling`."""

    policies: tuple[str, ...] = AUTO_POLICIES
    options: tuple = ()
    ceiling: Optional[float] = None


def _why(estimate: dict) -> str:
    if "error" in estimate:
        return estimate["error"]
    return f"no plan faster than its ceiling, {estimate['not_faster_than_s']:.4g} s"


def _takes_ceiling(options_type: type) -> bool:
    return dataclasses.is_dataclass(options_type) and "ceiling" in {f.name for f in dataclasses.fields(options_type)}


def with_ceiling(options_type: type, options, ceiling: Optional[float]):
    """``options`` (None: ``options_type``'s defaults) bounded by ``ceiling`` where the policy takes
    one (its own ceiling kept where lower); else ``options`` as given."""
    if ceiling is None or not _takes_ceiling(options_type):
        return options
    options = options or options_type()
    return dataclasses.replace(options, ceiling=ceiling if options.ceiling is None else min(options.ceiling, ceiling))


def _rank(plan: StrategyPlan) -> tuple:
    """Plans that fit memory first, then the fastest."""
    return (not fits_memory(plan), float(plan.stats["iteration_time_s"]))


@register_policy("auto", AutoOptions)
def plan_auto(lengths: list[int], costs: SchemeCosts, options: AutoOptions) -> StrategyPlan:
    """The fastest plan of every policy in ``options.policies`` (see the module docstring)."""
    t0 = time.perf_counter()
    given = dict(options.options)
    estimates, best = {}, None
    registry = strategy_policies()
    bounded = [n for n in options.policies if n in registry and _takes_ceiling(registry[n][1])]
    for name in [n for n in options.policies if n not in bounded] + bounded:
        start = time.perf_counter()
        opts = given.get(name)
        if name in bounded:
            bounds = [] if options.ceiling is None else [float(options.ceiling)]
            if best is not None and fits_memory(best):  # a plan that does not fit bounds nothing
                bounds.append(float(best.stats["iteration_time_s"]))
            opts = with_ceiling(registry[name][1], opts, min(bounds, default=None))
        try:
            plan = plan_strategy(name, lengths, costs, opts)
        except SlowerThanCeiling:
            estimates[name] = {"not_faster_than_s": opts.ceiling, "solve_seconds": time.perf_counter() - start}
            continue
        except (PlanningError, ValueError) as error:
            estimates[name] = {"error": str(error)[:300], "solve_seconds": time.perf_counter() - start}
            continue
        t = float(plan.stats["iteration_time_s"])
        estimates[name] = {
            "iteration_time_s": t,
            "strategy": plan.describe(),
            "fits_memory": fits_memory(plan),
            "solve_seconds": time.perf_counter() - start,
        }
        if best is None or _rank(plan) < _rank(best):
            best = plan
    if best is None:
        why = "; ".join(f"{k}: {_why(v)}" for k, v in estimates.items())
        if options.ceiling is not None and any("not_faster_than_s" in v for v in estimates.values()):
            raise SlowerThanCeiling(f"auto: no policy plans this batch faster than {options.ceiling:.4g} s: {why}")
        raise PlanningError("auto: no policy can plan this batch: " + why)
    if not fits_memory(best):
        best.events.append("auto: no policy's plan fits memory by the planner's account; kept the fastest")
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
    "with_ceiling",
]
