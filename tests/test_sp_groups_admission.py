"""Admission of long documents by the SP-group policies (FlexSP, DCP, the homogeneous references)
and Hydraulis' ``pp = 1`` MaxLen: a document is admitted on a scheme only where some
recomputation lets it fit both the planner's count of its tokens (``GroupCosts.caps``) and the
executor's account of the bucket it is padded to (``GroupCosts.executor_caps``).

On the CPU profile shipped until 2026-11-30 (``conftest.FROZEN_CPU_PROFILE``) with a tight budget the bucket is what binds: sp = 4 holds 10,866
unpadded tokens by the planner's count, but 10,866 tokens pad to a 12,288-token bucket and the
executor holds at most a 9,874-token one, so the longest document whose plan fits is 8,192 tokens.
Before the fix every policy accepted 8,193-10,866 tokens and returned a plan that did not fit."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FROZEN_CPU_PROFILE, group_budget

from jvarlen.config import Config
from jvarlen.layout import Layout
from jvarlen.plan.api import PlanningError
from jvarlen.plan.chunk import executor_bucket
from jvarlen.plan.cost import CostCoefficients, CostModel, ModelShape
from jvarlen.plan.dcp import DCPOptions
from jvarlen.plan.executor_memory import executor_memory
from jvarlen.plan.flexsp import FlexSPOptions
from jvarlen.plan.homogeneous import HomogeneousOptions as SPHomogeneousOptions
from jvarlen.plan.homogeneous import plan_homogeneous
from jvarlen.plan.hydraulis import HomogeneousOptions, HydraulisOptions
from jvarlen.plan.hydraulis_costs import build_table
from jvarlen.plan.sp_assemble import fits_memory
from jvarlen.plan.sp_groups import GroupCosts
from jvarlen.plan.strategy import Scheme, SchemeCosts, build_group_plan, plan_strategy


@pytest.fixture(scope="module")
def costs() -> SchemeCosts:
    """The frozen CPU profile on 8 devices, a budget holding 1,024 tokens per device without
    recomputation."""
    shape = ModelShape.from_config(Config().model)
    coeffs = CostCoefficients.load(FROZEN_CPU_PROFILE)
    budget = group_budget(CostModel(shape, Layout(1, 1, 1), coeffs), 1024)
    return SchemeCosts(CostModel(shape, Layout(1, 1, 1), coeffs.replace(memory_budget=budget)), 8)


@pytest.fixture(scope="module")
def limit(costs) -> int:
    scheme, longest = GroupCosts(costs).longest_fitting()
    assert scheme == Scheme(1, 4)
    return longest


def test_the_limit_counts_the_executor_bucket(costs, limit):
    """The admitted maximum is the longest micro-batch whose bucket the executor holds at a
    recomputation whose time-line cap holds its tokens; on this profile below the unpadded count."""
    gc = GroupCosts(costs)
    for s in gc.schemes:
        caps, ex = gc.caps(s), gc.executor_caps(s)
        top = gc.cap_full(s)
        assert any(top <= caps[r] and executor_bucket(top, s.sp) <= ex[r] for r in range(len(caps)))
        assert not any(top + 1 <= caps[r] and executor_bucket(top + 1, s.sp) <= ex[r] for r in range(len(caps)))
        assert top < caps.max(), "the premise: on this profile the executor's bucket binds, not the token count"
    assert limit == 8192  # the audit's binary search: the largest document whose flexsp plan fits
    # where the plans are not fitted to the executor ("async"), the planner's count alone
    unpadded = GroupCosts(costs, padded=False, executor_fit=False)
    assert unpadded.longest_fitting()[1] == int(unpadded.caps(Scheme(1, 4)).max()) > limit


@pytest.mark.parametrize("policy", ["flexsp", "dcp", "homogeneous", "hydraulis"])
def test_the_limit_plans_and_fits(costs, limit, policy):
    lengths = [limit, 100]
    plan = plan_strategy(policy, lengths, costs)
    plan.validate(lengths, costs)
    assert fits_memory(plan), plan.events
    assert not any("none of" in e and "fits memory" in e for e in plan.events), plan.events


@pytest.mark.parametrize("policy", ["flexsp", "dcp"])
def test_one_token_more_is_refused_naming_the_limit(costs, limit, policy):
    with pytest.raises(PlanningError, match=f"the longest micro-batch that fits is {limit} tokens on sp=4") as e:
        plan_strategy(policy, [limit + 1, 100], costs)
    assert f"executor's {executor_bucket(limit, 4)}-token bucket" in str(e.value)


def test_hydraulis_one_stage_maxlen(costs, limit):
    """Hydraulis' ``pp = 1`` MaxLen is the same figure where its plans are fitted to the executor;
    its caps stop there and a longer document is priced inf (never dispatched to the scheme)."""
    for sp in (1, 2, 4):
        s = Scheme(1, sp)
        t = build_table(costs, s, simulation="paired")
        assert t.max_len == GroupCosts(costs).cap_full(s) == int(t.caps[-1])
        assert np.isfinite(t.doc_work(t.max_len)) and np.isinf(t.doc_work(t.max_len + 1))
        assert build_table(costs, s, simulation="ticks").max_len == t.max_len
        assert build_table(costs, s, simulation="async").max_len > t.max_len  # no executor fit there
    assert build_table(costs, Scheme(1, 4), simulation="paired").max_len == limit
    options = HydraulisOptions(max_pp=1)
    plan = plan_strategy("hydraulis", [limit, 100], costs, options)
    assert fits_memory(plan), plan.events
    with pytest.raises(PlanningError, match=rf"fits no scheme's memory; largest MaxLen: \(pp=1, sp=4\): {limit}"):
        plan_strategy("hydraulis", [limit + 1, 100], costs, options)


@pytest.mark.parametrize("scheme", [Scheme(2, 1), Scheme(2, 2), Scheme(2, 4), Scheme(4, 1), Scheme(4, 2)])
def test_hydraulis_pipeline_maxlen_counts_the_executor_buckets(costs, scheme):
    """Hydraulis' ``pp > 1`` MaxLen holds the executor's buffers of the ``pp`` micro-batches 1F1B
    keeps in flight, padded to the bucket: a layout of documents at MaxLen (one, and ``pp + 1``)
    plans and fits, one token more is refused. Before, MaxLen was the planner's unpadded count
    (e.g. 2,991 tokens on (pp=2, sp=1), whose 3,072-token bucket needs 85.2 MB of the 78.5 MB
    budget even recomputing every layer): 10 of 84 such boundary layouts planned over budget."""
    table = build_table(costs, scheme, simulation="paired")
    unpadded = build_table(costs, scheme, simulation="async").max_len
    assert table.max_len < unpadded  # the premise: on this profile the bucket binds
    assert executor_bucket(table.max_len + 1, scheme.sp) > executor_bucket(table.max_len, scheme.sp)
    options = HomogeneousOptions(scheme=scheme)
    for lengths in ([table.max_len], [table.max_len] * (scheme.pp + 1)):
        plan = plan_strategy("homogeneous", lengths, costs, options)
        plan.validate(lengths, costs)
        assert fits_memory(plan), plan.events
    with pytest.raises(PlanningError):
        plan_strategy("homogeneous", [table.max_len + 1], costs, options)
    # one token more pads to the next bucket, which the executor's account of pp such micro-batches
    # in flight cannot hold even with every layer of every stage recomputed; nor the old limit's
    cost, m = costs.cost(scheme), scheme.pp
    for n in (table.max_len + 1, unpadded):
        group = build_group_plan("t", scheme, [n] * m, [[i] for i in range(m)], costs, [cost.layers_per_stage] * m)
        assert executor_memory(group, cost).total > cost.memory_budget, n


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_every_degree_admits_exactly_what_fits(costs, sp):
    """Per SP degree (FlexSP with ``max_sp``, the static homogeneous layouts): the scheme's
    admitted maximum plans and fits, one token more is refused."""
    s = Scheme(1, sp)
    top = GroupCosts(costs, max_sp=sp).cap_full(s)
    runs = [
        lambda L: plan_strategy("flexsp", L, costs, FlexSPOptions(max_sp=sp)),
        lambda L: plan_strategy("dcp", L, costs, DCPOptions(max_sp=sp)),
        lambda L: plan_strategy("homogeneous", L, costs, HomogeneousOptions(scheme=s)),
        lambda L: plan_homogeneous(L, costs, SPHomogeneousOptions(sp=sp)),
    ]
    for run in runs:
        assert fits_memory(run([top])), sp
        with pytest.raises(PlanningError):
            run([top + 1])


def test_async_simulation_keeps_the_unpadded_count(costs):
    """``"async"`` plans are not fitted to the executor's account, so the planner's count alone
    admits (and those plans fit their time line)."""
    gc = GroupCosts(costs, padded=False, executor_fit=False)
    longest = gc.longest_fitting()[1]
    plan = plan_strategy("flexsp", [longest, 100], costs, FlexSPOptions(simulation="async"))
    assert fits_memory(plan)
    with pytest.raises(PlanningError, match=f"the longest micro-batch that fits is {longest} tokens"):
        plan_strategy("flexsp", [longest + 1, 100], costs, FlexSPOptions(simulation="async"))


def test_no_recomputation_admits_what_fits_without_it(costs):
    """With ``max_recompute=0`` the bucket must fit the executor's account without recomputation
    too: the limit plans with none, one token more is refused (before: admitted up to the planner's
    count, and the executor's fit recomputed every layer to hold the bucket)."""
    gc = GroupCosts(costs, max_recompute=0)
    scheme, top = gc.longest_fitting()
    assert top < gc.cap_none(scheme)  # the premise: the bucket binds here as well
    options = FlexSPOptions(max_recompute=0)
    plan = plan_strategy("flexsp", [top], costs, options)
    assert fits_memory(plan) and all((np.asarray(g.plan.ckpt_layers) == 0).all() for g in plan.groups)
    with pytest.raises(PlanningError, match=f"the longest micro-batch that fits is {top} tokens .* with 0 of 4 layers"):
        plan_strategy("flexsp", [top + 1], costs, options)


def test_states_over_the_budget_name_the_sharded_stage_weights():
    """Where a pp = 1 group cannot hold its model states, no micro-batch length is the problem:
    the refusal says what the states need and that sharding the stage weights over the group's
    devices (parallel.stage_weights=sharded) fits them, and with it the same batch plans."""
    shape = ModelShape.from_config(Config().model)
    coeffs = CostCoefficients.load(FROZEN_CPU_PROFILE)

    def costs(budget, sharded=False):
        cost = CostModel(shape, Layout(1, 1, 1), coeffs.replace(memory_budget=budget), stage_weights_sharded=sharded)
        return SchemeCosts(cost, 8)

    floors = [costs(1e12, sharded).cost(Scheme(1, 4)).memory_floor(0) for sharded in (False, True)]
    assert floors[1] < floors[0]
    budget = 0.98 * floors[0]  # just below the replicated states (9.36 MB), 3.4 MB above the sharded ones
    for policy in ("flexsp", "dcp"):
        with pytest.raises(PlanningError, match="no SP group holds a single token") as e:
            plan_strategy(policy, [300, 200, 100], costs(budget))
        assert "parallel.stage_weights=sharded" in str(e.value) and "which fits" in str(e.value)
        assert fits_memory(plan_strategy(policy, [300, 200, 100], costs(budget, sharded=True)))
