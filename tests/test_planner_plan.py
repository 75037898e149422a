"""Plan: every policy yields a valid plan; the validator catches corrupted plans; JSON; determinism."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import small_cost, tight_budget

from jvarlen.plan.api import POLICIES, PlannerOptions, PlanningError, plan_iteration
from jvarlen.plan.checkpointing import SolverOptions
from jvarlen.plan.plan import Plan, PlanError, stage_peak_memory
from jvarlen.plan.schedule import Op, Schedule
from jvarlen.plan.workloads import sample_batch

K = 1024
OPTS = PlannerOptions(n_candidates=2, solver=SolverOptions(time_limit_s=0.5), chunk_tokens=(4096, 8192))


@pytest.fixture(scope="module")
def batch():
    return sample_batch("github", 48, 24 * K, seed=3)


@pytest.fixture(scope="module")
def tight(batch):
    """A budget that forces recomputation on this batch and that every policy but wo-ckpt plans
    in: 40,000 tokens' worth (20,000 while the head was charged its every logit, 2026-11-30)."""
    cost = small_cost(pp=4, sp=2)
    return small_cost(pp=4, sp=2, budget=tight_budget(cost, 40_000))


@pytest.fixture(scope="module")
def plans(batch, tight):
    out = {}
    for policy in POLICIES:
        try:
            out[policy] = plan_iteration(batch, cost=tight, policy=policy, options=OPTS)
        except PlanningError:
            assert policy == "wo-ckpt"  # without recomputation nothing may fit this budget
    return out


def test_every_policy_gives_a_valid_plan(batch, tight, plans):
    for policy, plan in plans.items():
        if policy == "dapple" and plan.stats["oom"]:
            continue
        plan.validate(batch, tight)
        assert plan.tokens_planned == plan.tokens_in == sum(batch)
        assert plan.stats["fits_memory"]
        peaks = stage_peak_memory(plan, tight)
        np.testing.assert_allclose(peaks, plan.stats["peak_memory_bytes"], rtol=1e-9)  # simulator agrees
        assert 0 <= plan.stats["bubble_ratio"] < 1
    # The tight budget forces recomputation: full-ckpt recomputes more than the MILP plan.
    assert plans["full-ckpt"].ckpt_layers.sum() > plans["epp"].ckpt_layers.sum() > 0


def test_dapple_reports_out_of_memory_for_a_long_document(tight):
    lengths = [200_000, 3_000, 2_000, 1_000]
    plan = plan_iteration(lengths, cost=tight, policy="dapple")
    assert plan.stats["oom"] and not plan.stats["fits_memory"]
    assert any("out of memory" in e for e in plan.events)
    with pytest.raises(PlanError, match="peak memory"):
        plan.validate(lengths, tight)
    plan.validate(lengths)  # everything but memory is fine


def test_json_round_trip(batch, tight, split_plan):
    plan = split_plan
    again = Plan.from_json(json.loads(plan.dumps()))
    assert again.dumps() == plan.dumps()
    again.validate(batch, tight)
    bad = plan.to_json()
    bad["version"] = 99
    with pytest.raises(PlanError, match="version"):
        Plan.from_json(bad)


def _corrupt(plan: Plan, **changes) -> Plan:
    return dataclasses.replace(plan, **changes)


@pytest.fixture(scope="module")
def split_plan(batch, tight):
    """An EPP plan with split documents (N fixed) and some recomputation."""
    plan = plan_iteration(batch, cost=tight, policy="epp", options=dataclasses.replace(OPTS, n_slices=4))
    assert any(j >= 0 for j in plan.schedule.chunk_prev) and plan.ckpt_layers.sum() > 0
    return plan


def test_validator_catches_corrupted_plans(batch, tight, split_plan):
    plan = split_plan
    chunks = [list(c) for c in plan.chunks]

    # 1. A token missing: shorten a piece.
    c = [list(x) for x in chunks]
    doc, start, length = c[0][0]
    c[0][0] = (doc, start, length - 1)
    with pytest.raises(PlanError, match="missing|gap"):
        _corrupt(plan, chunks=tuple(map(tuple, c))).validate(batch, tight)

    # 2. A token twice: duplicate a short document into another chunk.
    c = [list(x) for x in chunks]
    c[-1].append(c[-2][-1])
    with pytest.raises(PlanError, match="overlap"):
        _corrupt(plan, chunks=tuple(map(tuple, c))).validate(batch, tight)

    # 3. Slice order: swap the forward order of two slices of a split document on one stage.
    split = [k for k, j in enumerate(plan.schedule.chunk_prev) if j >= 0]
    assert split, "the batch should contain a split document"
    k = split[0]
    j = plan.schedule.chunk_prev[k]
    prog = list(plan.schedule.stages[1])
    a, b = prog.index(Op("F", j)), prog.index(Op("F", k))
    prog[a], prog[b] = prog[b], prog[a]
    stages = list(plan.schedule.stages)
    stages[1] = tuple(prog)
    bad = _corrupt(plan, schedule=Schedule(tuple(stages), plan.schedule.chunk_prev))
    with pytest.raises(PlanError, match="precedes its earlier slice"):
        bad.validate(batch, tight)

    # 4. 1F1B dependency: a backward before its forward.
    prog = list(plan.schedule.stages[0])
    f = prog.index(Op("F", 0))
    bpos = prog.index(Op("B", 0))
    prog[f], prog[bpos] = prog[bpos], prog[f]
    stages = list(plan.schedule.stages)
    stages[0] = tuple(prog)
    with pytest.raises(PlanError, match="comes before"):
        _corrupt(plan, schedule=Schedule(tuple(stages), plan.schedule.chunk_prev)).validate(batch, tight)

    # 5. Memory: drop all recomputation under a budget that needs it.
    assert plan.ckpt_layers.sum() > 0
    with pytest.raises(PlanError, match="peak memory"):
        _corrupt(plan, ckpt_layers=np.zeros_like(plan.ckpt_layers)).validate(batch, tight)

    # 6. Two split slices in one chunk.
    c = [list(x) for x in chunks]
    slice_piece = plan.chunks[k][0]
    c[k] = [c[k][0]]
    donor = next(i for i, x in enumerate(c) if i != k and len(x) >= 1 and x[0][1] == 0 and x[0][2] == batch[x[0][0]])
    c[donor] = c[donor] + [slice_piece]
    c[k] = [(slice_piece[0], slice_piece[1], slice_piece[2])]
    with pytest.raises(PlanError):
        _corrupt(plan, chunks=tuple(map(tuple, c))).validate(batch, tight)

    # 7. Recomputation outside [0, L/d_p].
    ck = plan.ckpt_layers.copy()
    ck[0, 0] = tight.layers_per_stage + 1
    with pytest.raises(PlanError, match="outside"):
        _corrupt(plan, ckpt_layers=ck).validate(batch, tight)

    plan.validate(batch, tight)  # the original is still fine


def _strip(plan: Plan) -> str:
    data = plan.to_json()
    for key in ("solve_seconds", "simulate_seconds"):
        data["stats"].pop(key, None)
    return json.dumps(data, sort_keys=True)


def test_planning_is_deterministic(batch, tight):
    """Same data, same plan, when the solver is limited by work (deterministic time), not
    by wall-clock time, which a loaded machine would hit at different points."""
    opts = dataclasses.replace(OPTS, solver=SolverOptions(time_limit_s=120.0, deterministic_time=0.5))
    first = plan_iteration(batch, cost=tight, policy="epp", options=opts)
    again = plan_iteration(batch, cost=tight, policy="epp", options=opts)
    assert _strip(again) == _strip(first)


def test_no_solver_time_still_gives_a_valid_plan(batch, tight):
    opts = dataclasses.replace(OPTS, solver=SolverOptions(time_limit_s=0.0))
    plan = plan_iteration(batch, cost=tight, policy="epp", options=opts)
    plan.validate(batch, tight)
    assert "cp-sat" not in plan.stats["ckpt_sources"]
    assert "greedy" in plan.stats["ckpt_sources"]
    assert any("greedy" in e for e in plan.events)


@pytest.mark.slow
@pytest.mark.parametrize("model,context", [("13b", 96), ("30b", 192)])
def test_paper_scale_plans_are_valid(model, context):
    from jvarlen.config import load_config
    from jvarlen.layout import Layout
    from jvarlen.plan.api import make_cost

    cost = make_cost(load_config(f"configs/gpt-{model}.yaml").model, "a800", Layout(1, 4, 8), zero3_sp=True)
    batch = sample_batch("github", 512, context * K, seed=11)
    for policy in ("epp", "seq1f1b", "dapple"):
        plan = plan_iteration(batch, cost=cost, policy=policy)
        plan.validate(batch, cost if plan.stats["fits_memory"] else None)
    epp = plan_iteration(batch, cost=cost, policy="epp")
    assert epp.stats["fits_memory"] and epp.stats["bubble_ratio"] < 0.2


def test_plan_iteration_builds_an_analytic_cost_from_cluster_and_model():
    from conftest import SMALL

    from jvarlen.layout import Layout
    from jvarlen.plan import plan_iteration as exported
    from jvarlen.plan import simulate

    lengths = [9_000, 3_000, 1_200, 700, 300]
    plan = exported(lengths, "a800", SMALL, policy="epp", layout=Layout(1, 4, 2))
    cost = small_cost(pp=4, sp=2)
    plan.validate(lengths, cost)
    sim = simulate(plan, cost)
    assert sim.iteration_time == pytest.approx(plan.stats["iteration_time_s"])
    assert list(sim.peak_memory) == pytest.approx(plan.stats["peak_memory_bytes"])
