"""Hydraulis step 4 (§4): a candidate strategy (:class:`Evaluation`, as steps 2-3 dispatched and
packed it) planned, one group per pipeline that received documents, and whether a packed
candidate can still beat the plans built so far.

A pipeline's group is its packed micro-batches as one 1F1B unit (``build_group_plan``), each
recomputing what its tokens need, and also cut at the executor's bucket where that is faster: a
``pp = 1`` pipeline as the SP-group policies' groups are
(:meth:`~jvarlen.plan.sp_groups.GroupCosts.fastest_cut`), a deeper one by
:func:`~jvarlen.plan.pipeline_cut.bucket_cut`. :func:`exceeds` bounds the deeper ones before any
plan is built (:func:`~jvarlen.plan.pipeline_cut.cut_exceeds`), and :func:`build_plan` plans the
slowest pipelines first and gives up on a group slower than a given plan, so that
:func:`~jvarlen.plan.hydraulis.two_stage_plan` skips a candidate that cannot win.

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from jvarlen.plan.hydraulis_costs import SchemeTable
from jvarlen.plan.hydraulis_options import AssignmentOptions
from jvarlen.plan.hydraulis_pack import PackResult
from jvarlen.plan.pipeline_cut import bucket_cut, cut_exceeds
from jvarlen.plan.plan import Plan
from jvarlen.plan.sp_groups import GroupCosts
from jvarlen.plan.strategy import (
    GroupPlan,
    Scheme,
    SchemeCosts,
    StrategyPlan,
    build_group_plan,
    place_groups,
    predicted_time,
)


@dataclasses.dataclass
class Evaluation:
    """One candidate through the two-stage assignment."""

    strategy: tuple[Scheme, ...]
    tables: list[SchemeTable]
    assign: np.ndarray  # [B] pipeline of each document
    dispatch_s: float  # largest packing bound of the dispatched documents + update + transition
    packs: Optional[list[PackResult]] = None
    packed_s: Optional[float] = None  # largest Eq. 1 objective + update + transition

    @property
    def estimate_s(self) -> float:
        return self.packed_s if self.packed_s is not None else self.dispatch_s

    def documents(self, j: int) -> np.ndarray:
        return np.flatnonzero(self.assign == j)


def build_plan(
    policy: str,
    lengths: np.ndarray,
    chosen: Evaluation,
    costs: SchemeCosts,
    options: AssignmentOptions,
    above: Optional[float] = None,
) -> Optional[StrategyPlan]:
    """Step 4: one group per pipeline that received documents (build_group_plan, simulated). The
    slowest packed pipelines are planned first, and with ``above`` (a fitting plan's seconds) the
    candidate is given up (None) as soon as one group simulates slower: it cannot win."""
    group_costs = GroupCosts(costs) if options.recompute == "auto" and options.simulation == "paired" else None
    built = {}
    for j in sorted(range(len(chosen.strategy)), key=lambda j: (-chosen.packs[j].objective_s, j)):
        if chosen.packs[j].V == 0:
            continue
        built[j] = plan = _group_plan(policy, chosen, j, lengths, costs, options, group_costs)
        if above is not None and plan.stats["iteration_time_s"] > above:
            return None
    devices = place_groups(chosen.strategy, costs.num_devices)
    groups, events = [], []
    solves, sources = 0, {}
    for j, (scheme, packed) in enumerate(zip(chosen.strategy, chosen.packs)):
        solves += packed.solves
        sources[packed.source] = sources.get(packed.source, 0) + 1
        events.extend(packed.events)
        if j not in built:
            events.append(f"{policy}: pipeline {j} {scheme} got no documents; its devices idle")
            continue
        groups.append(GroupPlan(scheme, devices[j], tuple(int(d) for d in chosen.documents(j)), built[j]))
        events.extend(built[j].events)
    sp = StrategyPlan(policy, costs.num_devices, tuple(int(x) for x in lengths), tuple(groups), events=events)
    sp.stats.update(
        policy=policy,
        strategy=sp.describe(),
        iteration_time_s=predicted_time(groups, costs),
        estimated_time_s=chosen.estimate_s,
        micro_batches=[g.plan.n_chunks for g in groups],
        pack_ilp_solves=solves,
        pack_sources=sources,
        trials=options.trials,
    )
    sp.stats.update(sp.group_summary())
    return sp


def _group_plan(policy, chosen: Evaluation, j: int, lengths, costs, options, group_costs) -> Plan:
    """Pipeline ``j``'s group plan: its packing, cut at the executor's bucket where faster (the
    executor runs a group's micro-batches over one bucket; fixed-length packing, the baselines'
    practice, stays as it is)."""
    scheme, table, packed = chosen.strategy[j], chosen.tables[j], chosen.packs[j]
    local, micro_batches, ckpt = packing_cut(chosen, j, lengths, options)
    if scheme.pp == 1 and group_costs is not None and packed.source != "fixed":
        cut = group_costs.fastest_cut(local.tolist(), scheme, range(len(local)), micro_batches, ckpt=ckpt)
        micro_batches, ckpt = [list(mb) for mb in cut.micro_batches], list(cut.ckpt)
        plan = build_group_plan(
            policy, scheme, local.tolist(), micro_batches, costs, ckpt, options.simulation, parts=cut.parts
        )
    elif group_costs is not None and packed.source != "fixed":
        plan = bucket_cut(
            policy, local.tolist(), micro_batches, ckpt, table, costs, options.simulation, prune=options.prune
        )
    else:
        plan = build_group_plan(policy, scheme, local.tolist(), micro_batches, costs, ckpt, options.simulation)
    plan.stats.update(pack_objective_s=packed.objective_s, pack_source=packed.source)
    return plan


def packing_cut(ev: Evaluation, j: int, lengths: np.ndarray, options) -> tuple[np.ndarray, tuple, list[int]]:
    """Pipeline ``j``'s document lengths, its packing's micro-batches and their recomputation."""
    local, micro_batches = lengths[ev.documents(j)], ev.packs[j].micro_batches
    tokens = [int(local[list(mb)].sum()) for mb in micro_batches]
    auto = options.recompute == "auto"
    return local, micro_batches, [int(r) for r in ev.tables[j].recompute_layers(tokens)] if auto else [0] * len(tokens)


def exceeds(ev: Evaluation, seconds: float, lengths: np.ndarray, costs: SchemeCosts, options) -> bool:
    """Whether a packed candidate's plan is shown to simulate above ``seconds`` before it is built: one
    of its ``pp > 1`` pipelines, which :func:`build_plan` cuts at their bucket, exceeds it by
    ``pipeline_cut.cut_exceeds`` (the slowest packed pipelines tried first; the strategy's time is
    its slowest group's and more, ``predicted_time``)."""
    if options.recompute != "auto" or options.simulation != "paired":
        return False
    pipes = [j for j, (s, p) in enumerate(zip(ev.strategy, ev.packs)) if s.pp > 1 and p.V > 0 and p.source != "fixed"]
    for j in sorted(pipes, key=lambda j: -ev.packs[j].objective_s):
        local, micro_batches, ckpt = packing_cut(ev, j, lengths, options)
        if cut_exceeds(seconds, local.tolist(), micro_batches, ckpt, ev.tables[j], costs, options.simulation):
            return True
    return False


__all__ = ["Evaluation", "build_plan", "exceeds", "packing_cut"]
