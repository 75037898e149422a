"""EPP refuses at once a document that no slicing can fit (jvarlen.plan.epp.split_memory_bound):
every earlier slice of a split document stays live until the last slice's backward, so the
slices together need a memory no slice count can shrink; the N search is not entered."""

import pytest
from conftest import SHIPPED_CPU_PROFILE, SMALL, tight_budget

from jvarlen.config import Config
from jvarlen.layout import Layout
from jvarlen.plan import epp
from jvarlen.plan.api import PlannerOptions, PlanningError, plan_iteration
from jvarlen.plan.cost import CostCoefficients, CostModel, ModelShape
from jvarlen.plan.hardware import A800, analytic_coefficients
from jvarlen.plan.strategy import SchemeCosts, enumerate_schemes, plan_strategy

SHAPE = ModelShape.from_config(Config().model)
COEFFS = CostCoefficients.load(SHIPPED_CPU_PROFILE)


def tight(cost: CostModel, tokens: int) -> CostModel:
    """``cost`` with the budget of :func:`conftest.tight_budget`."""
    return CostModel(cost.model, cost.layout, cost.coeffs.replace(memory_budget=tight_budget(cost, tokens)))


def cpu_cost(pp: int, sp: int) -> CostModel:
    """The shipped CPU profile, a budget of 4,096 tokens without recomputation."""
    return tight(CostModel(SHAPE, Layout(1, pp, sp), COEFFS), 4096)


@pytest.fixture
def no_search(monkeypatch):
    """Fails a test whose planner chunks a candidate (an N or bucket size of the search)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the N search was entered")

    monkeypatch.setattr(epp, "chunk_candidate", refuse)


def longest_planned_bound(cost: CostModel) -> int:
    """The longest document :func:`epp.split_memory_bound` lets through."""
    lo, hi = 1, 10**9
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if epp.split_memory_bound(mid, cost)[0] <= cost.memory_budget else (lo, mid - 1)
    return lo


def test_epp_refuses_a_document_no_slicing_fits_without_searching(no_search):
    cost = cpu_cost(2, 1)
    length = 40_000  # about twice what any slicing can hold on this budget (before: N = 58 was searched)
    for policy in ("epp", "epp-fast", "wo-ckpt", "full-ckpt"):
        for options in (PlannerOptions(min_slice_tokens=512), PlannerOptions(simulation="paired", n_slices=64)):
            with pytest.raises(PlanningError) as refused:
                plan_iteration([length, 300], cost=cost, policy=policy, options=options)
            message = str(refused.value)
            assert "a document of 40,000 tokens cannot be split into slices that fit memory" in message
            assert "needs at least" in message and f"({cost.memory_budget / 2**30:.2f} GiB per device)" in message
    with pytest.raises(PlanningError, match="40,000 tokens cannot be split .* needs at least"):
        epp.smallest_slices([length, 300], cost, 512)


def test_epp_pipelines_and_auto_skip_every_scheme_at_once(no_search):
    """8 devices (the A800 model at a 4K-token budget), one document 4x longer than any scheme holds unsplit (before:
    epp-pipelines ran each scheme's N search, PlanningError after 108 s, auto after 97 s)."""
    base = CostModel(SMALL, Layout(1, 1, 1), analytic_coefficients(SMALL, A800, num_nodes=1))
    costs = SchemeCosts(tight(base, 4096), 8)
    schemes = list(enumerate_schemes(8, SMALL.num_layers, SMALL.num_heads))
    longest = max(costs.cost(s).max_tokens(in_flight=1, tail=True) for s in schemes)
    lengths = [4 * longest, 100]
    with pytest.raises(PlanningError) as refused:
        plan_strategy("epp-pipelines", lengths, costs)
    message = str(refused.value)
    assert message.startswith("epp-pipelines: no pipeline scheme can plan this batch: (pp=")
    assert message.count(f"a document of {4 * longest:,} tokens cannot be split into slices") == min(
        4, sum(s.pp >= 2 for s in schemes)
    )
    with pytest.raises(PlanningError, match="auto: no policy can plan this batch"):
        plan_strategy("auto", lengths, costs)


@pytest.mark.parametrize("pp, sp", [(1, 1), (2, 1)])
def test_a_document_just_below_the_bound_is_planned_above_it_refused(pp, sp, monkeypatch):
    """The bound is a lower bound: every plan's peak memory is at least it, and the planner plans
    documents within 10 % of it (so it refuses nothing the search could plan)."""
    cost = cpu_cost(pp, sp)
    top = longest_planned_bound(cost)
    assert top > 2 * cost.max_tokens(in_flight=1, tail=True)  # the bound is about split documents
    options = PlannerOptions(min_slice_tokens=512, n_candidates=2)
    for length in (top // 2, int(0.9 * top)):
        plan = plan_iteration([length, 300], cost=cost, policy="epp", options=options)
        assert plan.stats["fits_memory"] and plan.stats["n_slices"] > 1
        assert max(plan.stats["peak_memory_bytes"]) >= epp.split_memory_bound(length, cost)[0]
    monkeypatch.setattr(epp, "chunk_candidate", None)  # refused before the search
    with pytest.raises(PlanningError, match=f"a document of {top + 1:,} tokens cannot be split .* needs at least"):
        plan_iteration([top + 1, 300], cost=cost, policy="epp", options=options)


def test_scan_counts_are_bounded_and_spread_over_the_range():
    assert epp.scan_counts(5, 12, skip={8}) == [5, 6, 7, 9, 10, 11, 12]  # few: every one
    wide = epp.scan_counts(7, 3000, skip={14, 28, 56})
    assert len(wide) == epp.SCAN_COUNTS and wide == sorted(set(wide))
    assert wide[0] == 7 and wide[-1] == 3000 and not {14, 28, 56} & set(wide)
    ratios = [b / a for a, b in zip(wide, wide[1:])]
    assert max(ratios) < 1.5 * (3000 / 7) ** (1 / (epp.SCAN_COUNTS - 1))  # log-spaced, no large gap


def test_epp_finds_a_slice_count_beyond_the_coarse_candidates():
    """Whether an N fits is not monotone near the memory bound: here no coarse candidate fits and
    N = 29-45 do, past the 512-token average slice the scan stopped at before (it refused the batch)."""
    base = CostModel(SHAPE, Layout(1, 2, 2), COEFFS)
    cost = tight(base, 5416)
    options = PlannerOptions(min_slice_tokens=256)
    coarse = epp.slice_candidates([10854], cost, options, "epp")
    plan = plan_iteration([10854], cost=cost, policy="epp", options=options)
    assert all(f"N={n}: infeasible" in " ".join(plan.events) for n in coarse)
    assert plan.stats["fits_memory"] and plan.stats["n_slices"] not in coarse


def test_a_document_no_slice_count_fits_is_refused_after_a_bounded_scan(monkeypatch):
    """Below :func:`epp.split_memory_bound` but fitting no N: refused after the coarse candidates and
    at most ``SCAN_COUNTS`` others (it chunked every N up to the 512-token average slice before: a
    600K-token document on a 7B model took 9 minutes), each told to ``progress``; the error says
    what the document needs."""
    cost = cpu_cost(1, 1)
    length = int(0.99 * longest_planned_bound(cost))
    options = PlannerOptions(min_slice_tokens=16)
    coarse = epp.slice_candidates([length, 300], cost, options, "epp")
    chunked, told = [], []
    chunk = epp.chunk_candidate
    monkeypatch.setattr(epp, "chunk_candidate", lambda *a, **k: chunked.append(a[2]) or chunk(*a, **k))
    with pytest.raises(PlanningError) as refused:
        plan_iteration([length, 300], cost=cost, policy="epp", options=options, progress=told.append)
    assert len(coarse) < len(chunked) <= len(coarse) + epp.SCAN_COUNTS
    assert max(chunked) == length // 16  # the scan reaches the finest average slice
    assert [f"N={n}: does not fit memory" for n in chunked] == [m for m in told if "does not fit" in m]
    message = str(refused.value)
    assert f"longest document {length:,} tokens; tried {len(chunked)} counts from {min(chunked)} to" in message
    assert "GiB per device recomputing every layer, over the budget" in message
