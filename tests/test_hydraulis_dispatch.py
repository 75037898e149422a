"""Hydraulis dispatch across pipelines: Eq. 2 loads, Eq. 3 exact (CP-SAT = brute force), Alg. 1's gap."""

import numpy as np
import pytest

from jvarlen.plan.hydraulis_costs import SchemeTable, scheme_tables
from jvarlen.plan.hydraulis_dispatch import (
    DispatchProblem,
    brute_force_dispatch,
    exact_dispatch,
    greedy_dispatch,
    greedy_dispatch_many,
    local_search,
    trial_orders,
)
from jvarlen.plan.hydraulis_pack import PackOptions, pack
from jvarlen.plan.strategy import Scheme, SchemeCosts, enumerate_schemes
from jvarlen.plan.workloads import COMMONCRAWL


def table(pp=1, sp=1, a=1e-8, b=1e-5, c=3e-3, caps=(4000, 20000), util=1, overhead=0.0):
    caps = np.asarray(caps, dtype=np.int64)
    return SchemeTable(Scheme(pp, sp), a, b, c, 2e-9, 3e-6, 1e-3, caps, int(caps[-1]), util, overhead, 0.0)


def test_loads_are_eq2():
    """Σ w + c · V_min + T(longest) · (PP - 1), per pipeline; empty pipelines cost nothing."""
    big, small = table(pp=2, caps=(4000, 20000), overhead=0.25), table(pp=1, caps=(2000,), c=1e-3, overhead=0.5)
    lengths = [10000, 3000, 1500, 1000]
    problem = DispatchProblem.build(lengths, [big, small, small])
    assert not problem.feasible()[0, 1] and not problem.feasible()[1, 2]  # too long for `small`
    assign = np.array([0, 0, 1, 1])
    loads = problem.loads(assign)
    w0 = float(big.doc_work(10000) + big.doc_work(3000))  # 10000 runs alone (recomputing), 3000 packs
    expected0 = w0 + big.c * (1 + 1) + float(big.doc_time(10000)) * 1 + big.overhead_s
    expected1 = float(small.work(1500) + small.work(1000)) + small.c * 2 + small.overhead_s  # 2500 > cap: V ≥ 2
    assert loads == pytest.approx([expected0, expected1, 0.0], rel=1e-12)
    assert problem.objective(assign) == pytest.approx(max(expected0, expected1))


def real_tables(seed: int):
    """Tables of a 0.1B model on 8 analytic A800s with a tight budget (long documents recompute)."""
    from conftest import small_cost

    costs = SchemeCosts(small_cost(pp=1, sp=1, budget=float(np.random.default_rng(seed).choice([6e9, 9e9]))), 8)
    schemes = enumerate_schemes(8, costs.model.num_layers, costs.model.num_heads)
    return costs, scheme_tables(costs, schemes, simulation="ticks")  # κ = 2B / (F + B) for pp > 1


def random_instance(seed: int, max_docs: int = 9):
    rng = np.random.default_rng(seed)
    _, tables = real_tables(seed)
    schemes = [s for s in tables if s.num_devices <= 4]
    budget = 8
    strategy = []
    while budget > 0 and len(strategy) < 4:
        s = schemes[int(rng.integers(len(schemes)))]
        if s.num_devices <= budget:
            strategy.append(s)
            budget -= s.num_devices
    n = int(rng.integers(4, max_docs + 1))
    lengths = np.minimum(COMMONCRAWL.sample(n, rng), 16384)
    top = max(tables[s].max_len for s in strategy)
    lengths = np.minimum(lengths, top)
    return [int(x) for x in lengths], [tables[s] for s in strategy]


@pytest.mark.parametrize("seed", range(8))
def test_exact_dispatch_equals_brute_force(seed):
    lengths, tables = random_instance(seed, max_docs=6)
    problem = DispatchProblem.build(lengths, tables)
    bf, _ = brute_force_dispatch(problem)
    exact = exact_dispatch(problem)
    assert exact.source == "cp-sat"
    assert exact.objective_s == pytest.approx(bf, rel=1e-5)


def test_greedy_gap_to_exact_is_small():
    """App. D.3: the greedy is within 1.1x of Eq. 3's optimum on small random instances (the
    benchmark reports the distribution: scripts/bench_strategies.py --part gap)."""
    ratios = []
    for seed in range(40):
        lengths, tables = random_instance(100 + seed, max_docs=10)
        problem = DispatchProblem.build(lengths, tables)
        greedy = greedy_dispatch(problem, trials=32, seed=seed)
        improved = local_search(problem, greedy.assign)
        assert improved.objective_s <= greedy.objective_s * (1 + 1e-12)
        assert improved.objective_s == pytest.approx(problem.objective(improved.assign))
        if problem.shape[1] ** problem.shape[0] <= 200_000:
            best, _ = brute_force_dispatch(problem)
        else:
            exact = exact_dispatch(problem)
            assert exact.source == "cp-sat"
            best = exact.objective_s
        assert greedy.objective_s >= best * (1 - 1e-9)
        ratios.append(greedy.objective_s / best)
    ratios = np.array(ratios)
    assert ratios.max() <= 1.1, np.sort(ratios)[-5:]
    assert np.median(ratios) <= 1.01


def test_batched_greedy_equals_one_at_a_time():
    lengths, tables = random_instance(7, max_docs=12)
    problems = [DispatchProblem.build(lengths, tables), DispatchProblem.build(lengths, tables[:1] * 3)]
    orders = trial_orders(lengths, 8, seed=(1, 2))
    together = greedy_dispatch_many(problems, orders)
    for p, res in zip(problems, together):
        alone = greedy_dispatch_many([p], orders)[0]
        assert np.array_equal(res.assign, alone.assign) and res.objective_s == alone.objective_s
        assert res.objective_s == pytest.approx(p.objective(res.assign))
        assert res.objective_s == pytest.approx(res.trial_objectives.min())


@pytest.mark.parametrize("objective", ["eq1", "sum"])
def test_pack_bound_sits_between_eq2_and_every_packing(objective):
    exact = PackOptions(gap=0.0, deterministic_time=5.0, time_limit_s=5.0, max_solves=64, objective=objective)
    for seed in range(6):
        lengths, tables = random_instance(200 + seed, max_docs=12)
        problem = DispatchProblem.build(lengths, tables)
        assign = greedy_dispatch(problem, trials=4, seed=seed).assign
        bounds, loads = problem.pack_bounds(assign, objective=objective), problem.loads(assign)
        assert np.all(np.where(loads > 0, bounds + problem.fixed, 0.0) >= loads * (1 - 1e-9))
        for j, t in enumerate(tables):
            docs = [lengths[i] for i in np.flatnonzero(assign == j)]
            packed = pack(docs, t, exact)
            assert bounds[j] <= packed.objective_s * (1 + 1e-9)


def test_a_document_no_pipeline_holds_is_an_error():
    small = table(caps=(1000,))
    problem = DispatchProblem.build([500, 5000], [small, small])
    with pytest.raises(ValueError, match="fits on no pipeline"):
        greedy_dispatch(problem)


def test_local_search_swaps_off_the_slowest_pipeline():
    """LPT order on two equal pipelines: {3, 2, 2} | {3, 2} = 7; one swap gives {3, 3} | {2, 2, 2} = 6."""
    t = table(a=0.0, b=1e-3, c=0.0, caps=(100_000,))
    problem = DispatchProblem.build([3000, 3000, 2000, 2000, 2000], [t, t])
    greedy = greedy_dispatch(problem, trials=1)
    assert greedy.objective_s == pytest.approx(7.0)
    improved = local_search(problem, greedy.assign)
    assert improved.objective_s == pytest.approx(6.0) == brute_force_dispatch(problem)[0]
