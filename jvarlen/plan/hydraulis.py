"""The ``hydraulis`` and ``homogeneous`` strategy policies (Hydraulis §6-7): per iteration, every
candidate strategy is priced by the two-stage assignment and the best one is planned.

Per iteration (Hydraulis §4 steps 1-4), for the ``lengths`` of one batch:

1. **Candidates** ``Ŝ``: ``options.candidates`` (proposed once per corpus by
   :func:`~jvarlen.plan.hydraulis_proposal.propose_strategies`, Eq. 4, and cached), or, when
   None, proposed from the batch itself. Candidates whose largest ``MaxLen`` is below the
   batch's longest document are skipped.
2. **Dispatch** (§6.2): App. D Alg. 1 with ``rank_trials`` seeded trials, all candidates and
   trials vectorised together (:mod:`jvarlen.plan.hydraulis_dispatch`); a candidate's first
   estimate is the slowest pipeline's least packing objective (``pack_bounds``) plus its group's
   step overhead (optimizer update and the stage's parameter/gradient sync).
3. **Pack** (§6.1): the ``pack_top`` best candidates are dispatched again with ``trials`` trials
   and packed with LPT over App. C's range of V (:mod:`jvarlen.plan.hydraulis_pack`; objective
   ``(PP - 1)·slowest + κ·Σ`` by default, Eq. 1's ``(PP - 1 + κV)·slowest`` with
   ``PackOptions(objective="eq1")``); the ``simulate_top`` best of them are packed again with the
   Eq. 1 ILP (CP-SAT, branch and bound over V).
4. **Plan**: for each of those finalists one :class:`~jvarlen.plan.strategy.GroupPlan` per
   pipeline that received documents (``build_group_plan``: the packed micro-batches as one 1F1B
   unit, each micro-batch recomputing the layers its tokens need; also cut at its executor bucket
   where that is faster: a ``pp = 1`` pipeline's as the SP-group policies' groups are,
   :meth:`~jvarlen.plan.sp_groups.GroupCosts.fastest_cut`, a deeper one's by simulating the best
   packings into bins of an executor bucket, :func:`~jvarlen.plan.pipeline_cut.bucket_cut`), devices
   from ``place_groups``;
   its ``iteration_time_s`` is the slowest group's simulated time, step overhead included
   (``predicted_time``). A candidate whose estimate is below the fastest simulated time is
   packed (if it was not) and, if still below, planned and simulated too (the estimates leave out
   the recomputation that fits the executor's buffers), best estimate first, until none is; the
   fastest is returned. A candidate (finalist or not) is not planned where one of its ``pp > 1``
   pipelines is bounded above a fitting plan already simulated
   (:func:`~jvarlen.plan.hydraulis_build.exceeds`), and given up as soon as one of its groups,
   slowest estimate first, simulates above it (``build_plan(above=...)``): the same plan, a third
   to two thirds less planning CPU on the 7B-32B a800-ib200 strategies-benchmark settings.
   ``HydraulisOptions(ceiling=...)`` (``auto``: the best of the policies planned before) bounds
   the same way from the start, and the planner raises ``SlowerThanCeiling`` when nothing beats it.
   ``stats["candidates"]`` keeps every candidate's estimate (and the simulated times), an event
   names the choice.

``homogeneous`` runs the same steps on the strategies ``d × P`` (``d = N / |P|`` pipelines of one
scheme), every scheme of the space (``scheme=None``: best per iteration) or one fixed scheme
(``HomogeneousOptions(scheme=...)``: a static layout); ``packing="fixed"`` replaces the two-stage
assignment by fixed-length packing and even dispatch (:func:`fixed_packing`, the baselines of §8).

A plan is a pure function of (lengths, costs, options): the trials are seeded from
``options.seed`` and a hash of the lengths; CP-SAT runs one worker with a fixed seed under a
deterministic time limit; only a wall-clock safety limit can change a result, and that is
recorded in ``plan.events``.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from typing import Optional, Sequence

import numpy as np

from jvarlen.plan.api import PlanningError
from jvarlen.plan.chunk import document_lengths
from jvarlen.plan.hydraulis_build import Evaluation, build_plan, exceeds
from jvarlen.plan.hydraulis_costs import SchemeTable, scheme_tables
from jvarlen.plan.hydraulis_dispatch import DispatchProblem, greedy_dispatch_many, local_search, trial_orders
from jvarlen.plan.hydraulis_options import RECOMPUTE, SIMULATIONS, AssignmentOptions, scheme_space  # noqa: F401
from jvarlen.plan.hydraulis_pack import PackOptions, PackResult, pack, pipeline_time
from jvarlen.plan.hydraulis_proposal import ProposalOptions, canonical, propose_strategies
from jvarlen.plan.options import SlowerThanCeiling
from jvarlen.plan.sp_assemble import fastest_fitting, fits_memory
from jvarlen.plan.strategy import (
    Scheme,
    SchemeCosts,
    StrategyPlan,
    register_policy,
)

Strategy = tuple[Scheme, ...]


@dataclasses.dataclass(frozen=True)
class HydraulisOptions(AssignmentOptions):
    """``candidates``: the candidate strategies Ŝ (each a tuple of schemes, one per pipeline); None
    proposes them from the batch (Eq. 4 on its lengths; slower: propose once per corpus with
    :func:`~jvarlen.plan.hydraulis_proposal.cached_proposal` and pass them here). ``ceiling``: only a
    plan faster than that many seconds is wanted (``auto`` passes the best of the policies it
    planned before): with ``prune`` it bounds the candidates built as a fitting plan already built
    does, and :class:`~jvarlen.plan.options.SlowerThanCeiling` is raised when no candidate beats it."""

    candidates: Optional[tuple[Strategy, ...]] = None
    proposal: ProposalOptions = ProposalOptions()
    include_homogeneous: bool = True  # the d × P strategies are candidates too
    ceiling: Optional[float] = None

    def for_corpus(self, corpus_lengths: Sequence[int], costs: SchemeCosts, max_len: Optional[int] = None):
        """These options with ``candidates`` proposed from the corpus (Eq. 4, §7; once at the start of
        a run) unless given. Use :func:`~jvarlen.plan.hydraulis_proposal.cached_proposal` to keep them."""
        if self.candidates is not None:
            return self
        top = int(max_len or max(corpus_lengths))
        return dataclasses.replace(self, candidates=propose_strategies(corpus_lengths, costs, top, self))


@dataclasses.dataclass(frozen=True)
class HomogeneousOptions(AssignmentOptions):
    """``scheme``: one fixed scheme for every iteration (a static layout); None: the best ``d × P``
    per iteration. ``packing``: ``"balanced"`` (Hydraulis' dispatch and packing) or ``"fixed"``
    (:func:`fixed_packing`: Megatron-LM / DeepSpeed practice, the baselines of Hydraulis §8)."""

    scheme: Optional[Scheme] = None
    packing: str = "balanced"

    def __post_init__(self):
        super().__post_init__()
        if self.packing not in ("balanced", "fixed"):
            raise ValueError(f"packing must be 'balanced' or 'fixed', got {self.packing!r}")


def tables_for(costs: SchemeCosts, schemes: Sequence[Scheme], options: AssignmentOptions) -> dict[Scheme, SchemeTable]:
    return scheme_tables(costs, schemes, options.recompute == "auto", options.util_threshold, options.simulation)


def batch_seed(lengths: Sequence[int], seed: int) -> tuple[int, int]:
    """The trials' seed: the options' seed and a hash of the batch (same batch, same plan)."""
    return int(seed), zlib.crc32(np.asarray(lengths, dtype=np.int64).tobytes())


def _slowest(times: Sequence[float], tables: Sequence[SchemeTable], used) -> float:
    """A strategy's estimate from its pipelines' times: the slowest pipeline that received documents,
    with its step overhead (``predicted_time``: each group's simulated time includes it)."""
    return max((float(t) + tab.overhead_s for t, tab, u in zip(times, tables, used) if u), default=0.0)


def dispatch_all(
    lengths: np.ndarray,
    strategies: Sequence[Strategy],
    table_of,
    costs: SchemeCosts,
    trials: int,
    options,
    improve: bool = False,
) -> list[Evaluation]:
    """Alg. 1 for every strategy at once (shared trial orders). A candidate's estimate is, per
    pipeline, the least packing objective its dispatched documents allow (``pack_bounds``) plus the
    group's step overhead; the slowest pipeline that received documents."""
    tables = [[table_of[s] for s in strategy] for strategy in strategies]
    problems = [DispatchProblem.build(lengths, t) for t in tables]
    orders = trial_orders(lengths, trials, batch_seed(lengths, options.seed), options.lpt_trial)
    out = []
    for strategy, tabs, problem, res in zip(strategies, tables, problems, greedy_dispatch_many(problems, orders)):
        if improve:
            res = local_search(problem, res.assign)
        used = np.bincount(res.assign, minlength=len(strategy)) > 0
        bounds = problem.pack_bounds(res.assign, options.pack.prune, options.pack.objective)
        out.append(Evaluation(strategy, tabs, res.assign, _slowest(bounds, tabs, used)))
    return out


def pack_all(ev: Evaluation, lengths: np.ndarray, costs: SchemeCosts, pack_options: PackOptions) -> Evaluation:
    """Packs every pipeline of a dispatched candidate; the estimate is the slowest pipeline's packing
    objective plus its step overhead."""
    packs = [pack(lengths[ev.documents(j)].tolist(), t, pack_options) for j, t in enumerate(ev.tables)]
    packed = _slowest([p.objective_s for p in packs], ev.tables, [p.V > 0 for p in packs])
    return dataclasses.replace(ev, packs=packs, packed_s=packed)


def pack_again(
    ev: Evaluation, candidate: Strategy, lengths: np.ndarray, table_of, costs: SchemeCosts, options: AssignmentOptions
) -> Evaluation:
    """A candidate priced by its dispatch bound alone, dispatched again with ``trials`` trials (when
    they are more than ``rank_trials``) and LPT-packed. A candidate's dispatch does not depend on the
    others dispatched with it (the trial orders are the batch's), so one at a time gives the plans
    that dispatching the ``pack_top`` best together gave."""
    if options.trials > options.rank_trials:
        ev = dispatch_all(lengths, [candidate], table_of, costs, options.trials, options, options.local_search)[0]
    return pack_all(ev, lengths, costs, dataclasses.replace(options.pack, ilp=False))


def select(
    lengths: np.ndarray, candidates: Sequence[Strategy], table_of, costs: SchemeCosts, options: AssignmentOptions
) -> tuple[list[int], list[Evaluation]]:
    """Steps 2-3: every candidate dispatched with ``rank_trials`` trials and priced by its Eq. 1
    bound; the ``pack_top`` best dispatched again with ``trials`` trials and LPT-packed (Eq. 1
    objective); the ``simulate_top`` best of those (the finalists, best first) packed with the ILP.
    The same for the ``homogeneous_top`` best homogeneous candidates (``d × P`` as
    :func:`homogeneous_strategies` lays them out), whose finalists follow.
    Returns the finalists' indices and every evaluation."""
    evals = dispatch_all(lengths, candidates, table_of, costs, min(options.rank_trials, options.trials), options)

    def best_of(members: Sequence[int], pack_top: int, simulate_top: int) -> list[int]:
        top = sorted(members, key=lambda k: (evals[k].dispatch_s, k))[:pack_top]
        for k in top:
            if evals[k].packs is None:
                evals[k] = pack_again(evals[k], candidates[k], lengths, table_of, costs, options)
        ranked = sorted(top, key=lambda k: (evals[k].packed_s, k))
        margin = evals[ranked[0]].packed_s * (1 + options.simulate_margin)
        return [k for k in ranked[:simulate_top] if evals[k].packed_s <= margin]

    finalists = best_of(range(len(evals)), options.pack_top, options.simulate_top)
    homogeneous = [k for k, c in enumerate(candidates) if c == (c[0],) * (costs.num_devices // c[0].num_devices)]
    if homogeneous and options.homogeneous_top:
        top = options.homogeneous_top
        finalists += [k for k in best_of(homogeneous, top, top) if k not in finalists]
    if options.pack.ilp:
        for k in finalists:
            evals[k] = pack_all(evals[k], lengths, costs, options.pack)
    return finalists, evals


def fixed_packing(
    lengths: np.ndarray, strategy: Strategy, tables: Sequence[SchemeTable], costs: SchemeCosts, options
) -> Evaluation:
    """Fixed-length packing and even dispatch (Hydraulis §3.2 and the baselines of §8): documents,
    longest first, packed first-fit into sequences of at most a fixed length (a longer document
    alone), and the packed sequences dealt to the pipelines in turn, each pipeline getting the same
    number of micro-batches (±1) whatever their time. The length is the batch's longest document
    (≈ the context length, the usual choice) or the scheme's capacity, whichever the estimate
    prefers. For one homogeneous strategy."""
    table = tables[0]
    caps = sorted({min(table.cap0, int(lengths.max())), table.cap0})
    return min((_fixed(lengths, strategy, tables, costs, options, c) for c in caps), key=lambda e: e.packed_s)


def _fixed(lengths, strategy, tables, costs, options, cap: int) -> Evaluation:
    table = tables[0]
    bins: list[list[int]] = []
    room: list[int] = []
    for i in np.lexsort((np.arange(lengths.size), -lengths)).tolist():
        x = int(lengths[i])
        j = next((k for k, r in enumerate(room) if r >= x), -1) if x <= cap else -1
        if j < 0:
            bins.append([i])
            room.append(cap - x if x <= cap else -1)
        else:
            bins[j].append(i)
            room[j] -= x
    d = len(strategy)
    assign = np.empty(lengths.size, dtype=np.int64)
    per: list[list[list[int]]] = [[] for _ in range(d)]
    for k, b in enumerate(bins):
        assign[b] = k % d
        per[k % d].append(b)
    packs = []
    for j in range(d):
        docs = np.flatnonzero(assign == j)
        local = {int(g): n for n, g in enumerate(docs)}
        mbs = tuple(tuple(local[i] for i in b) for b in per[j])
        sub = lengths[docs]
        times = tuple(
            float(table.micro_batch_time(float((sub[list(m)] ** 2).sum()), float(sub[list(m)].sum()))) for m in mbs
        )
        obj = pipeline_time(sub.tolist(), mbs, table, options.pack.objective)
        packs.append(PackResult(mbs, times, obj, obj, "fixed"))
    used = [p.V > 0 for p in packs]
    est = _slowest([p.objective_s for p in packs], tables, used)
    return Evaluation(strategy, list(tables), assign, est, packs, est)


def two_stage_plan(
    policy: str,
    lengths: np.ndarray,
    candidates: Sequence[Strategy],
    table_of,
    costs: SchemeCosts,
    options: AssignmentOptions,
    t0: float,
    events: list,
    ceiling: Optional[float] = None,
) -> StrategyPlan:
    """Steps 2-4 (:func:`select`, :func:`build_plan`): the finalist whose simulated plan is fastest;
    ``stats["candidates"]`` holds every candidate's estimate (and the finalists' simulated times), an
    event names the choice. With ``ceiling`` (and ``options.prune``) a candidate must beat the lower
    of it and the fastest plan built (its estimate to be packed and built, its groups to be kept building), and
    :class:`SlowerThanCeiling` is raised when no plan does."""
    fixed = isinstance(options, HomogeneousOptions) and options.packing == "fixed"
    if fixed:
        evals = [fixed_packing(lengths, c, [table_of[s] for s in c], costs, options) for c in candidates]
        chosen = sorted(range(len(evals)), key=lambda k: (evals[k].packed_s, k))[: options.simulate_top]
    else:
        chosen, evals = select(lengths, candidates, table_of, costs, options)
    finalists, plans, bounded = [], [], set()
    # a plan must be faster than the ceiling: one as slow is given up as one slower than a plan built is
    limit = [math.nextafter(float(ceiling), 0.0)] if ceiling is not None and options.prune else []

    def build(k: int) -> None:  # unless a group is shown slower than a fitting plan built or the ceiling
        fitting = [p.stats["iteration_time_s"] for p in plans if fits_memory(p)]
        above = min((fitting if options.prune else []) + limit, default=None)
        if above is None or not exceeds(evals[k], above, lengths, costs, options):
            plan = build_plan(policy, lengths, evals[k], costs, options, above)
            if plan is not None:
                finalists.append(k)
                plans.append(plan)
                return
        bounded.add(k)

    for k in chosen:
        build(k)
    while not fixed:
        # a finalist's simulated time includes what its estimate leaves out (the recomputation that
        # fits the executor's buffers, +17 % on a 7B (pp 1, sp 8) group of 8 A800s); a candidate
        # whose estimate is below the best simulated time may be faster: packed as the top ones
        # were, and simulated where its packed estimate is still below
        fitting = [p.stats["iteration_time_s"] for p in plans if fits_memory(p)]
        fastest = min((fitting or [p.stats["iteration_time_s"] for p in plans]) + limit, default=math.inf)
        waiting = [k for k, e in enumerate(evals) if k not in finalists and k not in bounded and e.estimate_s < fastest]
        if not waiting:
            break
        k = min(waiting, key=lambda k: (evals[k].estimate_s, k))
        if evals[k].packs is None:
            evals[k] = pack_again(evals[k], candidates[k], lengths, table_of, costs, options)
            if evals[k].packed_s >= fastest:
                continue
        if options.pack.ilp:
            evals[k] = pack_all(evals[k], lengths, costs, options.pack)
        build(k)
    best = fastest_fitting(plans, policy) if plans else None
    if limit and (best is None or plans[best].stats["iteration_time_s"] >= ceiling):
        raise SlowerThanCeiling(f"{policy}: no candidate of {len(evals)} is faster than {ceiling:.4g} s")
    plan = plans[best]
    simulated = {finalists[i]: p.stats["iteration_time_s"] for i, p in enumerate(plans)}
    plan.events[:0] = events
    plan.events.append(
        f"{policy}: chose {plan.describe()} (simulated {plan.stats['iteration_time_s']:.4g} s, estimated "
        f"{evals[finalists[best]].estimate_s:.4g} s) of {len(evals)} candidates"
    )
    plan.stats["candidates"] = [
        {
            "strategy": _describe(e.strategy),
            "iteration_time_s": simulated.get(k, e.estimate_s),
            "estimated_s": e.estimate_s,
            "estimate": _estimate_kind(k, e, simulated, bounded),
        }
        for k, e in enumerate(evals)
    ]
    plan.stats["solve_seconds"] = time.perf_counter() - t0
    return plan


def _estimate_kind(k: int, ev: Evaluation, simulated, bounded) -> str:
    """How ``stats["candidates"]`` priced candidate ``k``: its simulated plan, a pipeline shown slower
    than a fitting plan (:func:`exceeds`; ``iteration_time_s`` is its packed estimate), its packing
    objective, or its dispatch bound."""
    if k in simulated:
        return "simulated"
    if k in bounded:
        return "exceeds"
    return "packed" if ev.packs is not None else "bound"


def _describe(strategy: Sequence[Scheme]) -> str:
    counts: dict[Scheme, int] = {}
    for s in strategy:
        counts[s] = counts.get(s, 0) + 1
    return " + ".join(f"{d}×{s}" for s, d in sorted(counts.items(), key=lambda kv: (-kv[0].num_devices, kv[0])))


def _check_fits(lengths: np.ndarray, table_of: dict[Scheme, SchemeTable], policy: str) -> None:
    longest = int(lengths.max())
    best = max(table_of.values(), key=lambda t: t.max_len, default=None)
    if best is None or best.max_len < longest:
        fits = ", ".join(f"{s}: {t.max_len}" for s, t in sorted(table_of.items(), key=lambda kv: -kv[1].max_len)[:4])
        raise PlanningError(
            f"{policy}: a document of {longest} tokens fits no scheme's memory; largest MaxLen: {fits or 'none'} "
            "(allow more devices per scheme, recompute='auto', or truncate the documents)"
        )


def _lengths(lengths: Sequence[int]) -> np.ndarray:
    return np.asarray(document_lengths(lengths), dtype=np.int64)


@register_policy("hydraulis", HydraulisOptions)
def plan(lengths: list[int], costs: SchemeCosts, options: HydraulisOptions) -> StrategyPlan:
    """Hydraulis for one iteration (see the module docstring)."""
    t0 = time.perf_counter()
    arr = _lengths(lengths)
    events: list[str] = []
    schemes = scheme_space(costs, options)
    if options.candidates is not None:
        for c in options.candidates:
            if sum(s.num_devices for s in c) > costs.num_devices:
                raise ValueError(f"candidate {_describe(c)} needs more than the run's {costs.num_devices} devices")
        schemes = sorted(set(schemes) | {s for c in options.candidates for s in c}, key=lambda s: (s.num_devices, s.pp))
    table_of = tables_for(costs, schemes, options)
    _check_fits(arr, table_of, "hydraulis")
    longest = int(arr.max())
    candidates = []
    if options.candidates is not None:
        for c in options.candidates:
            if c and max(table_of[s].max_len for s in c) >= longest:
                candidates.append(canonical(c, table_of))
        if not candidates:
            events.append(f"hydraulis: no candidate holds a {longest}-token document; proposing from the batch")
    if not candidates:
        candidates = [
            c
            for c in propose_strategies(arr, costs, longest, options, schemes=list(table_of))
            if max(table_of[s].max_len for s in c) >= longest
        ]
    if options.include_homogeneous:
        candidates += [c for c in homogeneous_strategies(costs, scheme_space(costs, options)) if c[0] in table_of]
    candidates = [c for c in dict.fromkeys(candidates) if max(table_of[s].max_len for s in c) >= longest]
    if not candidates:
        raise PlanningError(f"hydraulis: no strategy of {costs.num_devices} devices holds a {longest}-token document")
    return two_stage_plan("hydraulis", arr, candidates, table_of, costs, options, t0, events, options.ceiling)


def homogeneous_strategies(costs: SchemeCosts, schemes: Sequence[Scheme]) -> list[Strategy]:
    """``d × P`` with ``d = N // |P|`` for every scheme."""
    return [(s,) * (costs.num_devices // s.num_devices) for s in schemes if s.num_devices <= costs.num_devices]


@register_policy("homogeneous", HomogeneousOptions)
def plan_homogeneous(lengths: list[int], costs: SchemeCosts, options: HomogeneousOptions) -> StrategyPlan:
    """The best static homogeneous layout ``d × P`` (one scheme on every pipeline) with the same
    dispatch and packing: over every scheme per iteration, or ``options.scheme`` only."""
    t0 = time.perf_counter()
    arr = _lengths(lengths)
    schemes = [options.scheme] if options.scheme is not None else scheme_space(costs, options)
    table_of = tables_for(costs, schemes, options)
    _check_fits(arr, table_of, f"homogeneous {options.scheme}" if options.scheme else "homogeneous")
    longest = int(arr.max())
    candidates = [c for c in homogeneous_strategies(costs, schemes) if table_of[c[0]].max_len >= longest]
    if not candidates:
        raise PlanningError(f"homogeneous: no layout of {costs.num_devices} devices holds a {longest}-token document")
    policy = "homogeneous" if options.packing == "balanced" else "homogeneous-fixed"
    return two_stage_plan(policy, arr, candidates, table_of, costs, options, t0, [])


__all__ = [
    "AssignmentOptions",
    "HomogeneousOptions",
    "HydraulisOptions",
    "fixed_packing",
    "homogeneous_strategies",
    "plan",
    "plan_homogeneous",
    "scheme_space",
]
