"""The homogeneous reference for the SP-group policies: ``N / sp`` SP groups of one size.

What FlexSP and DCP are measured against (FlexSP §5: DeepSpeed-Ulysses at one SP degree; DCP
§4.1: one parallel size for every batch): every group is ``Scheme(1, sp)`` for one ``sp``, the
documents are dispatched greedily (LPT on the additive time model of
:class:`~jvarlen.plan.work_table.WorkTable`, then the same local search FlexSP's heuristic uses,
then the moves by the exact group model that FlexSP's fastest candidate gets,
:func:`~jvarlen.plan.sp_refine.refine_groups`), and each group is cut into micro-batches by the
same Eq. 23-24 chunking with the least recomputation that fits (:meth:`GroupCosts.flex_group`).
So the reference differs from FlexSP only in the group sizes.

* :func:`plan_homogeneous` returns the :class:`StrategyPlan` for one ``sp`` (or the best ``sp`` for
  this batch when ``sp`` is None: DCP's per-step SP degree without heterogeneity);
* :func:`homogeneous_time` is the same without building executor plans (for sweeps);
* :func:`best_static_sp` picks the one ``sp`` that is fastest over a whole workload (the static
  layout a user would tune once), which is what the benchmarks compare against.

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional, Sequence

from jvarlen.plan.api import PlanningError
from jvarlen.plan.chunk import document_lengths
from jvarlen.plan.sp_assemble import assemble_strategy
from jvarlen.plan.sp_groups import GroupChoice, GroupCosts, group_costs_for, infeasible_documents
from jvarlen.plan.sp_refine import refine_groups
from jvarlen.plan.strategy import Scheme, SchemeCosts, StrategyPlan
from jvarlen.plan.work_table import WorkTable


@dataclasses.dataclass(frozen=True)
class HomogeneousOptions:
    """``sp``: the one SP degree (None: the fastest for each batch). ``full_recompute``: every layer
    recomputed, micro-batches as large as that allows (DCP's baseline, the paper protocol of
    DCP-inter); default: the least recomputation per micro-batch, as FlexSP. ``max_recompute``: the
    most layers a micro-batch may recompute (0: FlexSP's GPT-7B protocol). ``micro_batch_tokens``: cap on a
    micro-batch's tokens below what memory allows. ``simulation``: executor model of the group plans.
    ``bucket_parts``: a group's step may run in up to this many parts, each padded to its own bucket
    (docs/design/bucket-parts.md; 1: one bucket per group)."""

    sp: Optional[int] = None
    full_recompute: bool = False
    micro_batch_tokens: Optional[int] = None
    max_recompute: Optional[int] = None
    local_search: bool = True
    simulation: str = "paired"
    bucket_parts: int = 2


def homogeneous_groups(
    lengths: Sequence[int], gc: GroupCosts, sp: int, local_search: bool = True, full_recompute: bool = False
) -> Optional[list[GroupChoice]]:
    """``N // sp`` groups of ``Scheme(1, sp)`` (as many as there are documents at most) with the
    documents dispatched by LPT (+ local search on the additive model, then on the exact one:
    :func:`~jvarlen.plan.sp_refine.refine_groups`); None when a document does not fit ``sp``."""
    scheme = Scheme(1, int(sp))
    if scheme not in gc.schemes:
        raise ValueError(f"sp={sp} is not an SP scheme of this run: {[s.sp for s in gc.schemes]}")
    table = WorkTable.build(lengths, gc, [scheme])
    n = min(gc.num_devices // scheme.sp, len(lengths))
    sizes = [0] * n
    members = table.lpt(sizes)
    if members is None:
        return None
    if local_search:
        members = table.improve(sizes, members)
    groups = [gc.flex_group(lengths, scheme, [table.docs[i] for i in m], full_recompute) for m in members if m]
    return refine_groups(lengths, gc, groups, full_recompute) if local_search else groups


def homogeneous_time(
    lengths: Sequence[int], gc: GroupCosts, sp: int, local_search: bool = True, full_recompute: bool = False
) -> float:
    """Predicted iteration time of the homogeneous layout ``sp`` (``inf`` when a document does not fit)."""
    groups = homogeneous_groups(lengths, gc, sp, local_search, full_recompute)
    return math.inf if groups is None else gc.strategy_time(lengths, groups)


def best_static_sp(
    batches: Sequence[Sequence[int]], costs: SchemeCosts, options: Optional[HomogeneousOptions] = None
) -> tuple[Optional[int], dict[int, list[float]]]:
    """The one SP degree with the least total predicted time over ``batches`` (a layout fixed for
    the whole run must hold every batch), and every degree's per-batch times (``inf``: a document
    does not fit). Returns ``(None, times)`` when no degree holds every batch."""
    options = options or HomogeneousOptions()
    gc = group_costs_for(costs, options)
    times = {
        s.sp: [homogeneous_time(b, gc, s.sp, options.local_search, options.full_recompute) for b in batches]
        for s in gc.schemes
    }
    finite = {sp: sum(t) for sp, t in times.items() if all(math.isfinite(x) for x in t)}
    best = min(finite, key=lambda sp: (finite[sp], sp)) if finite else None
    return best, times


def plan_homogeneous(lengths: Sequence[int], costs: SchemeCosts, options: HomogeneousOptions) -> StrategyPlan:
    """The homogeneous layout ``options.sp`` (or the best one for this batch) as a StrategyPlan."""
    t0 = time.perf_counter()
    lengths = document_lengths(lengths)
    gc = group_costs_for(costs, options)
    degrees = [s.sp for s in gc.schemes] if options.sp is None else [int(options.sp)]
    candidates, best = [], None
    for sp in degrees:
        groups = homogeneous_groups(lengths, gc, sp, options.local_search, options.full_recompute)
        if groups is None:
            continue
        t = gc.strategy_time(lengths, groups)
        candidates.append({"strategy": f"{gc.num_devices // sp}×(pp=1, sp={sp})", "iteration_time_s": t})
        if best is None or t < best[0]:
            best = (t, sp, groups)
    if best is None:
        bad = infeasible_documents(lengths, gc) or [max(range(len(lengths)), key=lambda i: lengths[i])]
        raise PlanningError(
            f"homogeneous: no SP degree in {degrees} holds document(s) {bad[:5]} "
            f"(longest {max(lengths)} tokens; sp={degrees[-1]} holds {gc.cap_full(Scheme(1, degrees[-1]))})"
        )
    _, sp, groups = best
    events = []
    if sum(c.scheme.num_devices for c in groups) < gc.num_devices:
        events.append(f"homogeneous: {len(lengths)} documents fill only {len(groups)} groups of sp={sp}")
    return assemble_strategy(
        "homogeneous", lengths, gc, groups, options.simulation, t0, {"sp": sp, "candidates": candidates}, events
    )


__all__ = ["HomogeneousOptions", "best_static_sp", "homogeneous_groups", "homogeneous_time", "plan_homogeneous"]
