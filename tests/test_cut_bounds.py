"""The SP-group cut search's branch and bound (jvarlen/plan/sp_cuts.py): when the cost model
allows the bound (``CostModel.grows_with_padding``), and that the bounded search makes exactly the
choice of trying every cut and every part split."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import SHIPPED_CPU_PROFILE, group_budget, small_cost

from jvarlen.config import ModelConfig
from jvarlen.layout import Layout
from jvarlen.plan.chunking import chunk_group
from jvarlen.plan.cost import CostCoefficients, CostModel, ModelShape
from jvarlen.plan.sp_groups import GroupCosts
from jvarlen.plan.strategy import SchemeCosts


def analytic_costs(devices: int = 8, sharded: bool = False) -> SchemeCosts:
    cost = small_cost(pp=1, sp=1)
    cost = cost.replace(coeffs=cost.coeffs.replace(memory_budget=group_budget(cost, 6144)))
    return SchemeCosts(cost.with_stage_weights(sharded), devices)


def cpu_costs() -> SchemeCosts:
    coeffs = CostCoefficients.load(SHIPPED_CPU_PROFILE)
    assert coeffs.bucket_token_scale, "the shipped CPU profile has per-bucket factors (what this test covers)"
    return SchemeCosts(CostModel(ModelShape.from_config(ModelConfig()), Layout(1, 1, 1), coeffs), 4)


class Exhaustive(GroupCosts):
    """The same group model trying every cut and every split (no bound)."""

    def _grows_with_padding(self, scheme):
        return False


def test_analytic_and_shipped_cpu_costs_grow_with_padding():
    for costs in (analytic_costs(), analytic_costs(sharded=True), cpu_costs()):
        for scheme in GroupCosts(costs).schemes:
            assert costs.cost(scheme).grows_with_padding(), scheme


def test_a_factor_that_falls_across_a_bucket_edge_or_a_negative_term_disables_the_bound():
    base = small_cost(pp=1, sp=1)
    # 1024 tokens charged 2x, the next bucket (1280) 1x: a larger bucket charged fewer tokens
    falling = base.replace(coeffs=base.coeffs.replace(bucket_token_scale={1: {1024: 2.0, 4096: 1.0}}))
    assert not falling.grows_with_padding()
    rising = base.replace(coeffs=base.coeffs.replace(bucket_token_scale={1: {1024: 0.9, 4096: 1.0}}))
    assert rising.grows_with_padding()
    negative = base.replace(coeffs=base.coeffs.replace(fwd=dataclasses.replace(base.coeffs.fwd, alpha2=-1e-9)))
    assert not negative.grows_with_padding()
    gc = GroupCosts(SchemeCosts(falling, 1))
    assert not gc._bounded(gc.schemes[0])


def _random_group(rng, costs: SchemeCosts) -> list[int]:
    gc = GroupCosts(costs)
    top = max(gc.cap_full(s) for s in gc.schemes)
    n = int(rng.integers(2, 24))
    return [int(x) for x in np.minimum(np.exp(rng.uniform(np.log(64), np.log(top), size=n)), top)]


@pytest.mark.parametrize("which", ["analytic", "sharded", "cpu"])
@pytest.mark.parametrize("max_parts", [2, 3])
@pytest.mark.parametrize("seed", range(8))
def test_the_bounded_search_chooses_what_trying_every_cut_chooses(which, max_parts, seed):
    rng = np.random.default_rng(seed)
    costs = {"analytic": analytic_costs(), "sharded": analytic_costs(sharded=True), "cpu": cpu_costs()}[which]
    bounded, every = GroupCosts(costs, max_parts=max_parts), Exhaustive(costs, max_parts=max_parts)
    lengths = _random_group(rng, costs)
    for scheme in bounded.schemes:
        if max(lengths) > bounded.cap_full(scheme):
            continue
        assert bounded._bounded(scheme) and not every._bounded(scheme)
        docs = range(len(lengths))
        got = bounded.flex_group(lengths, scheme, docs)
        assert got == every.flex_group(lengths, scheme, docs)
        # a policy's own cut and recomputation (DCP's), within a micro-batch count
        cut = chunk_group(lengths, bounded.cap_none(scheme))
        if max(lengths) > bounded.cap_none(scheme):
            continue
        ckpt = [int(rng.integers(0, bounded.max_recompute + 1)) for _ in cut]
        lo, hi = 1, len(lengths) - int(rng.integers(0, len(lengths)))
        mine = bounded.fastest_cut(lengths, scheme, docs, cut, lo, hi, ckpt)
        assert mine == every.fastest_cut(lengths, scheme, docs, cut, lo, hi, ckpt)
        policys = bounded._cut(scheme, tuple(docs), lengths, cut, given=ckpt)
        assert bounded.group_time(lengths, mine) <= bounded.group_time(lengths, policys)
