"""Hypothesis strategies of valid pipeline schedules, shared by the schedule and simulator tests."""

from __future__ import annotations

from hypothesis import strategies as st

from jvarlen.plan import schedule as sch
from jvarlen.plan.schedule import Schedule, ScheduleError


@st.composite
def chunk_links(draw, max_chunks=9):
    """chunk_prev of random documents split into consecutive slices (chunk_prev[k] < k)."""
    n = draw(st.integers(1, max_chunks))
    prev, k = [], 0
    while k < n:
        slices = draw(st.integers(1, n - k))
        prev += [-1] + [k + i for i in range(slices - 1)]
        k += slices
    return prev


@st.composite
def schedules(draw):
    """A valid schedule: GPipe, token-level 1F1B or either with random adjacent swaps of one
    stage's program that keep it valid (arbitrary warm-ups, backwards overtaking forwards...)."""
    prev = draw(chunk_links())
    pp = draw(st.integers(1, 4))
    base = sch.gpipe(len(prev), pp, prev) if draw(st.booleans()) else sch.token_level_1f1b(prev, pp)
    stages = [list(p) for p in base.stages]
    for _ in range(draw(st.integers(0, 30))):
        p = draw(st.integers(0, pp - 1))
        i = draw(st.integers(0, len(stages[p]) - 2))
        stages[p][i], stages[p][i + 1] = stages[p][i + 1], stages[p][i]
        cand = Schedule(tuple(map(tuple, stages)), tuple(prev))
        try:
            cand.validate()
        except ScheduleError:
            stages[p][i], stages[p][i + 1] = stages[p][i + 1], stages[p][i]  # undo
    sched = Schedule(tuple(map(tuple, stages)), tuple(prev))
    sched.validate()
    return sched
