"""Eq. 14: the grouping DP against brute force over all groupings of family-size levels."""

import itertools
import math

import pytest
from conftest import small_cost, tight_budget

from jvarlen.plan.checkpointing import SolverOptions
from jvarlen.plan.grouping import group, solve_range, warmup_cost
from jvarlen.plan.sequence_processor import chunk_batch
from jvarlen.plan.units import families_of

OPTS = SolverOptions(time_limit_s=5.0, deterministic_time=10.0)


def _instance(budget_tokens: int):
    cost = small_cost(pp=2, sp=2)
    cost = small_cost(pp=2, sp=2, budget=tight_budget(cost, budget_tokens))
    lengths = [24_000, 19_000, 15_000, 9_000, 5_000, 3_000, 2_500, 1_200, 800, 600]
    chunks = chunk_batch(lengths, cost, 4).chunks
    shapes = [c.shape(lengths) for c in chunks]
    return cost, shapes, families_of(chunks, lengths)


def brute_force(families, shapes, cost, delta):
    """min over every split of the sorted size levels into consecutive groups of Σ (δ + T_ckpt)."""
    sizes = sorted({len(f) for f in families})
    best = math.inf
    for cuts in itertools.product([False, True], repeat=len(sizes) - 1):
        groups, cur = [], [sizes[0]]
        for s, cut in zip(sizes[1:], cuts):
            if cut:
                groups.append(cur)
                cur = []
            cur.append(s)
        groups.append(cur)
        total = 0.0
        for g in groups:
            units = solve_range(
                [f for f in families if len(f) in g], shapes, cost, cost.layout.pp, cost.layers_per_stage, OPTS
            )
            total += math.inf if units is None else sum(delta + u.ckpt.cost_s for u in units)
        best = min(best, total)
    return best


@pytest.mark.parametrize("budget_tokens", [14_000, 18_000, 20_000, 24_000, 32_000])
def test_dp_matches_brute_force(budget_tokens):
    cost, shapes, families = _instance(budget_tokens)
    assert len({len(f) for f in families}) == 4  # four size levels: 8 groupings
    delta = warmup_cost(shapes, cost, cost.layout.pp)
    expected = brute_force(families, shapes, cost, delta)
    if math.isinf(expected):
        with pytest.raises(ValueError):
            group(families, shapes, cost, cost.layout.pp, cost.layers_per_stage, OPTS)
        return
    result = group(families, shapes, cost, cost.layout.pp, cost.layers_per_stage, OPTS)
    assert result.cost_s == pytest.approx(expected, rel=1e-12)
    # Every chunk lands in exactly one unit.
    ids = sorted(k for u in result.units for k in u.chunk_ids)
    assert ids == list(range(len(shapes)))


def test_grouping_trades_recomputation_for_more_pipelines():
    # With a tiny δ, splitting levels into more units (less recomputation) must not cost more
    # than one unit; with a huge δ everything goes into one unit.
    cost, shapes, families = _instance(32_000)
    cheap = group(families, shapes, cost, cost.layout.pp, cost.layers_per_stage, OPTS, delta=1e-9)
    dear = group(families, shapes, cost, cost.layout.pp, cost.layers_per_stage, OPTS, delta=1e6)
    assert len(dear.units) == 1 and dear.units[0].ckpt.cost_s > 0
    assert len(cheap.units) > 1
    assert sum(u.ckpt.cost_s for u in cheap.units) < dear.units[0].ckpt.cost_s


@pytest.mark.parametrize("budget_tokens", [14_000, 20_000, 32_000])
def test_a_memoised_range_is_the_range_solved_afresh(budget_tokens):
    # group() shares one memo over its ranges and their halves: a hit must be what a fresh solve
    # gives, whatever order the families come in (a unit depends on their set only).
    cost, shapes, families = _instance(budget_tokens)
    args = (shapes, cost, cost.layout.pp, cost.layers_per_stage, OPTS)
    memo, split = {}, False
    assert len(families) == 5
    for fams in (families, families[:3], families[2:]):
        first = solve_range(fams, *args, memo=memo)
        split = split or first is None or len(first) > 1
        assert solve_range(list(reversed(fams)), *args, memo=memo) is first
        fresh = solve_range(list(reversed(fams)), *args)
        assert (fresh is None) == (first is None)
        for a, b in zip(fresh or [], first or [], strict=True):
            assert (a.families, a.chunk_ids, a.schedule) == (b.families, b.chunk_ids, b.schedule)
            assert a.ckpt.values.tolist() == b.ckpt.values.tolist() and a.ckpt.cost_s == b.ckpt.cost_s
    # the halves of a range that does not fit as one unit are kept too
    assert len(memo) > 3 if split else len(memo) == 3
