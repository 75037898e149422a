"""The hydraulis and homogeneous strategy policies end to end: valid, deterministic plans."""

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jvarlen.plan.api import PlanningError
from jvarlen.plan.hydraulis import HomogeneousOptions, HydraulisOptions, homogeneous_strategies, scheme_space
from jvarlen.plan.hydraulis_costs import scheme_tables
from jvarlen.plan.strategy import (
    Scheme,
    SchemeCosts,
    StrategyPlan,
    build_group_plan,
    plan_strategy,
    predicted_time,
    strategy_policies,
)


@pytest.fixture(scope="module")
def costs():
    from conftest import small_cost

    return SchemeCosts(small_cost(pp=1, sp=1, budget=6e9), 8)


def batch(seed: int, n: int = 40, context: int = 16384) -> list[int]:
    from jvarlen.plan.workloads import GITHUB

    return [int(x) for x in np.minimum(GITHUB.sample(n, np.random.default_rng(seed)), context)]


def test_policies_are_registered():
    policies = strategy_policies()
    assert policies["hydraulis"][1] is HydraulisOptions and policies["homogeneous"][1] is HomogeneousOptions


@pytest.mark.parametrize("policy", ["hydraulis", "homogeneous"])
def test_plan_is_valid_and_reports(costs, policy):
    lengths = batch(1)
    plan = plan_strategy(policy, lengths, costs)
    plan.validate(lengths, costs)
    s = plan.stats
    for key in ("iteration_time_s", "solve_seconds", "policy", "strategy", "candidates", "propagation_s"):
        assert key in s, key
    assert s["policy"] == policy and s["strategy"] == plan.describe()
    assert s["iteration_time_s"] == pytest.approx(predicted_time(plan.groups, costs))
    assert all(set(c) >= {"strategy", "iteration_time_s"} for c in s["candidates"])
    assert s["strategy"] in {c["strategy"] for c in s["candidates"]}
    assert s["fits_memory"]
    used = sum(g.scheme.num_devices for g in plan.groups)
    assert used <= costs.num_devices
    again = StrategyPlan.from_json(json.loads(plan.dumps()))
    again.validate(lengths, costs)
    assert again.describe() == plan.describe()


def test_same_inputs_same_plan(costs):
    from jvarlen.plan.hydraulis_proposal import propose_strategies

    lengths = batch(2)
    candidates = propose_strategies(batch(20, n=400), costs, 16384, HydraulisOptions())
    options = HydraulisOptions(trials=8, candidates=candidates)
    a, b = (plan_strategy("hydraulis", lengths, costs, options) for _ in range(2))
    assert a.describe() == b.describe()
    assert [g.documents for g in a.groups] == [g.documents for g in b.groups]
    assert [g.plan.chunks for g in a.groups] == [g.plan.chunks for g in b.groups]
    assert a.stats["iteration_time_s"] == b.stats["iteration_time_s"]
    c = plan_strategy("hydraulis", lengths, costs, HydraulisOptions(trials=8, seed=5, candidates=candidates))
    c.validate(lengths, costs)


def test_given_candidates_are_used(costs):
    lengths = batch(3)
    schemes = scheme_space(costs, HydraulisOptions())
    tables = scheme_tables(costs, schemes)
    holder = max(schemes, key=lambda s: (tables[s].max_len, -s.num_devices))
    cand = (holder,) + (Scheme(1, 1),) * (8 - holder.num_devices)
    options = HydraulisOptions(candidates=(cand,), include_homogeneous=False)
    plan = plan_strategy("hydraulis", lengths, costs, options)
    plan.validate(lengths, costs)
    assert len(plan.stats["candidates"]) == 1
    assert sorted(plan.schemes) == sorted(cand[: len(plan.groups)]) or set(plan.schemes) <= set(cand)
    # a candidate that cannot hold the longest document is replaced by the batch's own proposal
    short = ((Scheme(1, 1),) * 8,)
    long_batch = lengths + [tables[holder].max_len]
    plan = plan_strategy("hydraulis", long_batch, costs, HydraulisOptions(candidates=short))
    plan.validate(long_batch, costs)
    assert any("proposing from the batch" in e for e in plan.events)


def test_homogeneous_static_and_best(costs):
    lengths = batch(4, context=4096)
    best = plan_strategy("homogeneous", lengths, costs)
    assert len(set(best.schemes)) == 1
    assert len(best.stats["candidates"]) == len(
        homogeneous_strategies(costs, scheme_space(costs, HomogeneousOptions()))
    )
    static = plan_strategy("homogeneous", lengths, costs, HomogeneousOptions(scheme=Scheme(2, 1)))
    static.validate(lengths, costs)
    assert set(static.schemes) == {Scheme(2, 1)}
    with pytest.raises(PlanningError, match="fits no scheme"):
        plan_strategy("homogeneous", [10**6], costs, HomogeneousOptions(scheme=Scheme(1, 1)))


def test_fixed_packing_baseline(costs):
    """Megatron-style: packed to a fixed length first, dealt to the pipelines in turn."""
    lengths = batch(5, n=60, context=4096)
    plan = plan_strategy("homogeneous", lengths, costs, HomogeneousOptions(scheme=Scheme(1, 1), packing="fixed"))
    plan.validate(lengths, costs)
    assert plan.policy == "homogeneous-fixed"
    counts = [g.plan.n_chunks for g in plan.groups]
    assert max(counts) - min(counts) <= 1


def test_nothing_fits_is_a_planning_error(costs):
    with pytest.raises(PlanningError, match="largest MaxLen"):
        plan_strategy("hydraulis", [50, 10**8], costs)


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(1, 30000), min_size=1, max_size=24), st.sampled_from(["hydraulis", "homogeneous"]))
def test_every_plan_validates(costs, lengths, policy):
    plan = plan_strategy(policy, lengths, costs, HydraulisOptions(trials=4) if policy == "hydraulis" else None)
    plan.validate(lengths, costs)
    assert sorted(d for g in plan.groups for d in g.documents) == list(range(len(lengths)))


def test_per_micro_batch_recomputation_as_given(costs):
    scheme = Scheme(2, 1)
    plan = build_group_plan("t", scheme, [1000, 2000, 500, 700], [[0], [1], [2], [3]], costs, ckpt=[0, 2, 0, 1])
    assert plan.ckpt_layers.tolist() == [[0, 0], [2, 2], [0, 0], [1, 1]]
    plan.validate(plan.lengths, costs.cost(scheme))


def test_a_packed_candidate_whose_estimate_beats_the_simulated_finalists_is_simulated_too():
    """The estimates leave out the recomputation that fits the executor's buffers (+7 % on the
    finalist here). On this batch (7B, 8 A800s, the benchmark's commoncrawl setting, batch 1013)
    the packed candidate 1×(pp=1, sp=8), estimated at 3.612 s, would not be simulated, and
    Hydraulis would return the finalist 1×(pp=1, sp=4) + 4×(pp=1, sp=1), estimated at 3.518 s and
    simulated at 3.777 s; simulated, the packed candidate takes 3.612 s, no slower than the
    homogeneous policy's choice. (Batch 1030 showed it, 3.901 s against the finalist's 4.075 s,
    until 2026-12-02, when the account charged the GPU step's relayout of two attention
    accumulators: 1×(pp=1, sp=8) is a finalist there now. Batch 1003 showed it with
    2×(pp=1, sp=4) until a GPU step's descents added each layer's gradients as they went,
    2026-12-01: its finalist now simulates faster than any other candidate's estimate.)"""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_strategies as bench

    setting = next(s for s in bench.settings(False) if s.name.startswith("commoncrawl 7B a800-ib200 8 dev"))
    costs, pool = bench.costs_for(setting), bench.corpus(setting.workload, setting.context)
    # without the homogeneous layouts' own finalists (which hold 1×(pp=1, sp=8) now): the rule
    # for candidates whose estimate beats the simulated finalists
    # (found in the lock-step model without the executor's padding, "ticks")
    hydraulis = HydraulisOptions(simulation="ticks").for_corpus(pool, costs, setting.context)
    options = dataclasses.replace(hydraulis, homogeneous_top=0)
    batch = bench.token_batch(pool, setting.tokens, 1013)
    plan = plan_strategy("hydraulis", batch, costs, options)
    candidates = plan.stats["candidates"]
    simulated = [c["iteration_time_s"] for c in candidates if c["estimate"] == "simulated"]
    by_estimate = sorted(candidates, key=lambda c: c["estimated_s"])
    first = by_estimate[0]  # the best estimate, simulated above the next two estimates
    assert first["strategy"] == "1×(pp=1, sp=4) + 4×(pp=1, sp=1)" and first["estimate"] == "simulated"
    assert first["iteration_time_s"] > by_estimate[2]["estimated_s"] > by_estimate[1]["estimated_s"]
    # the other finalist, 2×(pp=1, sp=4), is given up: its groups simulate slower than the best plan
    # ("exceeds"); 1×(pp=1, sp=8), no finalist, is packed and planned for its estimate
    assert [c["estimate"] for c in by_estimate[:3]] == ["simulated", "exceeds", "simulated"]
    assert plan.describe() == by_estimate[2]["strategy"] == "1×(pp=1, sp=8)"
    assert plan.stats["iteration_time_s"] == min(simulated) < first["iteration_time_s"]
    assert all(c["estimated_s"] >= min(simulated) for c in candidates if c["estimate"] == "packed")
    homogeneous = plan_strategy("homogeneous", batch, costs, HomogeneousOptions(simulation="ticks"))
    assert plan.stats["iteration_time_s"] <= homogeneous.stats["iteration_time_s"]


def test_per_iteration_homogeneous_is_no_slower_than_the_static_layout_its_estimate_misranks():
    """7B on 64 A800s (the benchmark's commoncrawl setting, pull/push overlapped): the estimate
    puts 8×(pp=1, sp=8) first (2.00 s, simulated 2.03 s with its executor-memory recomputation)
    and 4×(pp=2, sp=8) 10.7 % behind (2.21 s, simulated 1.90 s). Within the 10 % margin only the
    first was simulated, and the per-iteration choice was slower than that static layout."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_strategies as bench

    setting = next(
        s
        for s in bench.settings(False)
        if s.name == "commoncrawl 7B a800 64 dev 200K tok 32K ctx, pull/push overlapped"
    )
    costs, pool = bench.costs_for(setting), bench.corpus(setting.workload, setting.context)
    batch = bench.token_batch(pool, setting.tokens, 1001)
    best = plan_strategy("homogeneous", batch, costs).stats["iteration_time_s"]
    static = plan_strategy("homogeneous", batch, costs, HomogeneousOptions(scheme=Scheme(2, 8)))
    assert best <= static.stats["iteration_time_s"] < static.stats["estimated_time_s"]


def test_hydraulis_and_homogeneous_simulate_the_homogeneous_layout_ranked_third_by_estimate():
    """13B on 32 A800s, pull/push overlapped (the benchmark's commoncrawl setting), batch 1034: the
    estimates rank 1×(pp=4, sp=8) third (2.77 s against 2.46 s for the first), but it simulates
    7 % below what the policy chooses from the first two without ``homogeneous_top`` (2.23 s
    against 2.39 s). The best homogeneous layouts by estimate are simulated too
    (``homogeneous_top``), in Hydraulis as well, whose candidates include them. (Until a GPU
    step's descents added each layer's gradients as they went, 2026-12-01, batch 1002 showed it,
    whose first by estimate is now also the fastest; until the time model charged the vocabulary
    split's collectives, ``CostModel.vocab_time``, 2×(pp=4, sp=8) on 64 H100s, stdlib, batch 1002.)"""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_strategies as bench

    name = "commoncrawl 13B a800-ib200 32 dev 100K tok 32K ctx, overlapped"
    setting = next(s for s in bench.settings(False) if s.name == name)
    costs, pool = bench.costs_for(setting), bench.corpus(setting.workload, setting.context)
    batch = bench.token_batch(pool, setting.tokens, 1034)
    ticks = HomogeneousOptions(simulation="ticks")  # found in the lock-step model without padding
    static = plan_strategy("homogeneous", batch, costs, dataclasses.replace(ticks, scheme=Scheme(4, 8)))
    assert static.describe() == "1×(pp=4, sp=8)"
    homogeneous = plan_strategy("homogeneous", batch, costs, ticks)
    options = HydraulisOptions(simulation="ticks").for_corpus(pool, costs, setting.context)
    hydraulis = plan_strategy("hydraulis", batch, costs, options)
    assert homogeneous.stats["iteration_time_s"] <= static.stats["iteration_time_s"]
    assert hydraulis.stats["iteration_time_s"] <= homogeneous.stats["iteration_time_s"]
    off = plan_strategy("homogeneous", batch, costs, dataclasses.replace(ticks, homogeneous_top=0))
    assert off.stats["iteration_time_s"] > 1.05 * static.stats["iteration_time_s"]  # what the option fixes


def test_one_stage_pipelines_are_cut_at_their_bucket():
    """7B on 8 A800s (the strategies benchmark's commoncrawl setting, batch 3000): Hydraulis plans
    one (pp=1, sp=8) pipeline whose packed micro-batches are also cut at the executor's bucket
    (``GroupCosts.fastest_cut``): the plan is a fixed point of that cut (no cut of its documents is
    faster by the group model), the group model is its simulated time, and the iteration takes
    4.38 s in two bucket parts where the uncut (pp=2, sp=4) plan took 8.74 s when this test was
    written (5.47 s then, in two parts; 6.26 s in one bucket; 5.41 s until a GPU step's descents
    added each layer's gradients as they went, 2026-12-01). Fixed-length packing is not cut."""
    import sys
    from pathlib import Path

    from jvarlen.plan.sp_groups import GroupChoice, GroupCosts

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_strategies as bench

    setting = next(s for s in bench.settings(False) if s.name.startswith("commoncrawl 7B a800-ib200 8 dev"))
    costs, pool = bench.costs_for(setting), bench.corpus(setting.workload, setting.context)
    lengths = bench.token_batch(pool, setting.tokens, 3000)
    plan = plan_strategy("hydraulis", lengths, costs)
    plan.validate(lengths, costs)
    (group,) = plan.groups
    assert group.scheme == Scheme(1, 8) and plan.stats["iteration_time_s"] < 0.75 * 8.74
    local = [lengths[d] for d in group.documents]
    docs = range(len(local))
    mbs = [[d for d, _, _ in chunk] for chunk in group.plan.chunks]
    gc = GroupCosts(costs)
    choice = GroupChoice(
        group.scheme, tuple(docs), tuple(map(tuple, mbs)), tuple(group.plan.ckpt_layers[:, 0]), group.plan.parts
    )
    assert gc.fastest_cut(local, group.scheme, docs, mbs, ckpt=choice.ckpt) == choice
    assert gc.group_time(local, choice) == pytest.approx(group.plan.stats["iteration_time_s"], rel=1e-9)

    options = HomogeneousOptions(scheme=Scheme(1, 8), packing="fixed")
    fixed = plan_strategy("homogeneous", lengths, costs, options)
    # first-fit sequences of at most the longest document or the scheme's capacity (whichever the
    # estimate prefers), as packed: every document whole in one of them, none cut at a bucket
    length = max(max(lengths), scheme_tables(costs, [Scheme(1, 8)], simulation=options.simulation)[Scheme(1, 8)].cap0)
    for g in fixed.groups:
        pieces = [(d, a, n) for chunk in g.plan.chunks for d, a, n in chunk]
        assert sorted(d for d, _, _ in pieces) == list(range(len(g.documents)))
        assert all(a == 0 and n == lengths[g.documents[d]] for d, a, n in pieces)
        assert all(sum(n for _, _, n in chunk) <= length for chunk in g.plan.chunks if len(chunk) > 1)


@pytest.mark.parametrize("budget, gpipe", [(None, True), (50e9, False)])
def test_pipeline_groups_run_in_gpipe_order_where_faster_and_it_fits(budget, gpipe):
    """A pp > 1 group runs in GPipe order (every stage's forwards, then its backwards) where the
    executor's model runs that faster and every micro-batch fits in flight, as EPP's units do:
    four micro-batches of 32K, 32K, 16K and 16K tokens on a (pp = 4, sp = 8) group of a 13B model
    (A800s, 72 GB) take 9.97 s in GPipe order against 10.12 s in 1F1B; under 50 GB GPipe order does
    not fit and the group keeps 1F1B."""
    from jvarlen.config import load_config
    from jvarlen.layout import Layout
    from jvarlen.plan.api import make_cost
    from jvarlen.plan.assemble import assemble
    from jvarlen.plan.cost import CostModel, ModelShape
    from jvarlen.plan.hardware import CLUSTERS
    from jvarlen.plan.strategy import _group_unit
    from jvarlen.plan.units import PlannedChunk

    shape = ModelShape.from_config(load_config("configs/llama-13b.yaml").model)
    base = make_cost(shape, CLUSTERS["a800"], Layout(32, 1, 1))
    coeffs = base.coeffs if budget is None else base.coeffs.replace(memory_budget=budget)
    costs = SchemeCosts(CostModel(shape, base.layout, coeffs), 32)
    scheme, lengths = Scheme(4, 8), [32768, 32768, 16384, 16384]
    mbs, ckpt = [[i] for i in range(4)], [0] * 4
    plan = build_group_plan("hydraulis", scheme, lengths, mbs, costs, ckpt)
    plan.validate(lengths, costs.cost(scheme))
    chunks = [PlannedChunk(((i, 0, n),)) for i, n in enumerate(lengths)]
    unit = _group_unit("hydraulis", scheme, mbs, [c.shape(lengths) for c in chunks], costs.cost(scheme), ckpt, None, [])
    one_f_one_b = assemble("hydraulis", lengths, chunks, [unit], costs.cost(scheme), simulation="paired")
    forwards_first = all(all(op.kind == "F" for op in prog[:4]) for prog in plan.schedule.stages)
    assert plan.stats["fits_memory"] and plan.stats["gpipe_units"] == int(gpipe) and forwards_first == gpipe
    if gpipe:
        assert plan.stats["iteration_time_s"] < one_f_one_b.stats["iteration_time_s"]
    else:
        assert plan.schedule == one_f_one_b.schedule


def test_candidates_shown_slower_than_a_fitting_plan_are_not_built():
    """13B and 7B on 16 A800s (the benchmark's commoncrawl settings): a candidate is skipped where one
    of its ``pp > 1`` pipelines is bounded above a fitting plan already simulated, or given up where
    one of its groups simulates slower; the plans are those of building every candidate
    (``prune=False``)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_strategies as bench

    runs = []
    for name in ("commoncrawl 13B a800-ib200 16 dev", "commoncrawl 7B a800-ib200 16 dev"):
        setting = next(s for s in bench.settings(False) if s.name.startswith(name))
        costs, pool = bench.costs_for(setting), bench.corpus(setting.workload, setting.context)
        options = HydraulisOptions().for_corpus(pool, costs, setting.context)
        runs += [(bench.token_batch(pool, setting.tokens, 1000 + i), costs, options) for i in range(3)]
    plans = [plan_strategy("hydraulis", b, c, o) for b, c, o in runs]
    every = [plan_strategy("hydraulis", b, c, dataclasses.replace(o, prune=False)) for b, c, o in runs]
    skipped = 0
    for plan, full in zip(plans, every):
        assert plan.describe() == full.describe()
        assert plan.stats["iteration_time_s"] == full.stats["iteration_time_s"]
        kinds = [c["estimate"] for c in plan.stats["candidates"]]
        assert "exceeds" not in [c["estimate"] for c in full.stats["candidates"]]
        assert kinds.count("simulated") + kinds.count("exceeds") == sum(
            c["estimate"] == "simulated" for c in full.stats["candidates"]
        )
        skipped += kinds.count("exceeds")
    assert skipped > 0


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(64, 6000), min_size=4, max_size=40),
    st.sampled_from([4, 8]),
    st.sampled_from([2500, 4096, 8192]),
    st.sampled_from(["hydraulis", "homogeneous"]),
)
def test_the_prunings_keep_the_plan_on_random_batches(lengths, devices, tokens, policy):
    """Random batches on a small model whose (pp > 1) pipelines recompute and fuse: the plan with
    the bounds and the early give-up is the plan of building every cut and candidate."""
    from conftest import group_budget, small_cost

    costs = SchemeCosts(small_cost(pp=1, sp=1, budget=group_budget(small_cost(pp=2, sp=1), tokens)), devices)
    options = HydraulisOptions() if policy == "hydraulis" else HomogeneousOptions()
    try:
        plan = plan_strategy(policy, lengths, costs, options)
    except PlanningError:
        return  # a document no scheme holds: nothing to compare
    every = plan_strategy(policy, lengths, costs, dataclasses.replace(options, prune=False))
    assert plan.describe() == every.describe()
    assert plan.stats["iteration_time_s"] == every.stats["iteration_time_s"]
    assert [g.plan.chunks for g in plan.groups] == [g.plan.chunks for g in every.groups]


@settings(max_examples=12, deadline=None)
@given(
    st.lists(st.integers(64, 6000), min_size=4, max_size=40),
    st.sampled_from([4, 8]),
    st.sampled_from([2500, 4096, 8192]),
)
def test_a_ceiling_keeps_the_plan_that_beats_it_and_refuses_the_batch_otherwise(lengths, devices, tokens):
    """Under a ceiling just above its plan's time Hydraulis plans what it plans without one; under
    that time itself (or below) no plan is faster and it raises :class:`SlowerThanCeiling`."""
    from conftest import group_budget, small_cost

    from jvarlen.plan.options import SlowerThanCeiling

    costs = SchemeCosts(small_cost(pp=1, sp=1, budget=group_budget(small_cost(pp=2, sp=1), tokens)), devices)
    try:
        free = plan_strategy("hydraulis", lengths, costs, HydraulisOptions())
    except PlanningError:
        return  # a document no scheme holds: nothing to compare
    t = free.stats["iteration_time_s"]
    above = plan_strategy("hydraulis", lengths, costs, HydraulisOptions(ceiling=t * (1 + 1e-9)))
    assert above.describe() == free.describe() and above.stats["iteration_time_s"] == t
    assert [g.plan.chunks for g in above.groups] == [g.plan.chunks for g in free.groups]
    for ceiling in (t, 0.9 * t):
        with pytest.raises(SlowerThanCeiling, match=f"no candidate of .* is faster than {ceiling:.4g} s"):
            plan_strategy("hydraulis", lengths, costs, HydraulisOptions(ceiling=ceiling))


def test_a_ceiling_bounds_only_the_pruned_search(costs):
    """``prune=False`` builds every candidate (the reference of the bounded search): a ceiling does
    not stop it, and the plan is the one planned without a ceiling."""
    lengths = batch(3)
    free = plan_strategy("hydraulis", lengths, costs, HydraulisOptions(prune=False))
    low = plan_strategy("hydraulis", lengths, costs, HydraulisOptions(prune=False, ceiling=1e-9))
    assert low.describe() == free.describe() and low.stats["iteration_time_s"] == free.stats["iteration_time_s"]
