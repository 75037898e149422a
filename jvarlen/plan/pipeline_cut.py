"""A pipeline group's micro-batches cut at the executor's bucket (Hydraulis' ``pp > 1`` groups).

Hydraulis packs a pipeline's documents (Eq. 1, :mod:`jvarlen.plan.hydraulis_pack`) up to the
capacity without recomputation, ``caps[0]``, and prices each micro-batch by its own tokens. The
paired executor pads every micro-batch of a group's step to one bucket, the one its largest
micro-batch needs, and recomputes what the executor's buffers need at that bucket
(:func:`~jvarlen.plan.executor_caps.executor_recompute`). One long document then sets both for
every short one: 30.8K tokens of 21 documents on a 32B (pp = 2, sp = 4) pipeline, the longest
7,147, packed as 21 micro-batches each padded to the 8K bucket, simulated 2.4× its packing
objective.

:func:`bucket_cut` packs the same documents first-fit decreasing into bins of each executor
bucket from the longest document's up to ``MaxLen`` (the short documents filled up to the bucket
they pay for, or a smaller bucket that pays for more micro-batches), prices every packing as the
executor runs it (:func:`padded_time`), simulates the ``top`` best and the packing's own cut, and
keeps the fastest plan that fits. The one-stage groups do the same through
:meth:`~jvarlen.plan.sp_groups.GroupCosts.fastest_cut`, whose closed-form group time is exact for
``pp = 1``; for ``pp > 1`` :func:`padded_time` is a ranking, the simulation decides.

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

from typing import Sequence

from jvarlen.plan.chunk import executor_bucket
from jvarlen.plan.chunking import packed_group
from jvarlen.plan.executor_caps import executor_recompute
from jvarlen.plan.hydraulis_costs import SchemeTable
from jvarlen.plan.plan import Plan
from jvarlen.plan.strategy import SchemeCosts, build_group_plan


def bin_caps(longest: int, table: SchemeTable) -> list[int]:
    """Bin sizes (tokens) worth packing a pipeline group into whose longest document holds
    ``longest`` tokens: every executor bucket from that document's up to ``MaxLen``, then ``MaxLen``
    itself (the most a micro-batch may hold; its bucket fits by construction), smallest first."""
    sp, top, out = table.scheme.sp, int(table.max_len), []
    bucket = executor_bucket(int(longest), sp)
    while bucket <= top:
        out.append(bucket)
        bucket = executor_bucket(bucket + 1, sp)
    if top >= longest and (not out or out[-1] < top):
        out.append(top)
    return out


def padded_time(
    lengths: Sequence[int], micro_batches: Sequence[Sequence[int]], table: SchemeTable, costs: SchemeCosts
) -> float:
    """A pipeline's seconds for ``micro_batches`` (indices into ``lengths``) as the paired executor
    runs them: each over the bucket of the largest, recomputing what its tokens need raised to what
    the executor's buffers need at that bucket; ``(pp - 1)`` slowest micro-batches of fill and drain
    plus every micro-batch once (κ = 1: a backward and a forward per stage and tick)."""
    scheme = table.scheme
    docs = [[int(lengths[i]) for i in mb] for mb in micro_batches]
    tokens = [sum(mb) for mb in docs]
    bucket = executor_bucket(max(tokens), scheme.sp)
    need = [int(r) for r in table.recompute_layers(tokens)]
    ckpt = executor_recompute(costs, scheme, bucket, need, len(table.caps) - 1)
    times = [costs.micro_batch_time(mb, scheme, r, bucket) for mb, r in zip(docs, ckpt)]
    return (scheme.pp - 1) * max(times) + sum(times)


def bucket_cut(
    policy: str,
    lengths: Sequence[int],
    micro_batches: Sequence[Sequence[int]],
    ckpt: Sequence[int],
    table: SchemeTable,
    costs: SchemeCosts,
    simulation: str = "paired",
    top: int = 3,
) -> Plan:
    """The group plan of ``lengths`` on ``table.scheme``: ``micro_batches`` recomputing ``ckpt`` (the
    packing's cut), or a first-fit-decreasing packing into one of :func:`bin_caps`, each micro-batch
    recomputing the layers its tokens need; of the packing's cut and the ``top`` packings
    :func:`padded_time` ranks first, the one whose simulated plan is fastest, fitting memory where
    one does (ties: the packing's). ``stats["bucket_cut"]``: the chosen bin size (0: the packing's)."""
    lengths = [int(x) for x in lengths]
    given = [sorted(int(i) for i in mb) for mb in micro_batches]
    seen = {tuple(map(tuple, sorted(given)))}
    ranked = []
    for cap in bin_caps(max(lengths), table):
        cut = packed_group(lengths, cap)
        key = tuple(map(tuple, sorted(sorted(mb) for mb in cut)))
        if key not in seen:
            seen.add(key)
            ranked.append((padded_time(lengths, cut, table, costs), cap, cut))
        if len(cut) == 1:  # larger bins hold the same single micro-batch
            break
    ranked.sort(key=lambda x: (x[0], x[1]))
    plans = [(0, build_group_plan(policy, table.scheme, lengths, micro_batches, costs, list(ckpt), simulation))]
    for _, cap, cut in ranked[: max(0, int(top))]:
        need = [int(r) for r in table.recompute_layers([sum(lengths[i] for i in mb) for mb in cut])]
        plans.append((cap, build_group_plan(policy, table.scheme, lengths, cut, costs, need, simulation)))
    cap, plan = min(plans, key=lambda cp: (not cp[1].stats.get("fits_memory", True), cp[1].stats["iteration_time_s"]))
    plan.stats["bucket_cut"] = cap
    return plan


__all__ = ["bin_caps", "bucket_cut", "padded_time"]
