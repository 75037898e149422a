"""The planner's memos change no result: the checkpointing constraints against the windows they
encode, the memoised tick tables against a fresh computation, warm cost models against fresh ones."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import small_cost
from hypothesis import given, settings
from hypothesis import strategies as st
from schedule_strategies import schedules

from jvarlen.plan.buffers import plan_tick_rows, plan_ticks
from jvarlen.plan.checkpointing import KIB, MemoryTable, build_problem
from jvarlen.plan.chunk import ChunkShape, executor_bucket
from jvarlen.plan.cost import CostModel
from jvarlen.plan.memo import BoundedMemo
from jvarlen.plan.schedule import Schedule, paired_ticks
from jvarlen.plan.simulator import simulate
from jvarlen.plan.units import backward_rank, backward_windows, unit_schedule


def _random_unit(seed: int, pp: int):
    rng = np.random.default_rng(seed)
    n_fams = int(rng.integers(1, 6))
    families, shapes = [], []
    for _ in range(n_fams):
        if rng.random() < 0.4:  # a document split in two slices
            s0, s1 = (int(x) for x in rng.integers(500, 4000, size=2))
            families.append([len(shapes), len(shapes) + 1])
            shapes += [ChunkShape(0, (s0,), tail=False), ChunkShape(s0, (s1,), tail=True)]
        else:
            families.append([len(shapes)])
            shapes.append(ChunkShape(0, tuple(int(x) for x in rng.integers(100, 3000, size=int(rng.integers(1, 4))))))
    return families, shapes


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_checkpointing_constraints_are_the_live_windows(seed, pp):
    """Every row of Eq. 19 as built is the window it stands for, summed chunk by chunk: the chunks
    live at a backward each add their stored bytes (``I``) to the base and their freed bytes per
    recomputed layer (``F``) at their Eq. 16 variable; the backward adds its working memory."""
    families, shapes = _random_unit(seed, pp)
    cost = small_cost(pp=pp, sp=2)
    ids, schedule = unit_schedule(families, pp)
    unit = [shapes[k] for k in ids]
    layers = cost.layers_per_stage
    problem = build_problem(unit, schedule, cost, layers)
    table = MemoryTable.build(unit, cost, layers)
    rows, base, stages = [], [], []
    for p in range(pp):
        rank = backward_rank(schedule.stages[p])
        for window, b in backward_windows(schedule.stages[p]):
            row = np.zeros(problem.n_vars, np.int64)
            total = math.ceil(table.work[0, b] / KIB)
            for k in window:
                row[rank[k] + pp - 1 - p] += math.floor((table.act0[p, k] - table.act1[p, k]) / KIB)
                total += math.ceil(table.act0[p, k] / KIB)
            rows.append(row)
            base.append(total)
            stages.append(p)
    np.testing.assert_array_equal(problem.rows, np.array(rows, np.int64).reshape(-1, problem.n_vars))
    np.testing.assert_array_equal(problem.base, np.array(base, np.int64))
    np.testing.assert_array_equal(problem.row_stage, np.array(stages, np.int64))
    assert problem.rows.dtype == problem.base.dtype == problem.remat_rows.dtype == np.int64


@settings(max_examples=40, deadline=None)
@given(schedules(), st.integers(0, 2**31 - 1), st.booleans())
def test_memoised_tick_tables_are_the_fresh_ones_and_read_only(sched, seed, fuse):
    rng = np.random.default_rng(seed)
    ckpt = rng.integers(0, 2, size=(sched.n_chunks, sched.pp))
    fresh = paired_ticks(sched, fuse_last=fuse, keep=ckpt[:, -1] > 0)
    twin = Schedule(tuple(tuple(p) for p in sched.stages), tuple(sched.chunk_prev))  # equal, not the same
    first, again = plan_ticks(sched, ckpt, fuse), plan_ticks(twin, ckpt.copy(), fuse)
    np.testing.assert_array_equal(first, fresh)
    assert again is first  # by value
    assert plan_tick_rows(twin, ckpt, fuse) == tuple(
        tuple(tuple(tuple(lane) for lane in stage) for stage in row) for row in fresh.tolist()
    )
    with pytest.raises(ValueError):
        first[0, 0, 0, 0] = 0  # a shared table cannot be changed by one caller under another
    other = ckpt.copy()
    other[:, -1] = 1 - other[:, -1]
    np.testing.assert_array_equal(plan_ticks(sched, other, fuse), paired_ticks(sched, fuse, other[:, -1] > 0))


@pytest.mark.parametrize("mode", ["async", "ticks", "paired"])
def test_a_warm_cost_model_simulates_as_a_fresh_one(mode):
    """The cost model's memos (padded copies per bucket, all-to-all and P2P terms, per-op durations)
    serve many simulations: each gives what a fresh model gives."""
    warm = small_cost(pp=2, sp=2)
    for seed in range(6):
        families, shapes = _random_unit(seed, 2)
        ids, schedule = unit_schedule(families, 2)
        unit = [shapes[k] for k in ids]
        ckpt = np.random.default_rng(seed).integers(0, warm.layers_per_stage + 1, size=(len(unit), 2))
        fresh = CostModel(warm.model, warm.layout, warm.coeffs)
        a, b = simulate(schedule, unit, ckpt, warm, mode), simulate(schedule, unit, ckpt, fresh, mode)
        assert a.iteration_time == b.iteration_time and np.array_equal(a.peak_memory, b.peak_memory)
        assert [(e.kind, e.start, e.end) for e in a.events] == [(e.kind, e.start, e.end) for e in b.events]
    bucket = executor_bucket(max(c.tokens for c in unit), 2)
    assert (warm.padded(bucket) if mode == "paired" else warm).op_terms  # the memo is used
    assert warm.padded(bucket) is warm.padded(bucket)


def test_bounded_memo_empties_when_full():
    memo = BoundedMemo(limit=3)
    for k in range(3):
        assert memo.put(k, -k) == -k
    assert dict(memo) == {0: 0, 1: -1, 2: -2}
    memo.put(3, -3)
    assert dict(memo) == {3: -3}
