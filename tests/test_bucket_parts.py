"""One-stage group plans in parts (docs/design/bucket-parts.md): the plan's parts, their
simulation, memory account and fit, and the group model's choice of parts against brute force."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
from conftest import group_budget, small_cost

from jvarlen.layout import Layout
from jvarlen.plan.api import make_cost
from jvarlen.plan.assemble import simulate
from jvarlen.plan.buffers import CHUNK_KEYS
from jvarlen.plan.chunk import executor_bucket
from jvarlen.plan.cost import ModelShape
from jvarlen.plan.executor_memory import executor_memory, fit_executor
from jvarlen.plan.online_refit import OnlineRefit
from jvarlen.plan.plan import Plan, PlanError
from jvarlen.plan.sp_groups import GroupChoice, GroupCosts
from jvarlen.plan.strategy import Scheme, SchemeCosts, build_group_plan

LENGTHS = [9000, 500, 200, 3000, 700, 400, 1200]
MICRO = [[0], [3, 4], [6, 5], [1, 2]]  # a long one, then shorter ones


def scheme_costs(n: int = 8) -> SchemeCosts:
    budget = group_budget(small_cost(pp=1, sp=1), 4096)
    return SchemeCosts(small_cost(pp=1, sp=1, budget=budget), n)


def _plan(parts, ckpt=(0, 0, 0, 0), simulation="paired", costs=None):
    costs = costs or scheme_costs()
    return build_group_plan("test", Scheme(1, 2), LENGTHS, MICRO, costs, list(ckpt), simulation, parts=parts)


def test_parts_are_their_own_steps_in_simulation_and_memory():
    costs = scheme_costs()
    cost = costs.cost(Scheme(1, 2))
    whole, split = _plan(()), _plan((1, 3))
    assert split.parts == (1, 3) and whole.parts == ()
    split.validate(LENGTHS, cost)
    parts = split.part_plans()
    assert [p.n_chunks for p in parts] == [1, 3] and all(p.parts == () for p in parts)
    assert parts[1].chunks == split.chunks[1:] and parts[1].schedule.n_chunks == 3
    # each part padded to its own bucket, one step overhead
    sims = [simulate(p, cost, "paired") for p in parts]
    want = sum(s.makespan for s in sims) + cost.step_overhead()
    assert split.stats["iteration_time_s"] == pytest.approx(want, rel=1e-12)
    assert split.stats["iteration_time_s"] < whole.stats["iteration_time_s"]  # the short ones not padded to 9K
    buckets = [executor_memory(p, cost).sizes["bucket"] for p in parts]
    assert buckets == [executor_bucket(9000, 2), executor_bucket(max(3700, 1600, 700), 2)]
    # the memory account is the largest part's (buffers are freed between parts)
    assert executor_memory(split, cost).total == max(executor_memory(p, cost).total for p in parts)
    # the long part holds most: all but the other chunks' int32 inputs, padded to its bucket
    saved = executor_memory(whole, cost).total - executor_memory(split, cost).total
    assert saved == (whole.n_chunks - 1) * len(CHUNK_KEYS) * buckets[0] * 4
    # the cost check predicts a plan in parts as the planner does
    refit = OnlineRefit(cost.model, cost.coeffs)
    shapes, ckpt = split.chunk_shapes(), np.asarray(split.ckpt_layers)
    got = refit.predict(shapes, cost.layout, split.schedule, ckpt, mode="paired", parts=split.parts, group=True)
    assert got == pytest.approx(split.stats["iteration_time_s"], rel=1e-12)


def test_the_executor_fit_raises_recomputation_per_part():
    """On the 7B model of the FlexSP benchmark a 60K-token micro-batch's bucket needs recomputation
    in the executor's buffers that 20K-token ones do not: fitted as one step, every micro-batch
    recomputes; in parts, only the long one."""
    costs = SchemeCosts(make_cost(ModelShape.from_config(_7b()), "a800", Layout(64, 1, 1)), 64)
    scheme = Scheme(1, 8)
    lengths = [60000, 20000, 19000, 18000]
    micro = [[0], [1], [2], [3]]
    gc = GroupCosts(costs)
    least = [gc.least_recompute(scheme, n) for n in lengths]
    whole = build_group_plan("t", scheme, lengths, micro, costs, least, "paired")
    split = build_group_plan("t", scheme, lengths, micro, costs, least, "paired", parts=(1, 3))
    assert np.all(whole.ckpt_layers[1:] > least[1])  # raised by the long micro-batch's bucket
    assert split.ckpt_layers[1:, 0].tolist() == least[1:]  # not raised
    ckpt, account, _ = fit_executor(split, costs.cost(scheme))
    np.testing.assert_array_equal(ckpt, split.ckpt_layers)
    assert account.total <= costs.cost(scheme).memory_budget
    choice = GroupChoice(scheme, (0, 1, 2, 3), tuple(map(tuple, micro)), tuple(split.ckpt_layers[:, 0]), (1, 3))
    assert gc.group_time(lengths, choice) == pytest.approx(split.stats["iteration_time_s"], rel=1e-9)
    assert split.stats["iteration_time_s"] < whole.stats["iteration_time_s"]


def _7b():
    from pathlib import Path

    from jvarlen.config import load_config

    return load_config(Path(__file__).resolve().parents[1] / "configs" / "gpt-7b.yaml").model


def test_invalid_parts_are_named():
    plan = _plan((1, 3))
    for bad, message in (((2, 3), "do not partition"), ((0, 4), "do not partition")):
        with pytest.raises(PlanError, match=message):
            dataclasses.replace(plan, parts=bad).validate(LENGTHS)
    # ops of two parts interleaved: a part runs alone
    stages = plan.schedule.stages[0]
    swapped = (stages[2], *stages[:2], *stages[3:])
    sched = dataclasses.replace(plan.schedule, stages=(swapped,))
    with pytest.raises(PlanError, match="interleave"):
        dataclasses.replace(plan, schedule=sched).validate(LENGTHS)
    with pytest.raises(ValueError, match="must partition"):
        _plan((2, 3))


def test_parts_survive_json():
    plan = _plan((1, 3))
    again = Plan.from_json(json.loads(plan.dumps()))
    assert again.parts == (1, 3)
    legacy = plan.to_json()
    del legacy["parts"]  # a plan saved before parts existed is one part
    assert Plan.from_json(legacy).parts == ()


def _brute_force(gc: GroupCosts, scheme, local, mbs, ckpt, max_parts):
    """Every order-preserving split of the micro-batches sorted by tokens (largest first) into at
    most ``max_parts`` parts, not only at bucket changes: the least group time."""
    tokens = [sum(local[d] for d in mb) for mb in mbs]
    order = sorted(range(len(mbs)), key=lambda i: (-tokens[i], i))
    best = np.inf
    for k in range(1, max_parts + 1):
        for cuts in itertools.combinations(range(1, len(order)), k - 1):
            edges = (0, *cuts, len(order))
            t = sum(
                gc._part_time(
                    scheme,
                    [[local[d] for d in mbs[i]] for i in order[a:b]],
                    [tokens[i] for i in order[a:b]],
                    [ckpt[i] for i in order[a:b]],
                )
                for a, b in zip(edges, edges[1:])
            )
            best = min(best, t)
    return best + gc.base(scheme)


@pytest.mark.parametrize("max_parts", [2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_the_chosen_parts_are_the_best_split(seed, max_parts):
    """``GroupCosts`` cuts a group's micro-batches, sorted by tokens, only where their bucket changes:
    as fast as the best of every split (brute force), and never slower than one part."""
    rng = np.random.default_rng(seed)
    costs = scheme_costs()
    gc, one = GroupCosts(costs, max_parts=max_parts), GroupCosts(costs, max_parts=1)
    scheme = Scheme(1, 2)
    local = [int(x) for x in np.exp(rng.uniform(np.log(100), np.log(12000), size=int(rng.integers(3, 9))))]
    mbs = [[i] for i in range(len(local))]
    ckpt = [gc.least_recompute(scheme, n) for n in local]
    docs = tuple(range(len(local)))
    choice = gc._cut(scheme, docs, local, mbs, given=ckpt)
    whole = one._cut(scheme, docs, local, mbs, given=ckpt)
    assert len(choice.parts) <= max_parts and whole.parts == ()
    assert gc.group_time(local, choice) == pytest.approx(_brute_force(gc, scheme, local, mbs, ckpt, max_parts))
    assert gc.group_time(local, choice) <= one.group_time(local, whole) + 1e-12
    # and it is what the executor plan simulates to
    plan = build_group_plan(
        "t", scheme, local, choice.micro_batches, costs, list(choice.ckpt), "paired", parts=choice.parts
    )
    assert plan.stats["iteration_time_s"] == pytest.approx(gc.group_time(local, choice), rel=1e-9)
