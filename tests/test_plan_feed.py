"""IterationFeed: iterations sampled ahead and planned in the background give the same plans
as inline planning, checkpoint the data position of the step (not of the sampler's
look-ahead), and fall back to a fast plan (logged) when the solver is late."""

import functools
import json

import numpy as np
import pytest
from conftest import small_cost

from jvarlen.config import DataConfig
from jvarlen.data import DataPipeline
from jvarlen.data.packer import Piece, place
from jvarlen.layout import Layout
from jvarlen.plan.api import PlannerOptions, plan_iteration
from jvarlen.plan.service import PlanningService, deterministic_options
from jvarlen.runtime.feed import IterationFeed, split_by_rows
from jvarlen.runtime.strategy import Planner

OPTS = deterministic_options(PlannerOptions(n_candidates=2))
LAYOUT = Layout(dp=2, pp=2, sp=1)


def _pipeline(cache):
    # a stdlib subset: real long-tailed lengths, pieces up to 1024 tokens, 4 rows per batch
    config = DataConfig(source="stdlib", max_documents=40, seq_len=1024, tokens_per_batch=4096, cache_dir=str(cache))
    return DataPipeline(config, vocab_size=320)


def PlanFeed(pipeline, layout, cost, policy, options, start, end, *, ahead, wait=False, service=None, say=None):
    """The pipeline strategy's feed: one plan per dp group of rows, solved inline or by ``service``."""
    if service is None and ahead > 0:
        service = PlanningService(cost, policy, options)
    solve = functools.partial(plan_iteration, cost=cost, policy=policy, options=options)
    planner = Planner(split_by_rows(layout.dp, pipeline.rows), solve, service, wait)
    feed = IterationFeed(pipeline, planner, start, end, ahead=ahead, say=say or (lambda _: None))
    feed.close = service.close if service is not None else (lambda: None)
    return feed


def _strip(plan) -> str:
    data = plan.to_json()
    for key in ("solve_seconds", "simulate_seconds", "service_source"):
        data["stats"].pop(key, None)
    return json.dumps(data, sort_keys=True)


def _drain(feed, steps):
    out = [feed.next() for _ in range(steps)]
    feed.close()
    return out


def test_background_plans_equal_inline_plans_and_states_follow_the_step(corpus_cache):
    cost = small_cost(pp=2, sp=1)
    inline = _drain(PlanFeed(_pipeline(corpus_cache), LAYOUT, cost, "epp", OPTS, 0, 4, ahead=0), 4)
    ahead = _drain(PlanFeed(_pipeline(corpus_cache), LAYOUT, cost, "epp", OPTS, 0, 4, ahead=2, wait=True), 4)
    reference = _pipeline(corpus_cache)
    for a, b in zip(inline, ahead):
        assert a.step == b.step and b.fallbacks == 0 and len(b.plans) == LAYOUT.dp
        assert [_strip(p) for p in a.plans] == [_strip(p) for p in b.plans]
        reference.sampler.next()
        # the checkpointed position is the one right after this step's sample, although the
        # background feed had already sampled up to two iterations further
        assert a.data_state == b.data_state == reference.state()
    with pytest.raises(StopIteration):
        PlanFeed(_pipeline(corpus_cache), LAYOUT, cost, "epp", OPTS, 3, 3, ahead=0).next()


def test_late_solver_gives_logged_fallback_plans_after_the_first_iteration(corpus_cache):
    cost = small_cost(pp=2, sp=1)
    said = []
    with PlanningService(cost, "epp", OPTS, delay_s=2.0) as slow:
        feed = PlanFeed(
            _pipeline(corpus_cache), LAYOUT, cost, "epp", OPTS, 0, 3, ahead=1, service=slow, say=said.append
        )
        first, second = feed.next(), feed.next()
    assert first.fallbacks == 0 and first.plan_s >= 2.0  # the first iteration waits for the solver
    assert second.fallbacks == LAYOUT.dp and second.plan_s < 2.0  # later ones never do
    assert all(p.stats["service_source"] == "fallback:late" for p in second.plans)
    assert sum("late" in line for line in said) == LAYOUT.dp
    # the service names a plan by its step (before: a key step * 1024 + plan, which plan 1024 of a
    # step shared with plan 0 of the next)
    assert [str(e.iteration) for e in slow.events] == ["step 2 plan 0", "step 2 plan 1"]
    lengths = [[len(d.tokens) for d in docs] for docs in second.groups]
    for plan, lens in zip(second.plans, lengths):
        plan.validate(lens)


def test_a_plan_over_the_memory_budget_is_reported(corpus_cache):
    """A policy that finds no candidate within the budget keeps the fastest and says so in the plan;
    the feed says it in the run's log, where an out-of-memory error would follow."""
    cost = small_cost(pp=2, sp=1)

    def over_budget(lengths):
        plan = plan_iteration(lengths, cost=cost, policy="epp", options=OPTS)
        plan.stats["fits_memory"] = False
        plan.events.append("p: none of 1 candidate(s) fits memory by the planner's account; kept the fastest")
        return plan

    said = []
    planner = Planner(split_by_rows(LAYOUT.dp, 4), over_budget, None, False)
    IterationFeed(_pipeline(corpus_cache), planner, 0, 1, ahead=0, say=said.append).next()
    assert said == [
        f"[jvarlen] step 1 plan {g}: over the memory budget by the planner's account (p: none of 1 candidate(s) "
        "fits memory by the planner's account; kept the fastest); the step may run out of device memory"
        for g in range(LAYOUT.dp)
    ]


def test_split_by_rows_leaves_no_pipeline_without_documents():
    """An epoch's last batch: best fit fills the first rows, so the last pipelines would get nothing.
    Every piece still goes to exactly one pipeline, none is left empty while another holds two, and
    with fewer pieces than pipelines the rest run an idle piece (no target)."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        dp, rows_per_dp = int(rng.choice([2, 4])), int(rng.integers(1, 3))
        rows = dp * rows_per_dp
        lengths = rng.integers(1, 65, size=int(rng.integers(1, 9)))
        placement = place(lengths, rows, 64)
        lengths, placement = lengths[placement >= 0], placement[placement >= 0]  # what the sampler hands on
        pieces = [Piece(np.full(n, i, np.int32), i, -1) for i, n in enumerate(lengths)]
        groups = split_by_rows(dp, rows)(pieces, placement)
        real = [p.doc_id for g in groups for p in g if p.doc_id >= 0]
        assert sorted(real) == list(range(len(pieces))), trial
        assert all(groups), trial
        for g in groups:
            assert sum(len(p.tokens) for p in g) <= rows_per_dp * 64 or len(g) == 1
        idle = [p for g in groups for p in g if p.doc_id < 0]
        assert len(idle) == max(0, dp - len(pieces)), trial
        assert all(len(p.tokens) == 1 and p.next_token == -1 and len(g) == 1 for g in groups for p in g if p.doc_id < 0)
