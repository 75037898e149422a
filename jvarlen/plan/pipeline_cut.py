"""A pipeline group's micro-batches cut at the executor's bucket (Hydraulis' ``pp > 1`` groups).

Hydraulis packs a pipeline's documents (Eq. 1, :mod:`jvarlen.plan.hydraulis_pack`) up to the
capacity without recomputation, ``caps[0]``, and prices each micro-batch by its own tokens. The
paired executor pads every micro-batch of a group's step to one bucket, the one its largest
micro-batch needs, and recomputes what the executor's buffers need at that bucket. One long
document then sets both for every short one: a 32B (pp = 4, sp = 4) pipeline of 35 documents (67K
tokens, the longest 14,513) packed as 8 micro-batches of up to 8,753 tokens ran each over the
long one's 16K bucket, simulated 2.5× its packing objective.

:func:`bucket_cut` also packs the documents first-fit decreasing into bins of each executor
bucket from the longest document's up to ``MaxLen`` (the short documents filled up to the bucket
they pay for, or a smaller bucket that pays for more micro-batches), ranks those cuts and the
packing's own by :func:`padded_time` (the simulator's paired ticks over the padded cost, with the
recomputation raised uniformly to what the executor's buffers need: cheaper than building and
fitting a plan, and above the fitted plan where the fit raises less), builds the ``top`` ranked
first and the packing's cut but those whose lower bound (:func:`time_bound`) a plan built beats,
and keeps the fastest plan that fits. The one-stage groups do the same through
:meth:`~jvarlen.plan.sp_groups.GroupCosts.fastest_cut`, whose closed-form group time is exact for
``pp = 1``.

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jvarlen.plan.chunk import bucket_bins, executor_bucket
from jvarlen.plan.chunking import packed_group
from jvarlen.plan.executor_caps import executor_recompute
from jvarlen.plan.hydraulis_costs import SchemeTable
from jvarlen.plan.plan import Plan
from jvarlen.plan.simulator import lower_bound, simulate
from jvarlen.plan.strategy import SchemeCosts, build_group_plan
from jvarlen.plan.units import PlannedChunk, unit_schedule


def bin_caps(longest: int, table: SchemeTable) -> list[int]:
    """Bin sizes (tokens) worth packing a pipeline group into whose longest document holds
    ``longest`` tokens: every executor bucket from that document's up to ``MaxLen``, then ``MaxLen``
    itself (the most a micro-batch may hold; its bucket fits by construction), smallest first."""
    return bucket_bins(longest, int(table.max_len), table.scheme.sp)


def executor_cut(
    lengths: Sequence[int], micro_batches: Sequence[Sequence[int]], table: SchemeTable, costs: SchemeCosts
):
    """``(bucket, ckpt)`` of a group step of ``micro_batches`` as the paired executor runs it: the
    bucket of the largest, and each micro-batch's recomputation (what its tokens need, raised to
    what the executor's buffers need at that bucket, :func:`executor_recompute`)."""
    tokens = [sum(int(lengths[i]) for i in mb) for mb in micro_batches]
    bucket = executor_bucket(max(tokens), table.scheme.sp)
    need = [int(r) for r in table.recompute_layers(tokens)]
    return bucket, executor_recompute(costs, table.scheme, bucket, need, len(table.caps) - 1)


def padded_time(
    lengths: Sequence[int], micro_batches: Sequence[Sequence[int]], table: SchemeTable, costs: SchemeCosts
) -> float:
    """A pipeline's seconds for ``micro_batches`` (indices into ``lengths``, one 1F1B unit) as the
    paired executor runs them (:func:`executor_cut`): the simulator's paired ticks over the padded
    cost, without building the plan or fitting its buffers (what :func:`bucket_cut` ranks by)."""
    bucket, ckpt = executor_cut(lengths, micro_batches, table, costs)
    return _simulated(lengths, micro_batches, ckpt, table.scheme, costs.padded_cost(table.scheme, bucket), "paired")


def time_bound(
    lengths: Sequence[int],
    micro_batches: Sequence[Sequence[int]],
    need: Sequence[int],
    table: SchemeTable,
    costs: SchemeCosts,
    simulation: str = "paired",
) -> float:
    """A lower bound on the simulated seconds of ``build_group_plan(..., micro_batches, costs, need,
    simulation)``, whatever order it runs them in and however its memory fit raises their
    recomputation above ``need`` (:func:`jvarlen.plan.simulator.lower_bound`: each stage's ops one
    after another, the fill before the last stage's first and the drain after it, the ticks'
    overheads). :func:`bucket_cut` skips building a cut whose bound is above a plan it has.

    Not the cut's simulated time with ``need``: raising a chunk's recomputation on the last stage
    ends its fused forward and backward there, which can make the plan faster (five micro-batches
    of a (pp = 4, sp = 1) pipeline on the test profile: 0.1018 s fitted, 0.1046 s unraised;
    ``tests/test_pipeline_cut.py``)."""
    scheme = table.scheme
    shapes = _shapes(lengths, micro_batches)
    if simulation == "paired":
        cost = costs.padded_cost(scheme, executor_bucket(max(s.tokens for s in shapes), scheme.sp))
    else:
        cost = costs.cost(scheme)
    rows = np.repeat(np.asarray([int(r) for r in need], np.int64)[:, None], scheme.pp, axis=1)
    return lower_bound(shapes, cost, simulation, rows)


def _simulated(lengths, micro_batches, ckpt, scheme, cost, mode: str) -> float:
    """Simulated seconds of ``micro_batches`` as one 1F1B unit, micro-batch ``k`` recomputing
    ``ckpt[k]`` layers on every stage."""
    shapes = _shapes(lengths, micro_batches)
    ids, schedule = unit_schedule([[k] for k in range(len(shapes))], scheme.pp)
    rows = np.repeat(np.asarray([ckpt[k] for k in ids], np.int64)[:, None], scheme.pp, axis=1)
    ordered = [shapes[k] for k in ids]
    return simulate(schedule, ordered, rows, cost, mode, validate=False, timeline=False, memory=False).iteration_time


def bucket_cut(
    policy: str,
    lengths: Sequence[int],
    micro_batches: Sequence[Sequence[int]],
    ckpt: Sequence[int],
    table: SchemeTable,
    costs: SchemeCosts,
    simulation: str = "paired",
    top: int = 3,
    prune: bool = True,
) -> Plan:
    """The group plan of ``lengths`` on ``table.scheme``: ``micro_batches`` recomputing ``ckpt`` (the
    packing's cut) or a first-fit-decreasing packing into one of :func:`bin_caps`, each micro-batch
    recomputing what its tokens need (the plan's fit raises what the executor's buffers need). The
    ``top`` cuts :func:`padded_time` ranks first and the packing's cut are candidates, and the
    fastest plan that fits memory where one does is kept (ties: the packing's cut, then the
    smaller bin), so the result is never slower than the packing's cut. They are built in ranked
    order, each but where its :func:`time_bound` shows it cannot beat a fitting plan already built
    (the same plan as building every candidate, ``prune=False``, with 29 % fewer builds on the 13B
    and 32B strategies-benchmark settings). ``stats["bucket_cut"]``: the chosen bin size (0: the
    packing's cut); ``stats["bucket_cut_built"]``: the plans built."""
    lengths = [int(x) for x in lengths]
    cuts = candidate_cuts(lengths, micro_batches, ckpt, table)
    ranked = sorted(cuts, key=lambda c: (padded_time(lengths, c[1], table, costs), c[0]))
    chosen = ranked[: max(0, int(top))]
    if all(cap != 0 for cap, _, _ in chosen):  # the packing's cut is always a candidate: never slower than it
        chosen.append(next(c for c in ranked if c[0] == 0))
    best = None  # (key, bin size, plan): the fastest plan built, fitting memory first
    built = 0
    for cap, cut, need in chosen:
        if prune and best is not None and best[0][0] is False:  # a fitting plan: skip cuts that cannot beat it
            if (time_bound(lengths, cut, need, table, costs, simulation), cap) > best[0][1:]:
                continue
        plan = build_group_plan(policy, table.scheme, lengths, cut, costs, need, simulation)
        built += 1
        key = (not plan.stats.get("fits_memory", True), plan.stats["iteration_time_s"], cap)
        if best is None or key < best[0]:
            best = (key, cap, plan)
    _, cap, plan = best
    plan.stats["bucket_cut_built"] = built
    plan.stats["bucket_cut"] = cap
    return plan


def candidate_cuts(
    lengths: Sequence[int], micro_batches: Sequence[Sequence[int]], ckpt: Sequence[int], table: SchemeTable
) -> list[tuple[int, list[list[int]], list[int]]]:
    """:func:`bucket_cut`'s cuts, ``(bin size, micro-batches, recomputation)``: the packing's own
    (bin size 0, recomputing ``ckpt``), then first-fit decreasing into each of :func:`bin_caps`
    (recomputing what each micro-batch's tokens need), each partition once."""
    lengths = [int(x) for x in lengths]
    given = [[int(i) for i in mb] for mb in micro_batches]
    cuts = {_partition(given): (0, given, [int(r) for r in ckpt])}
    for cap in bin_caps(max(lengths), table):
        cut = packed_group(lengths, cap)
        key = _partition(cut)
        if key not in cuts:
            need = [int(r) for r in table.recompute_layers([sum(lengths[i] for i in mb) for mb in cut])]
            cuts[key] = (cap, cut, need)
        if len(cut) == 1:  # larger bins hold the same single micro-batch
            break
    return list(cuts.values())


def cut_exceeds(
    seconds: float,
    lengths: Sequence[int],
    micro_batches: Sequence[Sequence[int]],
    ckpt: Sequence[int],
    table: SchemeTable,
    costs: SchemeCosts,
    simulation: str = "paired",
) -> bool:
    """Whether :func:`bucket_cut`'s plan for the same arguments simulates to more than ``seconds``,
    shown without building it: every candidate cut's :func:`time_bound` is above (it builds one of
    them; the first cut at or below ends the check). Hydraulis skips building a candidate strategy
    one of whose pipelines exceeds a plan it has."""
    lengths = [int(x) for x in lengths]
    return all(
        time_bound(lengths, cut, need, table, costs, simulation) > seconds
        for _, cut, need in candidate_cuts(lengths, micro_batches, ckpt, table)
    )


def _shapes(lengths, micro_batches) -> list:
    """Each micro-batch's chunk shape: its documents packed whole, in order."""
    return [PlannedChunk(tuple((int(d), 0, int(lengths[d])) for d in mb)).shape(lengths) for mb in micro_batches]


def _partition(micro_batches) -> tuple:
    """``micro_batches`` as a set partition (order-free), so that equal cuts are built once."""
    return tuple(sorted(tuple(sorted(mb)) for mb in micro_batches))


__all__ = ["bin_caps", "bucket_cut", "candidate_cuts", "cut_exceeds", "executor_cut", "padded_time", "time_bound"]
