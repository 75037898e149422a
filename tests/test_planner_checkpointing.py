"""Alg. 2 / Eq. 15-20: checkpointing MILP against brute force, greedy fallback, Eq. 16 mapping."""

import itertools

import numpy as np
import pytest
from conftest import small_cost, tight_budget

from jvarlen.plan.checkpointing import CkptProblem, SolverOptions, build_problem, greedy, solve
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.units import live_windows, unit_schedule


def brute_force(problem: CkptProblem):
    """Least objective over all C in {0..L/d_p}^(n+d_p-1); None when nothing fits."""
    best = None
    for c in itertools.product(range(problem.max_layers + 1), repeat=problem.n_vars):
        c = np.array(c, dtype=np.int64)
        if problem.feasible(c):
            v = problem.objective_us(c)
            best = v if best is None or v < best else best
    return best


def _unit_problem(seed: int, pp: int = 2):
    """A real unit (cost model + token-level 1F1B windows) with a budget that forces recomputation."""
    rng = np.random.default_rng(seed)
    cost = small_cost(pp=pp, sp=2)
    # Two short documents and one document split in two slices.
    a, b = int(rng.integers(2_000, 6_000)), int(rng.integers(2_000, 6_000))
    s0, s1 = int(rng.integers(3_000, 8_000)), int(rng.integers(1_000, 4_000))
    shapes = [
        ChunkShape(0, (a,)),
        ChunkShape(0, (s0,), tail=False),
        ChunkShape(s0, (s1,), tail=True),
        ChunkShape(0, (b,)),
    ]
    families = [[0], [1, 2], [3]]
    budget = tight_budget(cost, int(rng.integers(6_000, 14_000)))
    cost = small_cost(pp=pp, sp=2, budget=budget)
    ids, schedule = unit_schedule(families, pp)
    return build_problem([shapes[k] for k in ids], schedule, cost, cost.layers_per_stage), schedule


@pytest.mark.parametrize("seed", range(6))
def test_milp_matches_brute_force_on_real_units(seed):
    problem, _ = _unit_problem(seed)
    assert problem.n_vars == 5 and problem.max_layers == 4  # 5^5 = 3125 points
    expected = brute_force(problem)
    sol = solve(problem, SolverOptions(time_limit_s=5.0, deterministic_time=10.0))
    if expected is None:
        assert sol.source == "infeasible"
    else:
        assert sol.source in ("cp-sat", "trivial")
        assert problem.objective_us(sol.values) == expected
        assert problem.feasible(sol.values)


@pytest.mark.parametrize("seed", range(20))
def test_milp_matches_brute_force_on_random_problems(seed):
    rng = np.random.default_rng(100 + seed)
    n_vars, max_layers, n_rows = int(rng.integers(2, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 5))
    rows = rng.integers(0, 50, size=(n_rows, n_vars))
    base = rng.integers(50, 400, size=n_rows)
    cap = rng.integers(50, 300, size=n_rows)
    problem = CkptProblem(
        var_of=np.zeros((1, 1), dtype=np.int64),
        rows=rows,
        base=base,
        cap=cap,
        row_stage=np.zeros(n_rows, dtype=np.int64),
        weight_us=rng.integers(1, 20, size=n_vars),
        max_layers=max_layers,
    )
    expected = brute_force(problem)
    sol = solve(problem, SolverOptions(time_limit_s=5.0, deterministic_time=10.0))
    if expected is None:
        assert sol.source == "infeasible" and greedy(problem) is None
    else:
        assert sol.feasible and problem.objective_us(sol.values) == expected
        g = greedy(problem)
        assert g is not None and problem.feasible(g) and problem.objective_us(g) >= expected


def test_fallback_is_used_when_the_solver_gets_no_time():
    for seed in range(6):
        problem, _ = _unit_problem(seed)
        if greedy(problem) is not None and not problem.feasible(np.zeros(problem.n_vars, dtype=np.int64)):
            break
    else:
        pytest.fail("no instance needing recomputation")
    sol = solve(problem, SolverOptions(time_limit_s=0.0))
    assert sol.source == "greedy" and "no time" in sol.status
    assert problem.feasible(sol.values)
    assert sol.cost_s > 0


def test_ckpt_table_follows_eq16_diagonals():
    problem, schedule = _unit_problem(1, pp=4)
    c = np.arange(problem.n_vars, dtype=np.int64) % (problem.max_layers + 1)
    from jvarlen.plan.checkpointing import ckpt_table

    table = ckpt_table(problem, c)  # [n, pp]
    for p in range(schedule.pp):
        for rank, k in enumerate(schedule.backward_order(p)):
            # Eq. 15/16: stage p's rank-th backward uses C[rank + d_p - 1 - p] (p 0-based).
            assert table[k, p] == c[rank + schedule.pp - 1 - p]


@pytest.mark.parametrize("pp", [2, 4])
def test_windows_are_eq7_sized(pp):
    _, schedule = _unit_problem(0, pp=pp)  # families [0], [1, 2], [3]: N_prefill = 2, n = 4
    for p in range(pp):
        sizes = [len(w) for w in live_windows(schedule.stages[p])]
        assert max(sizes) == min(4, pp - 1 - p + 2)  # Eq. 7 with p 0-based
