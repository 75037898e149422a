"""Hydraulis packing within a pipeline (Eq. 1 with App. C's V range) against brute force."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jvarlen.plan.hydraulis_costs import SchemeTable, build_table
from jvarlen.plan.hydraulis_pack import PackOptions, pack, pipeline_time
from jvarlen.plan.strategy import Scheme, SchemeCosts

EXACT = PackOptions(gap=0.0, time_limit_s=10.0, deterministic_time=10.0, max_solves=64)


def table(pp=2, a=1e-8, b=1e-5, c=3e-3, caps=(4000, 9000, 20000), util=500, ra=2e-9, rb=3e-6, rc=1e-3, steady=1.0):
    """A hand-made scheme table: T(l) = a l² + b l + c, caps[r] tokens with r recomputed layers."""
    caps = np.asarray(caps, dtype=np.int64)
    return SchemeTable(Scheme(pp, 1), a, b, c, ra, rb, rc, caps, int(caps[-1]), util, 0.0, 0.0, steady)


def set_partitions(items):
    """Every partition of ``items`` into nonempty blocks (restricted growth strings)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first]] + part
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1 :]


def brute_force(lengths, t: SchemeTable, prune: bool, objective: str = "sum") -> float:
    """Eq. 1 by enumerating every packing: documents above caps[0] alone, the rest partitioned into
    V' micro-batches within capacity, V' over App. C's range raised to first-fit decreasing's worst
    case (every micro-batch but one more than half full)."""
    short = [i for i, x in enumerate(lengths) if x <= t.cap0]
    long = [[i] for i, x in enumerate(lengths) if x > t.cap0]
    tot = sum(lengths[i] for i in short)
    if short:
        lo = max(1, math.ceil(tot / t.cap0))
        hi = min(len(short), tot // t.util_len) if prune else len(short)
        hi = max(lo, hi, min(len(short), math.ceil(2 * tot / t.cap0)))
    else:
        lo = hi = 0
    best = math.inf
    for part in set_partitions(short):
        if not lo <= len(part) <= hi:
            continue
        if any(sum(lengths[i] for i in g) > t.cap0 for g in part):
            continue
        best = min(best, pipeline_time(lengths, part + long, t, objective))
    return best


def check_packing(lengths, t, result, objective="sum"):
    covered = sorted(i for mb in result.micro_batches for i in mb)
    assert covered == list(range(len(lengths)))
    for mb in result.micro_batches:
        assert len(mb) == 1 or sum(lengths[i] for i in mb) <= t.cap0
    assert result.objective_s == pytest.approx(pipeline_time(lengths, result.micro_batches, t, objective), rel=1e-12)
    assert result.lower_bound_s <= result.objective_s * (1 + 1e-9)


@pytest.mark.parametrize("objective", ["eq1", "sum"])
@pytest.mark.parametrize("prune", [True, False])
@pytest.mark.parametrize("seed", range(10))
def test_pack_equals_brute_force(seed, prune, objective):
    rng = np.random.default_rng(seed)
    pp = int(rng.choice([1, 2, 4]))
    steady = 1.0 if pp == 1 else float(rng.choice([1.0, 4 / 3]))  # the paper's 1F1B, jvarlen's lock-step
    t = table(pp=pp, c=float(rng.choice([1e-4, 3e-3, 2e-2])), util=int(rng.choice([1, 300, 2000])), steady=steady)
    n = int(rng.integers(1, 8))
    lengths = [int(x) for x in np.exp(rng.uniform(np.log(50), np.log(12000), size=n))]
    result = pack(lengths, t, dataclasses.replace(EXACT, prune=prune, objective=objective))
    check_packing(lengths, t, result, objective)
    assert result.source in ("ilp", "lpt", "trivial")
    assert result.objective_s == pytest.approx(brute_force(lengths, t, prune, objective), rel=1e-6)


def test_pack_uses_capacity_and_recomputation():
    """A document above caps[0] runs alone with the layers its tokens need; the rest fit the capacity."""
    t = table(pp=2, caps=(4000, 9000, 20000))
    lengths = [15000, 3000, 2500, 1000, 800, 600]
    result = pack(lengths, t, EXACT)
    check_packing(lengths, t, result)
    assert (0,) in result.micro_batches
    assert int(t.recompute_layers(15000)) == 2 and int(t.recompute_layers(3000)) == 0
    assert result.objective_s == pytest.approx(brute_force(lengths, t, True), rel=1e-6)
    with pytest.raises(ValueError, match="exceeds MaxLen"):
        pack([25000], t)


@pytest.mark.parametrize("ilp", [True, False])
def test_pack_finds_room_where_app_c_range_has_none(ilp):
    """A per-micro-batch constant so large that UtilLen exceeds the tokens leaves App. C's range at
    ⌈Σl / cap⌉ = 3 micro-batches, which no packing reaches (550 + 300 + 300 > 1000): the packing is
    the fewest micro-batches that hold them (4), not every document alone (7)."""
    t = table(pp=2, c=0.5, caps=(1000, 2000), util=10**9)
    lengths = [550, 550, 550, 300, 300, 300, 300]
    result = pack(lengths, t, dataclasses.replace(EXACT, ilp=ilp))
    check_packing(lengths, t, result)
    assert result.source in ("ilp", "lpt")
    assert result.V == 4
    assert result.objective_s == pytest.approx(brute_force(lengths, t, True), rel=1e-6)
    assert result.objective_s < pipeline_time(lengths, [[i] for i in range(7)], t) - 1.0


def test_pack_lpt_only_and_limits_fall_back():
    rng = np.random.default_rng(3)
    t = table(pp=4, c=1e-4, util=1)
    lengths = [int(x) for x in rng.integers(100, 3000, size=40)]
    lpt = pack(lengths, t, PackOptions(ilp=False))
    check_packing(lengths, t, lpt)
    assert lpt.source == "lpt" and lpt.solves == 0
    # a solver with (almost) no time: the LPT packing stays, the limit is reported
    tight = pack(lengths, t, PackOptions(gap=0.0, deterministic_time=1e-6, time_limit_s=1e-3, max_solves=1))
    check_packing(lengths, t, tight)
    assert tight.objective_s <= lpt.objective_s * (1 + 1e-12)
    assert tight.source in ("ilp-limit", "ilp", "lpt")
    if tight.source == "ilp-limit":
        assert tight.events


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 20000), min_size=1, max_size=30), st.sampled_from([1, 2, 8]))
def test_pack_is_valid_and_deterministic(lengths, pp):
    t = table(pp=pp, caps=(4000, 9000, 20000))
    a = pack(lengths, t, PackOptions())
    check_packing(lengths, t, a)
    b = pack(lengths, t, PackOptions())
    assert a.micro_batches == b.micro_batches and a.objective_s == b.objective_s


def test_tables_match_the_cost_model():
    """App. B: the fitted T equals SchemeCosts.T for an analytic profile; caps hold in the simulator's memory."""
    from conftest import small_cost

    costs = SchemeCosts(small_cost(pp=1, sp=1, budget=8e9), 8)
    for scheme in (Scheme(1, 1), Scheme(2, 2), Scheme(4, 1)):
        t = build_table(costs, scheme)
        assert t.steady == 1.0
        assert build_table(costs, scheme, simulation="ticks").steady == (
            1.0 if scheme.pp == 1 else pytest.approx(4 / 3, rel=0.1)
        )
        for x in (64, 1000, 9000):
            assert float(t.T(x)) == pytest.approx(costs.T(x, scheme), rel=1e-9)
            r = int(t.recompute_layers(x))
            if r < len(t.caps):
                assert float(t.micro_batch_time(x * x, x)) == pytest.approx(
                    costs.micro_batch_time([x], scheme, r), rel=1e-9
                )
        assert np.all(np.diff(t.caps) >= 0) and t.max_len == t.caps[-1]
        assert t.max_len >= costs.max_len(scheme)  # 1F1B holds pp - p micro-batches on stage p, not pp
