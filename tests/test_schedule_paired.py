"""Properties of the executor's paired tick table (:func:`jvarlen.plan.schedule.paired_ticks`) on
random valid schedules: every op runs exactly once, after its dependencies, in the right lane;
no stage holds more chunks in flight than its own program (the single-op table's memory bound);
no buffer needs more slots than the program's window allows; never more ticks than one op per tick."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from schedule_strategies import schedules

from jvarlen.plan import schedule as sch
from jvarlen.plan.buffers import assign_slots
from jvarlen.plan.schedule import BWD, FUSED, FWD, IDLE, LANE_B, LANE_F, Op, Schedule


def program_window(sched: Schedule, p: int) -> int:
    """Most chunks stage p holds between their F and B when it runs its program in order."""
    live = best = 0
    for op in sched.stages[p]:
        live += 1 if op.kind == "F" else -1
        best = max(best, live)
    return best


def in_flight_peaks(table: np.ndarray, pp: int) -> list[int]:
    """Per stage, the most chunks with F done and B not done at any lane of any tick."""
    peaks = []
    for p in range(pp):
        live = best = 0
        for t in range(table.shape[0]):
            for lane in (LANE_B, LANE_F):  # lane 0 runs first
                code = int(table[t, p, lane, 0])
                if code == FWD:
                    live += 1
                elif code == BWD:
                    live -= 1
                best = max(best, live + (code == FUSED))  # a fused op holds its chunk while it runs
        assert live == 0
        peaks.append(best)
    return peaks


@settings(max_examples=300, deadline=None)
@given(schedules(), st.booleans())
def test_paired_ticks_run_every_op_once_after_its_dependencies_within_the_window(sched, fuse):
    table = sch.paired_ticks(sched, fuse_last=fuse)
    sch.check_paired_table(table, sched)  # every op once, lanes right, dependencies respected
    assert not (table[..., 0] == IDLE).all(axis=(1, 2)).any()  # no empty tick
    if not fuse:
        assert not (table[..., 0] == FUSED).any()
    assert (table[:, : sched.pp - 1, :, 0] != FUSED).all()  # fused ops only on the last stage
    if fuse:  # every last-stage F directly followed by its B is fused, none run alone
        last = sched.stages[-1]
        fusable = {f.chunk for f, b in zip(last, last[1:]) if f.kind == "F" and b == Op("B", f.chunk)}
        fused = set(table[:, -1, LANE_B, 1][table[:, -1, LANE_B, 0] == FUSED].tolist())
        assert fused == fusable
    # memory: no stage holds more chunks in flight than its program does
    for p, peak in enumerate(in_flight_peaks(table, sched.pp)):
        assert peak <= program_window(sched, p), (p, peak)
    # never slower in ticks than one op per stage and tick
    assert table.shape[0] <= sched.to_ticks().shape[0]


@settings(max_examples=150, deadline=None)
@given(schedules(), st.integers(0, 2**31 - 1))
def test_paired_slots_stay_within_the_program_window(sched, seed):
    """Slots follow the window: residual slots per stage never exceed what the program holds in
    flight times the stored layers, stash and cotangent inboxes never exceed the number of chunks
    in flight on the stage or its neighbour."""
    n, pp, ls = sched.n_chunks, sched.pp, 2
    ckpt = np.random.default_rng(seed).integers(0, ls + 1, size=(n, pp)).astype(np.int32)
    slots = assign_slots(sch.paired_ticks(sched), sched.chunk_prev, ckpt, ls)
    window = max(program_window(sched, p) for p in range(pp))
    assert slots.n_res <= window * ls
    assert slots.n_stash <= window and slots.n_grad <= window


@settings(max_examples=100, deadline=None)
@given(schedules(), st.integers(0, 2**31 - 1))
def test_kept_chunks_are_never_fused(sched, seed):
    keep = np.random.default_rng(seed).random(sched.n_chunks) < 0.5
    table = sch.paired_ticks(sched, keep=keep)
    sch.check_paired_table(table, sched)
    fused = table[:, -1, LANE_B, 1][table[:, -1, LANE_B, 0] == FUSED]
    assert not keep[fused].any()


@settings(max_examples=150, deadline=None)
@given(schedules(), st.integers(0, 2**31 - 1))
def test_only_fusable_chunks_kept_apart_change_the_table(sched, seed):
    """``Schedule.fusable`` are the chunks the last stage fuses where none is kept, and keeping a
    chunk apart that is not fusable leaves the table as it is (the executor-memory repair keys its
    tick tables by the fusable chunks kept apart)."""
    table = sch.paired_ticks(sched)
    fused = set(table[:, -1, LANE_B, 1][table[:, -1, LANE_B, 0] == FUSED].tolist())
    assert fused == {k for k, f in enumerate(sched.fusable) if f}
    keep = np.random.default_rng(seed).random(sched.n_chunks) < 0.5
    assert np.array_equal(
        sch.paired_ticks(sched, keep=keep), sch.paired_ticks(sched, keep=keep & np.array(sched.fusable))
    )
