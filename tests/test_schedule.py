"""Schedule tables: builders, token-level dependencies, validation messages, tick form."""

import numpy as np
import pytest

from jvarlen.plan.schedule import (
    BWD,
    FWD,
    IDLE,
    Op,
    Schedule,
    ScheduleError,
    gpipe,
    one_f_one_b,
    sequential,
    token_level_1f1b,
)


def prog(text: str):
    return tuple(Op(t[0], int(t[1:])) for t in text.split())


def test_one_f_one_b_is_dapple_order():
    s = one_f_one_b(4, 3)
    assert s.stages == (
        prog("F0 F1 F2 B0 F3 B1 B2 B3"),
        prog("F0 F1 B0 F2 B1 F3 B2 B3"),
        prog("F0 B0 F1 B1 F2 B2 F3 B3"),
    )


def test_gpipe_order():
    assert gpipe(3, 2).stages == (prog("F0 F1 F2 B2 B1 B0"),) * 2


def test_token_level_backward_reverses_slices_and_window_is_eq7():
    # chunks 0,1,2 are consecutive slices of one document; 3 and 4 are short documents
    prev = [-1, 0, 1, -1, -1]
    pp = 3
    s = token_level_1f1b(prev, pp)
    for p in range(pp):
        assert s.backward_order(p) == [2, 1, 0, 3, 4]
        assert s.forward_order(p) == [0, 1, 2, 3, 4]
        # Eq. 7: at most d_p - p + N_prefill chunks in flight (p 1-indexed) = pp - p - 1 + 3 here
        in_flight, peak = 0, 0
        for op in s.stages[p]:
            in_flight += 1 if op.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(5, pp - p - 1 + 3)
    assert s.f2b(0) == [2, 1, 0, 3, 4]
    assert s.docs() == ((0,), (0,), (0,), (3,), (4,))


def test_validate_names_stage_position_and_chunk():
    with pytest.raises(ScheduleError, match=r"stage 1, position 0: B0 comes before F0"):
        Schedule((prog("F0 B0"), prog("B0 F0")), (-1,)).validate()
    with pytest.raises(ScheduleError, match=r"stage 0: chunk 1 has no backward op"):
        Schedule((prog("F0 F1 B0"),), (-1, -1)).validate()
    with pytest.raises(ScheduleError, match=r"stage 0, position 2: F0 repeats"):
        Schedule((prog("F0 B0 F0"),), (-1,)).validate()
    # slice 1 continues slice 0: its forward cannot run first on the same stage
    with pytest.raises(ScheduleError, match=r"deadlock at tick 0: stage 0 waits at F1 \(chunk 1\) for F0 on stage 0"):
        Schedule((prog("F1 F0 B1 B0"),), (-1, 0)).validate()
    # dK/dV: the backward of slice 0 needs the backward of slice 1 first
    with pytest.raises(ScheduleError, match=r"waits at B0 \(chunk 0\) for B1 on stage 0"):
        Schedule((prog("F0 F1 B0 B1"),), (-1, 0)).validate()
    # cross-stage deadlock names both stages
    with pytest.raises(
        ScheduleError,
        match=r"deadlock at tick 2: stage 0 waits at B0 \(chunk 0\) for B0 on stage 1; "
        r"stage 1 waits at F1 \(chunk 1\) for F1 on stage 0",
    ):
        Schedule((prog("F0 B0 F1 B1"), prog("F0 F1 B0 B1")), (-1, -1)).validate()
    with pytest.raises(ScheduleError, match="both continue chunk 0"):
        Schedule((prog("F0 F1 F2 B2 B1 B0"),), (-1, 0, 0)).validate()
    with pytest.raises(ScheduleError, match="cycle"):
        Schedule((prog("F0 F1 B0 B1"),), (1, 0)).validate()


def test_tick_table_round_trip():
    s = one_f_one_b(3, 2)
    t = s.to_ticks()
    assert t.dtype == np.int32 and t.shape == (8, 2, 2)
    ops = [[(int(a), int(b)) for a, b in row] for row in t]
    F, B, I = FWD, BWD, IDLE
    assert ops == [
        [(F, 0), (I, -1)],
        [(F, 1), (F, 0)],
        [(I, -1), (B, 0)],
        [(B, 0), (F, 1)],
        [(F, 2), (B, 1)],
        [(B, 1), (F, 2)],
        [(I, -1), (B, 2)],
        [(B, 2), (I, -1)],
    ]
    assert Schedule.from_ticks(t, s.chunk_prev) == s


def test_ticks_of_an_unvalidated_program_name_a_repeated_op_and_an_unknown_code():
    twice = Schedule(((Op("F", 0), Op("F", 0), Op("B", 0)),), (-1,))  # nobody called validate()
    with pytest.raises(ScheduleError, match=r"stage 0: F0 \(chunk 0\) runs twice"):
        twice.to_ticks()
    t = one_f_one_b(2, 2).to_ticks()
    t[1, 0, 0] = 3  # FUSED has no place in a single-op table
    with pytest.raises(ScheduleError, match="tick 1, stage 0: unknown op code 3"):
        Schedule.from_ticks(t, (-1, -1))


def test_from_ticks_rejects_same_tick_dependency():
    t = one_f_one_b(2, 2).to_ticks()
    bad = t.copy()
    bad[0, 1] = (FWD, 0)  # stage 1 forwards chunk 0 in the same tick as stage 0
    bad[1, 1] = (IDLE, -1)
    with pytest.raises(ScheduleError, match=r"tick 0, stage 1: F0 \(chunk 0\) runs before F0 on stage 0"):
        Schedule.from_ticks(bad, (-1, -1))


def test_sequential_units_offset_chunks_and_documents():
    a = token_level_1f1b([-1, 0], 2)
    b = one_f_one_b(2, 2)
    s = sequential([a, b])
    assert s.n_chunks == 4 and s.chunk_prev == (-1, 0, -1, -1)
    assert s.stages[0] == a.stages[0] + prog("F2 F3 B2 B3")
    assert s.docs() == ((0,), (0,), (1,), (2,))
    with pytest.raises(ScheduleError, match="same pp"):
        sequential([a, one_f_one_b(2, 3)])


def test_builder_input_errors():
    with pytest.raises(ScheduleError, match="chunk_prev\\[k\\] < k"):
        token_level_1f1b([1, -1], 2)
    with pytest.raises(ScheduleError, match="n_chunks=0"):
        one_f_one_b(0, 2)
