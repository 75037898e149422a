"""DCP policy (Data-Centric Parallel): per-batch parallel size p, batch size b, accumulation g, recomputation r.

DCP lets each batch's sequence length pick its runtime settings. Its notions map onto the
shared structures (:mod:`jvarlen.plan.strategy`) as follows:

* a DCP *batch* ``d_i`` (b sequences of one length) is one **micro-batch** packing ``b`` whole
  documents of one length class (a *bucket*: lengths within a factor ``bucket_ratio``);
* its *sequence parallel size* ``p_i`` is the group's scheme ``Scheme(1, p)``;
* its *gradient accumulation steps* ``g_i`` are the **number of micro-batches** the group runs;
* its *recomputed layers* ``r_i`` (DCP-intra) are the group plan's ``ckpt`` per micro-batch
  (runtime data, no recompilation per choice);
* the *profile* (§3.5, dual-layer profiling: per-layer ``t_f``, ``t_b``, ``m`` and the constants
  ``T_C``, ``M_C``) is the fitted per-layer cost model (:class:`~jvarlen.plan.strategy.SchemeCosts`).

Per iteration:

1. **(b, p, r) per bucket** (§3.3, Eq. 1; §3.4, Alg. 1, Eq. 4-6): for every scheme p and batch
   size b of a grid, the batch's time and memory with every layer recomputed; DCP-intra
   (:func:`alg1`) lowers the recomputation to the least that fits memory and keeps, per p, the b
   of highest throughput ``b·s / (p·T)``; DCP-inter keeps full recomputation.
2. **g per group** (§3.3, Eq. 3, App. C): a bucket's documents spread over ``n`` groups of p
   devices (LPT), each group running ``g = ⌈docs / b⌉`` micro-batches, ``g ∈ [G_min, G_max]``.
   The iteration's documents are fixed, so choosing g is choosing n: for a time target τ each
   bucket takes the (p, n) with the fewest devices whose slowest group fits τ (the most
   throughput, Eq. 1, subject to balance, Eq. 2-3); the least τ whose buckets fit the devices
   wins (a search over the finite set of group times), idle devices then go to the buckets
   whose groups are slowest while that does not slow them (lowering Eq. 3's idle sum). Short
   buckets thus get few small groups that accumulate many micro-batches while a long document
   runs once on a large group.
3. Several bucket widths are tried, and the one-class bucketing on each of its best
   ``homogeneous_top`` SP degrees by the group model (:func:`one_degree_finalists`); each is
   planned for the executor and the fastest simulated one is kept
   (:func:`~jvarlen.plan.sp_assemble.assemble_fastest`). Alg. 1 and the profile it reads are in
   :mod:`jvarlen.plan.dcp_alg1`.

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from typing import Optional, Sequence

from jvarlen.plan.api import SIMULATIONS, PlanningError
from jvarlen.plan.chunk import document_lengths
from jvarlen.plan.chunking import chunk_group, sorted_order
from jvarlen.plan.dcp_alg1 import ProfileEntry, Setting, alg1, batch_grid, profile_entry
from jvarlen.plan.sp_assemble import assemble_fastest, candidate_record
from jvarlen.plan.sp_groups import GroupChoice, GroupCosts, group_costs_for, infeasible_documents, too_long_message
from jvarlen.plan.sp_refine import refine_groups
from jvarlen.plan.strategy import Scheme, SchemeCosts, StrategyPlan, register_policy


@dataclasses.dataclass(frozen=True)
class DCPOptions:
    """Knobs of the DCP policies.

    ``intra``: DCP-intra (least recomputation per (b, p), Alg. 1) or DCP-inter (every layer
    recomputed). ``g_min`` / ``g_max``: bounds on a group's accumulation steps (App. C; a group
    with fewer documents than ``g_min`` runs one per micro-batch; ``g_max`` is lifted, with an
    event, when the devices cannot otherwise hold the iteration). ``bucket_ratios``: widths of the
    length classes tried (``inf``: one class); ``scheme_buckets``: also try buckets of the documents
    that prefer the same SP degree (:func:`buckets_by_scheme`). ``max_batch_docs``: largest b profiled.
    ``max_sp``: largest group. ``micro_batch_tokens``: cap on a micro-batch's tokens.
    ``simulation``: the executor model of the group plans. ``homogeneous_top``: the one-class
    bucketing's best this many SP degrees by the group model are planned as well, each alone
    (:func:`one_degree_finalists`): the search picks the degree by that model, which can misrank
    two degrees that the simulated plans order the other way. ``bucket_parts``: a group's step may
    run in up to this many parts, each padded to its own bucket (docs/design/bucket-parts.md).
    ``local_search``: the fastest candidate also with documents moved between its groups by the
    exact group model (:func:`~jvarlen.plan.sp_refine.refine_groups`, cut as :func:`realise` cuts),
    kept as one more candidate (``bucket_ratio``: ``"refined"``) where that is faster.
    """

    intra: bool = True
    g_min: int = 1
    g_max: Optional[int] = 32
    bucket_ratios: tuple[float, ...] = (2.0, 4.0, 16.0, math.inf)
    scheme_buckets: bool = True
    max_batch_docs: int = 512
    max_sp: Optional[int] = None
    micro_batch_tokens: Optional[int] = None
    simulation: str = "paired"
    homogeneous_top: int = 2
    bucket_parts: int = 2
    local_search: bool = True

    def __post_init__(self):
        if self.simulation not in SIMULATIONS:
            raise ValueError(f"DCPOptions.simulation must be one of {SIMULATIONS}, got {self.simulation!r}")
        if self.g_min < 1 or (self.g_max is not None and self.g_max < self.g_min):
            raise ValueError(f"DCPOptions: need 1 <= g_min <= g_max, got {self.g_min}, {self.g_max}")
        if not self.bucket_ratios or any(r <= 1 for r in self.bucket_ratios):
            raise ValueError(f"DCPOptions.bucket_ratios must be > 1, got {self.bucket_ratios}")
        if self.max_batch_docs < 1:
            raise ValueError("DCPOptions.max_batch_docs must be >= 1")
        if self.homogeneous_top < 0:
            raise ValueError(f"DCPOptions.homogeneous_top must be >= 0, got {self.homogeneous_top}")


# --------------------------------------------------------------------------- (b, p, r) per bucket


def best_setting(gc: GroupCosts, scheme: Scheme, seq_len: int, n: int, options: DCPOptions) -> Optional[Setting]:
    """Throughput-optimal (b, r) on ``scheme`` for ``n`` documents of up to ``seq_len`` tokens."""
    cost = gc.costs.cost(scheme)
    capacity = cost.memory_budget
    if gc.micro_batch_tokens is not None:
        n = min(n, max(1, gc.micro_batch_tokens // seq_len))
    cands = {}
    for b in batch_grid(n, options.max_batch_docs):
        if b * seq_len > gc.cap_full(scheme):
            break
        cands[b, scheme.sp] = profile_entry(gc, scheme, seq_len, b)
    if options.intra:
        found = alg1(capacity, gc.layers, cands, seq_len)
        if found is None:
            return None
        exact = gc.least_recompute(scheme, found.b * seq_len)  # Eq. 6 is linear; the model may not be
        return dataclasses.replace(found, r=max(found.r, exact if exact is not None else gc.layers))
    best = None
    for (b, p), e in cands.items():
        thr = b * seq_len / (p * e.T)
        if best is None or thr > best.throughput * (1 + 1e-12):
            best = Setting(b, p, gc.layers, e.T, thr)
    return best


# --------------------------------------------------------------------------- g search (Eq. 3)


@dataclasses.dataclass
class _Option:
    """Bucket k on n groups of scheme p: group documents, group times (additive model)."""

    scheme: Scheme
    setting: Setting
    budget: int  # tokens per micro-batch (:func:`_micro_batch_cap`)
    groups: list[list[int]]
    times: list[float]

    @property
    def devices(self) -> int:
        return self.scheme.sp * len(self.groups)

    @property
    def span(self) -> float:
        return max(self.times)


def buckets_of(lengths: Sequence[int], ratio: float) -> list[list[int]]:
    """Documents (longest first) in length classes ``[ratio^k, ratio^(k+1))``, longest class first."""
    order = sorted_order(lengths)
    if math.isinf(ratio):
        return [order]
    out: dict[int, list[int]] = {}
    for i in order:
        out.setdefault(int(math.floor(math.log(lengths[i]) / math.log(ratio) + 1e-12)), []).append(i)
    return [out[k] for k in sorted(out, reverse=True)]


def buckets_by_scheme(lengths: Sequence[int], gc: GroupCosts, options: DCPOptions) -> list[list[int]]:
    """Documents (longest first) bucketed by the SP degree of highest throughput for one document of
    their length alone (Eq. 1 at b = 1, with the least recomputation that fits for DCP-intra, all
    layers for DCP-inter): batches that prefer the same p share groups. Longest bucket first."""
    out: dict[int, list[int]] = {}
    for i in sorted_order(lengths):
        best = None
        for scheme in gc.schemes:
            r = gc.least_recompute(scheme, lengths[i])
            if r is None:
                continue
            r = r if options.intra else gc.layers
            busy = scheme.sp * (gc.doc_time(lengths[i], scheme) + gc.recompute_time(lengths[i], scheme, r))
            if best is None or busy < best[0] * (1 - 1e-12):
                best = (busy, scheme.sp)
        out.setdefault(best[1], []).append(i)
    return [out[p] for p in sorted(out, reverse=True)]


def _micro_batch_cap(gc: GroupCosts, scheme: Scheme, setting: Setting, s_max: int, intra: bool) -> int:
    """Tokens per micro-batch of a bucket on ``scheme``: ``b·s`` of its (b, r) at its longest length;
    DCP-intra never packs beyond what fits without recomputation (Alg. 1 at a shorter batch's own
    length would not either: recomputation costs more than a micro-batch's constant), a longer
    document runs alone with its least recomputation."""
    budget = setting.b * s_max
    return min(budget, gc.cap_none(scheme)) if intra else budget


def bucket_options(
    lengths: Sequence[int], docs: list[int], gc: GroupCosts, options: DCPOptions, g_max: Optional[int]
) -> list[_Option]:
    """Every (p, n) of one bucket worth considering: for each scheme that holds its longest document
    the throughput-optimal (b, r) at that length (:func:`best_setting`, its micro-batch cap
    :func:`_micro_batch_cap`), then n = 1, 2, ... groups (LPT of the documents by their time),
    while more groups still shorten the slowest group and n·p fits the devices. Times use the
    additive model of :class:`~jvarlen.plan.work_table.WorkTable` (per document, per micro-batch,
    per group)."""
    s_max = max(lengths[d] for d in docs)
    out = []
    for scheme in gc.schemes:
        setting = best_setting(gc, scheme, s_max, len(docs), options)
        if setting is None:
            continue
        cap = _micro_batch_cap(gc, scheme, setting, s_max, options.intra)
        r_shared = 0 if options.intra else gc.layers  # layers a shared micro-batch recomputes
        c = gc.mb_const(scheme) + r_shared * gc.rec_const(scheme)
        base = gc.base(scheme)
        work, alone = {}, {}
        for d in docs:
            n = lengths[d]
            alone[d] = n > cap
            if alone[d]:  # its own micro-batch, least recomputation
                work[d] = gc.doc_time(n, scheme) + gc.recompute_time(n, scheme, gc.least_recompute(scheme, n))
            else:
                work[d] = gc.doc_time(n, scheme) - gc.mb_const(scheme) + gc.recompute_time(n, scheme, r_shared)
                work[d] -= r_shared * gc.rec_const(scheme)
        order = sorted(docs, key=lambda d: (-work[d], d))
        floor = max(work.values()) + base
        shared_total = sum(lengths[d] for d in docs if not alone[d])
        n_lo = 1 if g_max is None else max(1, -(-shared_total // (g_max * cap)))
        prev = math.inf
        for n in range(n_lo, min(len(docs), gc.num_devices // scheme.sp) + 1):
            heap = [(0.0, g) for g in range(n)]
            groups: list[list[int]] = [[] for _ in range(n)]
            for d in order:
                load, g = heap[0]
                heapq.heapreplace(heap, (load + work[d], g))
                groups[g].append(d)
            times, steps = [], []
            for grp in groups:
                shared = -(-sum(lengths[d] for d in grp if not alone[d]) // cap)
                g = max(shared + sum(alone[d] for d in grp), min(options.g_min, len(grp)))
                steps.append(g)
                times.append(base + sum(work[d] for d in grp) + c * (g - sum(alone[d] for d in grp)))
            if g_max is not None and max(steps) > g_max:
                continue
            opt = _Option(scheme, setting, cap, groups, times)
            if opt.span < prev - 1e-12:
                out.append(opt)
                prev = opt.span
            if opt.span <= floor * (1 + 1e-9):
                break
    return out


def search(per_bucket: list[list[_Option]], num_devices: int) -> Optional[list[_Option]]:
    """The least time target τ for which every bucket has an option within τ and the cheapest such
    options (fewest devices) fit ``num_devices``; then idle devices go to the slowest buckets'
    next option while it is as fast and fits. None when no τ fits."""
    if any(not opts for opts in per_bucket):
        return None
    values = sorted({o.span for opts in per_bucket for o in opts})

    def pick(tau):
        chosen = []
        for opts in per_bucket:
            ok = [o for o in opts if o.span <= tau]
            if not ok:
                return None
            chosen.append(min(ok, key=lambda o: (o.devices, o.span)))
        return chosen if sum(o.devices for o in chosen) <= num_devices else None

    lo, hi = 0, len(values) - 1
    if pick(values[hi]) is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if pick(values[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    chosen = pick(values[lo])
    while True:  # fill idle devices (Eq. 3): the slowest bucket first, never slower
        idle = num_devices - sum(o.devices for o in chosen)
        moved = False
        for k in sorted(range(len(chosen)), key=lambda k: -chosen[k].span):
            more = [
                o
                for o in per_bucket[k]
                if o.scheme == chosen[k].scheme
                and len(o.groups) > len(chosen[k].groups)
                and o.devices - chosen[k].devices <= idle
                and o.span <= chosen[k].span
            ]
            if more:
                chosen[k] = min(more, key=lambda o: (o.span, o.devices))
                moved = True
                break
        if not moved:
            return chosen


def choose(
    policy: str,
    lengths: Sequence[int],
    buckets: list[list[int]],
    gc: GroupCosts,
    options: DCPOptions,
    label: object,
    events: list[str],
) -> Optional[list[_Option]]:
    """:func:`search` over the buckets' options, ``G_max`` lifted (with an event) where the devices
    cannot otherwise hold the iteration; None (with an event) where they cannot at all."""
    chosen = search([bucket_options(lengths, b, gc, options, options.g_max) for b in buckets], gc.num_devices)
    if chosen is None and options.g_max is not None:
        chosen = search([bucket_options(lengths, b, gc, options, None) for b in buckets], gc.num_devices)
        if chosen is not None:
            events.append(f"{policy}: bucket ratio {label}: G_max={options.g_max} lifted (too few devices otherwise)")
    if chosen is None:
        events.append(f"{policy}: bucket ratio {label}: {len(buckets)} buckets need more than {gc.num_devices} devices")
    return chosen


def one_degree_finalists(lengths: Sequence[int], docs: list[int], gc: GroupCosts, options: DCPOptions) -> list[_Option]:
    """The ``options.homogeneous_top`` SP degrees whose fastest option for the bucket ``docs``
    (:func:`bucket_options`, ``G_max`` lifted where no option keeps it) the group model finds
    fastest, fastest first (ties: the smaller degree)."""
    per_scheme = bucket_options(lengths, docs, gc, options, options.g_max) or bucket_options(
        lengths, docs, gc, options, None
    )
    best: dict[int, _Option] = {}
    for o in per_scheme:
        if o.scheme.sp not in best or o.span < best[o.scheme.sp].span:
            best[o.scheme.sp] = o
    return sorted(best.values(), key=lambda o: (o.span, o.scheme.sp))[: options.homogeneous_top]


def realise(lengths: Sequence[int], gc: GroupCosts, chosen: list[_Option], options: DCPOptions) -> list[GroupChoice]:
    """Each group's documents, length-sorted, cut by Eq. 23-24 into its g micro-batches; each
    micro-batch recomputes the least layers that fit (DCP-intra) or all of them (DCP-inter).
    DCP-intra's groups are cut at their executor bucket instead where the group model finds that
    faster (:meth:`GroupCosts.fastest_cut`); DCP-inter's as a fully recomputed ``flex_group`` where
    that is faster (e.g. one micro-batch where b = 1 gave two, each padded to the group's bucket)."""
    out = []
    for opt in chosen:
        for grp in opt.groups:
            local = [lengths[d] for d in grp]
            mbs = chunk_group(local, opt.budget, options.g_min)
            if options.intra:
                out.append(gc.fastest_cut(lengths, opt.scheme, grp, mbs, options.g_min, options.g_max))
                continue
            too_long = [n for n in (sum(local[i] for i in mb) for mb in mbs) if n > gc.cap_full(opt.scheme)]
            if too_long:
                raise ValueError(f"dcp: a micro-batch of {too_long[0]} tokens does not fit {opt.scheme}")
            own = GroupChoice(opt.scheme, tuple(grp), tuple(tuple(mb) for mb in mbs), (gc.layers,) * len(mbs))
            flex = gc.flex_group(lengths, opt.scheme, grp, full_recompute=True)
            out.append(min((own, flex), key=lambda c: gc.group_time(lengths, c)))
    return out


def refined(
    lengths: Sequence[int], gc: GroupCosts, choices: list[GroupChoice], options: DCPOptions
) -> list[GroupChoice]:
    """``choices`` with documents moved between groups by the exact group model
    (:func:`~jvarlen.plan.sp_refine.refine_groups`), each changed group cut as :func:`realise` cuts a
    group (DCP-intra: micro-batches that fit without recomputation, or a faster cut within
    ``[G_min, G_max]``; DCP-inter: every layer recomputed, micro-batches as large as that allows).

    Not in DCP: its groups follow its length buckets and an additive model that cannot see which
    bucket a group's micro-batches pad to; on small CPU batches that put its plan up to 19.8 % behind
    the best assignment (docs/design/heterogeneous.md, "Refining the assignment")."""

    def intra(lengths, scheme, docs):
        local = [lengths[d] for d in docs]
        mbs = chunk_group(local, gc.cap_none(scheme), options.g_min)
        return gc.fastest_cut(lengths, scheme, docs, mbs, options.g_min, options.g_max)

    if options.intra:
        return refine_groups(lengths, gc, choices, regroup=intra)
    return refine_groups(lengths, gc, choices, full_recompute=True)


def eq3(times: Sequence[float], sizes: Sequence[int], num_devices: int) -> tuple[float, float]:
    """Eq. 3 for groups of ``sizes`` devices whose accumulated times ``g_i·T(d_i)`` are ``times``:
    ``Σ_i (max_j g_j·T_j - g_i·T_i) / W`` (seconds), and the imbalance ratio of §4.2: the mean
    fraction of the iteration a device is idle (devices in no group idle throughout)."""
    top = max(times)
    busy = sum(p * t for p, t in zip(sizes, times))
    return sum(top - t for t in times) / num_devices, 1.0 - busy / (num_devices * top)


# --------------------------------------------------------------------------- policies


def _plan(policy: str, lengths: Sequence[int], costs: SchemeCosts, options: DCPOptions) -> StrategyPlan:
    t0 = time.perf_counter()
    lengths = document_lengths(lengths)
    gc = group_costs_for(costs, options)
    bad = infeasible_documents(lengths, gc)
    if bad:
        raise PlanningError(too_long_message(policy, lengths, gc, bad))
    events: list[str] = []
    candidates, options_of = [], []
    bucketings = [(ratio, buckets_of(lengths, ratio)) for ratio in options.bucket_ratios]
    if options.scheme_buckets:
        bucketings.append(("by-p", buckets_by_scheme(lengths, gc, options)))
    picked = []  # (label, buckets, the option chosen for each)
    for ratio, buckets in bucketings:
        chosen = choose(policy, lengths, buckets, gc, options, ratio, events)
        if chosen is not None:
            picked.append((ratio, buckets, chosen))
    if options.homogeneous_top:
        one = buckets_of(lengths, math.inf)[0]
        for o in one_degree_finalists(lengths, one, gc, options):
            picked.append((f"inf, p={o.scheme.sp}", [one], [o]))
    for ratio, buckets, chosen in picked:
        choices = realise(lengths, gc, chosen, options)
        record = candidate_record(
            lengths,
            gc,
            choices,
            bucket_ratio=ratio,
            buckets=[
                {
                    "docs": len(b),
                    "max_len": max(lengths[d] for d in b),
                    "p": o.scheme.sp,
                    "b": o.setting.b,
                    "r": o.setting.r,
                    "groups": len(o.groups),
                }
                for b, o in zip(buckets, chosen)
            ],
        )
        candidates.append(record)
        options_of.append((choices, record))
    if options.local_search and candidates:
        first = min(range(len(candidates)), key=lambda i: (candidates[i]["iteration_time_s"], i))
        moved = refined(lengths, gc, options_of[first][0], options)
        if gc.strategy_time(lengths, moved) < candidates[first]["iteration_time_s"]:
            record = candidate_record(
                lengths, gc, moved, bucket_ratio="refined", refined_from=candidates[first]["bucket_ratio"], buckets=[]
            )
            candidates.append(record)
            options_of.append((moved, record))
    if not candidates:
        raise PlanningError(f"{policy}: no bucketing of this batch fits {gc.num_devices} devices ({'; '.join(events)})")
    best, plan = assemble_fastest(policy, lengths, gc, options_of, options.simulation, t0, {"candidates": candidates})
    choices, record = options_of[best]
    idle = gc.num_devices - sum(c.scheme.sp for c in choices)
    if idle:
        events.append(f"{policy}: {idle} device(s) idle: no further group makes any bucket's slowest group faster")
    eq3_s, idle_ratio = eq3(
        [gc.group_time(lengths, c) for c in choices], [c.scheme.sp for c in choices], gc.num_devices
    )
    plan.stats.update(
        bucket_ratio=record["bucket_ratio"],
        buckets=record["buckets"],
        accumulation=[len(c.micro_batches) for c in choices],
        eq3_s=eq3_s,
        imbalance_ratio=idle_ratio,
    )
    plan.events[:0] = events
    return plan


@register_policy("dcp", DCPOptions)
def plan(lengths: Sequence[int], costs: SchemeCosts, options: Optional[DCPOptions] = None) -> StrategyPlan:
    """DCP-intra: per-bucket (b, p, r) by Alg. 1, accumulation by Eq. 3 (module docstring)."""
    return _plan("dcp", lengths, costs, options or DCPOptions())


@dataclasses.dataclass(frozen=True)
class DCPInterOptions(DCPOptions):
    """DCP-inter: as :class:`DCPOptions` with every layer recomputed (no recomputation choice)."""

    intra: bool = False


@register_policy("dcp-inter", DCPInterOptions)
def plan_inter(lengths: Sequence[int], costs: SchemeCosts, options: Optional[DCPOptions] = None) -> StrategyPlan:
    """DCP-inter (the ablation without DCP-intra's recomputation choice)."""
    return _plan("dcp-inter", lengths, costs, options or DCPInterOptions())


__all__ = [
    "DCPInterOptions",
    "DCPOptions",
    "ProfileEntry",
    "Setting",
    "alg1",
    "choose",
    "eq3",
    "one_degree_finalists",
    "plan",
    "plan_inter",
    "search",
]
