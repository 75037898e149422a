"""Hydraulis strategy proposal (Eq. 4): the threshold-form DP against brute force; rounding; cache."""

import math

import numpy as np
import pytest

from jvarlen.plan.hydraulis_costs import SchemeTable
from jvarlen.plan.hydraulis_proposal import (
    DPProblem,
    ProposalOptions,
    bin_corpus,
    cached_proposal,
    extract_strategy,
    length_edges,
    proposal_key,
    propose_strategies,
    round_counts,
    solve_thresholds,
)
from jvarlen.plan.strategy import Scheme, SchemeCosts


def table(pp, sp, a, b, c, max_len):
    caps = np.array([max_len // 2, max_len], dtype=np.int64)
    return SchemeTable(Scheme(pp, sp), a, b, c, 0.0, 0.0, 0.0, caps, max_len, 1, 0.0, 0.0)


TABLES = [  # a fast scheme for short documents and a slow one that holds the long ones
    table(1, 1, 2e-8, 1e-5, 1e-3, 3000),
    table(2, 2, 6e-9, 4e-6, 2e-3, 20000),
    table(1, 4, 3e-9, 3e-6, 3e-3, 20000),
]


def brute_force(problem: DPProblem, n: float, step: float, last: int) -> float:
    """Eq. 4's problem for bins (0, last] by enumerating every split of the bins into contiguous
    intervals and every (scheme, pipelines) of each interval within n devices."""
    K = problem.devices.size
    best = math.inf

    def latency(k, a, b, d):
        s = problem.scale[last] * problem.intervals[k, a, b]
        if not np.isfinite(s):
            return math.inf
        return max(s / d, problem.floor[k, b]) + problem.extra[k, b]

    def rec(a, left, worst):
        nonlocal best
        if worst >= best:
            return
        if a == last:
            best = worst
            return
        for b in range(a + 1, last + 1):
            for k in range(K):
                d = step
                while d * problem.devices[k] <= left + 1e-9:
                    rec(b, left - d * problem.devices[k], max(worst, latency(k, a, b, d)))
                    d += step

    rec(0, n, 0.0)
    return best


def tiny_problem(seed, pipeline_term):
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(100), np.log(15000), size=60)).astype(np.int64)
    tables = TABLES[: 2 + seed % 2]
    edges = np.array([500, 2000, 3000, 20000])
    data = bin_corpus(lengths, tables, edges)
    devices = [t.scheme.num_devices for t in tables]
    scale = 2e4 / np.cumsum(data.tokens)
    if pipeline_term:
        return DPProblem.build(data, devices, scale, [t.pp for t in tables])
    return DPProblem.build(data, devices)


@pytest.mark.parametrize("pipeline_term", [False, True])
@pytest.mark.parametrize("step", [1.0, 0.5])
@pytest.mark.parametrize("seed", range(3))
def test_threshold_dp_equals_brute_force(seed, step, pipeline_term):
    problem = tiny_problem(seed, pipeline_term)
    n = 6.0
    taus = solve_thresholds(problem, n, step)
    for last in range(1, problem.nb + 1):
        expected = brute_force(problem, n, step, last)
        if not np.isfinite(expected):
            assert not np.isfinite(taus[last])
            continue
        assert taus[last] == pytest.approx(expected, rel=1e-8)
        parts = extract_strategy(problem, taus[last], last, step)
        assert parts[0][1] == 0 and parts[-1][2] == last
        assert all(p[2] == q[1] for p, q in zip(parts, parts[1:]))  # contiguous intervals
        assert sum(d * problem.devices[k] for k, _, _, d in parts) <= n + 1e-9
        for k, a, b, d in parts:
            lat = max(problem.scale[last] * problem.intervals[k, a, b] / d, problem.floor[k, b]) + problem.extra[k, b]
            assert lat <= taus[last] * (1 + 1e-9)


def test_round_counts_neighbours_within_devices():
    devices = np.array([1, 2, 4])
    out = round_counts({0: 2.3, 2: 0.4}, devices, n=8, must=2, fill=False)
    assert {0: 2, 2: 1} in out and {0: 3, 2: 1} in out
    for counts in out:
        assert counts.get(2, 0) >= 1 and sum(devices[k] * c for k, c in counts.items()) <= 8
    filled = round_counts({0: 2.3, 2: 0.4}, devices, n=8, must=2, fill=True)
    assert all(sum(devices[k] * c for k, c in counts.items()) == 8 for counts in filled)


def test_length_edges():
    edges = length_edges(32768, bins_per_octave=4)
    assert edges[-1] == 32768 and np.all(np.diff(edges) > 0) and np.all(edges % 128 == 0)
    assert len(edges) <= 4 * 8 + 2


@pytest.fixture(scope="module")
def costs():
    from conftest import small_cost

    return SchemeCosts(small_cost(pp=1, sp=1, budget=6e9), 8)


def test_proposal_holds_the_corpus_and_is_cached(costs, tmp_path, monkeypatch):
    from jvarlen.plan.workloads import GITHUB

    corpus = np.minimum(GITHUB.sample(5000, np.random.default_rng(0)), 16384)
    options = ProposalOptions(max_candidates=10, tokens_per_iteration=50_000)
    out = propose_strategies(corpus, costs, 16384, options)
    assert 1 <= len(out) <= 10 and len(set(out)) == len(out)
    from jvarlen.plan.hydraulis_costs import scheme_tables

    for strategy in out:
        assert sum(s.num_devices for s in strategy) <= 8
        assert max(scheme_tables(costs, strategy)[s].max_len for s in strategy) > 0
    assert any(
        max(scheme_tables(costs, s)[p].max_len for p in s) >= 16384 for s in out
    )  # some candidate holds the longest documents
    first = cached_proposal(tmp_path, corpus, costs, 16384, options)
    assert first == out and len(list(tmp_path.iterdir())) == 1
    assert cached_proposal(tmp_path, corpus, costs, 16384, options) == out
    # sharded stage weights change every scheme's MaxLen: a run with them plans its own candidates
    from jvarlen.plan.cost import CostModel

    base = costs.base
    sharded = SchemeCosts(CostModel(base.model, base.layout, base.coeffs, stage_weights_sharded=True), 8)
    assert proposal_key(corpus, sharded, 16384, options) != proposal_key(corpus, costs, 16384, options)
    assert cached_proposal(tmp_path, corpus, sharded, 16384, options) == propose_strategies(
        corpus, sharded, 16384, options
    )
    assert len(list(tmp_path.iterdir())) == 2
    # an unreadable file (a torn write on a network file system) is proposed again and replaced
    for path in tmp_path.iterdir():
        path.write_text("{not json")
    assert cached_proposal(tmp_path, corpus, costs, 16384, options) == out
    assert sum(p.read_text() != "{not json" for p in tmp_path.iterdir()) == 1 and len(list(tmp_path.iterdir())) == 2
    # a version of the search that proposes otherwise (3: sharded layers' gathers priced) misses old files
    import jvarlen.plan.hydraulis_proposal as hp

    key = proposal_key(corpus, sharded, 16384, options)
    monkeypatch.setattr(hp, "PROPOSAL_VERSION", hp.PROPOSAL_VERSION - 1)
    assert proposal_key(corpus, sharded, 16384, options) != key
