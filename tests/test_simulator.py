"""Simulator on hand-drawn 2-stage schedules: exact iteration time, bubble and memory; pictures."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from schedule_strategies import schedules

from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, CostModel, LayerTime, Link, ModelShape
from jvarlen.plan.gantt import draw_gantt, save_every
from jvarlen.plan.schedule import gpipe, one_f_one_b, sequential, token_level_1f1b
from jvarlen.plan.simulator import lower_bound, simulate, simulate_in_parts, simulate_pipelines

# 2 layers, pp 2: one layer per stage. Each chunk token costs 1 s forward, 2 s backward per layer.
MODEL = ModelShape(num_layers=2, d_model=8, num_heads=2, num_kv_heads=2, head_dim=4, mlp_dim=16, vocab_size=10)


def cost(p2p_latency=0.0, step_overhead=0.0, budget=1e9, **kw) -> CostModel:
    c = CostCoefficients(
        fwd=LayerTime(0.0, 1.0, 0.0),
        bwd=LayerTime(0.0, 2.0, 0.0),
        m_token=10.0,
        master_bytes_per_param=0.0,
        stage_bytes_per_param=0.0,
        workspace_bytes=100.0,
        memory_budget=budget,
        p2p_intra=Link(float("inf"), p2p_latency),
        p2p_inter=Link(float("inf"), p2p_latency),
        step_overhead=step_overhead,
        **kw,
    )
    return CostModel(MODEL, Layout(1, 2, 1), c)


# what a stage holds beside its working memory while a backward runs: the layer's gradient the
# executor's backward returns in the compute dtype (2 B x 656 parameters)
GRAD = 2 * MODEL.layer_params


def one(n):
    return [ChunkShape(0, (1,))] * n  # 1 token: F = 1 s, B = 2 s per stage


def spans(result, stage, kind):
    return [(e.chunk, e.start, e.end) for e in result.stage_events(stage, [kind])]


def test_gpipe_two_stages_exact():
    r = simulate(gpipe(2, 2), one(2), None, cost(step_overhead=0.5))
    # stage 0: F0 [0,1] F1 [1,2]                 B1 [5,7] B0 [7,9]
    # stage 1:        F0 [1,2] F1 [2,3] B1 [3,5] B0 [5,7]
    assert spans(r, 0, "F") == [(0, 0, 1), (1, 1, 2)]
    assert spans(r, 1, "F") == [(0, 1, 2), (1, 2, 3)]
    assert spans(r, 1, "B") == [(1, 3, 5), (0, 5, 7)]
    assert spans(r, 0, "B") == [(1, 5, 7), (0, 7, 9)]
    assert r.makespan == 9 and r.iteration_time == 9.5
    assert r.bubble_ratio == pytest.approx(1 - 12 / 18)
    assert spans(r, 0, "idle") == [(-1, 2, 5)]
    assert spans(r, 1, "idle") == [(-1, 0, 1), (-1, 7, 9)]


def test_one_f_one_b_two_stages_exact():
    n = 3
    r = simulate(one_f_one_b(n, 2), one(n), None, cost())
    assert r.makespan == (n + 2 - 1) * 3  # (n + pp - 1)(F + B) for uniform chunks
    assert r.bubble_ratio == pytest.approx(1 - 2 * n * 3 / (2 * r.makespan))
    assert [c for c, _, _ in spans(r, 0, "B")] == [0, 1, 2]


def test_p2p_latency_delays_the_receiver():
    r = simulate(one_f_one_b(2, 2), one(2), None, cost(p2p_latency=0.5))
    # stage 0: F0 [0,1] F1 [1,2]  ...  B0 [5,7]  B1 [8,10]
    # stage 1: F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5]
    assert spans(r, 1, "F") == [(0, 1.5, 2.5), (1, 4.5, 5.5)]
    assert spans(r, 1, "B") == [(0, 2.5, 4.5), (1, 5.5, 7.5)]
    assert spans(r, 0, "B") == [(0, 5, 7), (1, 8, 10)]
    assert r.makespan == 10
    p2p = spans(r, 0, "P2P")
    assert (0, 1, 1.5) in p2p and (1, 2, 2.5) in p2p


def test_tick_mode_is_lock_step():
    r = simulate(one_f_one_b(3, 2), one(3), None, cost(), mode="ticks")
    # ticks: F0|-  F1|F0  -|B0  B0|F1  F2|B1  B1|F2  -|B2  B2|-  -> 1+1+2+2+2+2+2+2
    assert r.makespan == 14
    r2 = simulate(one_f_one_b(3, 2), one(3), None, cost(p2p_latency=0.25), mode="ticks")
    # ticks 0, 1, 2, 4, 6 send across the boundary (stage 0 forwards, stage 1 backwards)
    assert r2.makespan == 14 + 0.25 * 5


def test_paired_mode_runs_one_backward_and_one_forward_per_tick():
    n = 6
    unpadded = cost().padded(1)  # 1-token chunks; the executor's smallest bucket is 16 tokens
    r = simulate(one_f_one_b(n, 2), one(n), None, unpadded, mode="paired")
    # ticks: F0|-  F1|X0  B0 F2|X1 ... B3 F5|X4  B4|X5  B5|-  (X: the last stage's fused F+B)
    #        1     3    3      3          3      3     2     -> the async optimum (n + pp - 1)(F + B)
    assert r.makespan == (n + 2 - 1) * 3 == simulate(one_f_one_b(n, 2), one(n), None, cost()).makespan
    assert r.makespan < simulate(one_f_one_b(n, 2), one(n), None, cost(), mode="ticks").makespan
    # the fused op recomputes nothing; a chunk the plan recomputes on the last stage is not fused
    # (as prepare_batch fuses): its recomputation costs there, in ticks of their own
    ckpt = np.zeros((n, 2), np.int64)
    ckpt[:, 0] = 1
    first = simulate(one_f_one_b(n, 2), one(n), ckpt, unpadded, mode="paired")
    assert first.stage_recompute.tolist() == [n, 0]
    ckpt[:, 1] = 1
    both = simulate(one_f_one_b(n, 2), one(n), ckpt, unpadded, mode="paired")
    assert both.stage_recompute.tolist() == [n, n] and both.makespan > first.makespan
    # memory: 1F1B's window (stage 0 holds at most 2 chunks), not GPipe's
    assert r.peak_memory.tolist() == [100 + 2 * 10 + GRAD, 100 + 10 + GRAD]
    # executor overheads: one per tick and one per op on the tick's busiest stage (a fused op counts
    # as its F and its B): ticks 0 and 7 run one op, ticks 1-6 two
    c = CostModel(MODEL, Layout(1, 2, 1), unpadded.coeffs.replace(tick_overhead=0.5, op_overhead=0.25), pad_to=1)
    over = simulate(one_f_one_b(n, 2), one(n), None, c, mode="paired")
    assert over.makespan == pytest.approx(r.makespan + 0.5 * 8 + 0.25 * (1 + 2 * 6 + 1))
    # every chunk's matmuls run over the step's one bucket: 16 tokens here (the smallest)
    assert simulate(one_f_one_b(n, 2), one(n), None, cost(), mode="paired").makespan == 16 * r.makespan
    mixed = [ChunkShape(0, (20,)), ChunkShape(0, (100,))]  # bucket 112: seven 16-token steps (an eighth of 128)
    assert simulate(one_f_one_b(2, 2), mixed, None, cost(), mode="paired").makespan == pytest.approx(
        simulate(one_f_one_b(2, 2), [ChunkShape(0, (112,))] * 2, None, cost(), mode="paired").makespan
    )


def test_recomputation_lengthens_backward():
    ckpt = np.array([[1, 0], [0, 0]])
    r = simulate(gpipe(2, 2), one(2), ckpt, cost())
    # B0 on stage 0 recomputes its single layer (1 s) before the 2 s backward: [7,8] R, [8,10] B
    assert spans(r, 0, "R") == [(0, 7, 8)]
    assert spans(r, 0, "B")[-1] == (0, 8, 10)
    assert r.makespan == 10
    assert r.stage_recompute.tolist() == [1.0, 0.0]


def test_memory_timeline_peak_and_budget():
    # 1 layer per stage, m_token 10 B, chunks of 1, 2, 3 tokens; workspace 100 B
    chunks = [ChunkShape(0, (t,)) for t in (1, 2, 3)]
    assert cost().layer_gradient_memory() == GRAD
    r = simulate(gpipe(3, 2), chunks, None, cost())
    assert r.peak_memory.tolist() == [100 + 60 + GRAD, 100 + 60 + GRAD]
    times, values = r.memory[0]
    assert values[0] == 110 and values.max() == 160 + GRAD and values[-1] == 100
    assert r.fits
    ckpt = np.array([[1, 1]] * 3)  # full recomputation keeps only the 2-byte x D=8 input per token
    assert simulate(gpipe(3, 2), chunks, ckpt, cost()).peak_memory.tolist() == [100 + 6 * 16 + GRAD] * 2
    tight = simulate(gpipe(3, 2), chunks, None, cost(budget=150 + GRAD))
    assert not tight.fits
    assert {s for s, _, _ in tight.over_budget} == {0, 1}
    assert all(v > 150 + GRAD for _, _, v in tight.over_budget)
    # 1F1B keeps fewer chunks in flight than GPipe
    assert simulate(one_f_one_b(3, 2), chunks, None, cost()).peak_memory[1] < r.peak_memory[1]


def test_a_backward_holds_its_working_memory_while_it_runs():
    """Each backward adds its chunk's working memory (m_work_token, or m_work_remat_token where it
    recomputes, per token) and its layer gradients on top of the live activations; the op-order
    replay agrees."""
    from jvarlen.plan.plan import replay_peaks

    chunks = [ChunkShape(0, (t,)) for t in (1, 2, 3)]
    c = cost(m_work_token=7.0, m_work_remat_token=9.0)
    # GPipe: all three in flight (160 B) when the 3-token chunk's backward starts (+21 B)
    r = simulate(gpipe(3, 2), chunks, None, c)
    assert r.peak_memory.tolist() == [100 + 60 + 21 + GRAD] * 2
    times, values = r.memory[0]
    assert values[-1] == 100  # everything freed at the end
    full = np.array([[1, 1]] * 3)
    assert simulate(gpipe(3, 2), chunks, full, c).peak_memory.tolist() == [100 + 6 * 16 + 27 + GRAD] * 2
    # last stage of 1F1B: one chunk at a time, the 3-token one with its backward's 21 B
    assert simulate(one_f_one_b(3, 2), chunks, None, c).peak_memory[1] == 100 + 30 + 21 + GRAD
    for sched in (gpipe(3, 2), one_f_one_b(3, 2)):
        for ckpt in (np.zeros((3, 2), np.int32), full, np.array([[1, 0], [0, 1], [1, 1]])):
            np.testing.assert_array_equal(
                simulate(sched, chunks, ckpt, c).peak_memory, replay_peaks(chunks, sched, ckpt, c)
            )
    assert not simulate(gpipe(3, 2), chunks, None, cost(budget=170, m_work_token=7.0)).fits  # 160 B alone fits


def test_token_level_slices_wait_for_context_and_dkv():
    # chunk 1 continues chunk 0 (context 1); chunk 0 keeps its K/V (non-tail)
    chunks = [ChunkShape(0, (1,), tail=False), ChunkShape(1, (1,))]
    s = token_level_1f1b([-1, 0], 2)
    r = simulate(s, chunks, None, cost())
    b1 = dict((c, (a, b)) for c, a, b in spans(r, 0, "B"))
    assert b1[0][0] >= b1[1][1]  # slice 0's backward after slice 1's (dK/dV)
    assert r.makespan == 1 + 1 + 1 + 2 + 2 + 2  # F0, F1 on stage 0 ... all serial at the end


def test_slowest_pipeline_sets_the_iteration():
    fast = (one_f_one_b(2, 2), one(2), None)
    slow = (sequential([one_f_one_b(2, 2), one_f_one_b(2, 2)]), one(4), None)
    multi = simulate_pipelines([fast, slow], cost())
    assert multi.slowest == 1
    assert multi.iteration_time == multi.results[1].iteration_time == 2 * (2 + 1) * 3


def random_case(sched, seed: int):
    """Random chunk shapes (context where the chunk continues a document), recomputation and a
    cost model with every lock-step term, for ``sched`` (whose pp divides 12)."""
    rng = np.random.default_rng(seed)
    links = [j >= 0 for j in sched.chunk_prev]
    shapes = [
        ChunkShape(int(rng.integers(1, 40)) if linked else 0, tuple(rng.integers(1, 30, 2).tolist()))
        for linked in links
    ]
    ckpt = rng.integers(0, 12 // sched.pp + 1, (sched.n_chunks, sched.pp))
    coeffs = CostCoefficients(
        fwd=LayerTime(1e-3, 1.0, 0.5),
        bwd=LayerTime(2e-3, 2.0, 1.0),
        m_token=10.0,
        master_bytes_per_param=0.0,
        stage_bytes_per_param=1.0,
        workspace_bytes=100.0,
        memory_budget=float(rng.choice([1e9, 2e3])),  # 2e3: some stages over budget
        p2p_intra=Link(1e3, 0.3),
        p2p_inter=Link(1e3, 0.3),
        step_overhead=0.1,
        tick_overhead=0.05,
        op_overhead=0.01,
        tick_recompute_factor=0.5,
    )
    model = ModelShape(num_layers=12, d_model=8, num_heads=4, num_kv_heads=4, head_dim=4, mlp_dim=16, vocab_size=10)
    return shapes, ckpt, CostModel(model, Layout(1, sched.pp, 2), coeffs)


@settings(max_examples=60, deadline=None)
@given(schedules(), st.integers(0, 2**31 - 1), st.sampled_from(["async", "ticks", "paired"]))
def test_without_a_timeline_times_and_memory_are_those_the_timeline_adds_up_to(sched, seed, mode):
    """``timeline=False`` (the planner's calls) leaves out the events and nothing else; the busy
    and recompute seconds are the events' durations and the makespan is where the last one ends."""
    assume(12 % sched.pp == 0)
    shapes, ckpt, c = random_case(sched, seed)
    full = simulate(sched, shapes, ckpt, c, mode)
    lean = simulate(sched, shapes, ckpt, c, mode, timeline=False)
    assert lean.events == [] and full.events
    assert (lean.makespan, lean.iteration_time, lean.bubble_ratio) == (
        full.makespan,
        full.iteration_time,
        full.bubble_ratio,
    )
    for a, b in (
        (lean.stage_busy, full.stage_busy),
        (lean.stage_recompute, full.stage_recompute),
        (lean.peak_memory, full.peak_memory),
    ):
        np.testing.assert_array_equal(a, b)
    for (t1, v1), (t2, v2) in zip(lean.memory, full.memory, strict=True):
        np.testing.assert_array_equal(t1, t2)
        np.testing.assert_array_equal(v1, v2)
    assert lean.over_budget == full.over_budget
    busy, redo = np.zeros(sched.pp), np.zeros(sched.pp)
    for e in full.events:
        busy[e.stage] += e.duration if e.kind in ("F", "B", "R", "A2A") else 0.0
        redo[e.stage] += e.duration if e.kind == "R" else 0.0
    np.testing.assert_allclose(full.stage_busy, busy, rtol=1e-12)
    np.testing.assert_allclose(full.stage_recompute, redo, rtol=1e-12, atol=1e-15)
    ops = [e for e in full.events if e.kind in ("F", "B", "R", "A2A")]
    start = 0.0 if mode != "async" else min(e.start for e in ops)
    assert max(e.end for e in ops) - start == pytest.approx(full.makespan, rel=1e-12)


@settings(max_examples=80, deadline=None)
@given(schedules(), st.integers(0, 2**31 - 1), st.sampled_from(["async", "ticks", "paired"]), st.booleans())
def test_the_lower_bound_holds_for_every_schedule_and_recomputation(sched, seed, mode, no_ckpt):
    """:func:`lower_bound` from the chunk shapes alone never exceeds the simulated time of any valid
    schedule of those chunks, with or without recomputation, in every mode; nor does it with any
    floor under the recomputation."""
    assume(12 % sched.pp == 0)
    shapes, ckpt, c = random_case(sched, seed)
    ckpt = ckpt * 0 if no_ckpt else ckpt
    simulated = simulate(sched, shapes, ckpt, c, mode, timeline=False).iteration_time
    assert lower_bound(shapes, c, mode) <= simulated
    # with a floor under the recomputation (what a plan had before its memory fit raised it)
    floor = ckpt * np.random.default_rng(seed).integers(0, 2, ckpt.shape)
    assert lower_bound(shapes, c, mode, ckpt) <= simulated
    assert lower_bound(shapes, c, mode, floor) <= simulated


def test_the_lower_bound_is_the_simulated_time_where_nothing_overlaps():
    """One chunk through two stages: its forwards and backwards run one after another, so the
    bound (fill + busy + drain, and 1 + 2 ticks in paired mode, whose executor pads the token to
    its 16-token bucket) is the simulated time itself."""
    c = cost(step_overhead=0.5, tick_overhead=0.25)
    assert simulate(one_f_one_b(1, 2), one(1), None, c).iteration_time == 6.5
    assert lower_bound(one(1), c, "async") == pytest.approx(6.5, rel=2e-9)
    paired = simulate(one_f_one_b(1, 2), one(1), None, c, "paired").iteration_time
    assert paired > 6.5 + 3 * 0.25 and lower_bound(one(1), c, "paired") == pytest.approx(paired, rel=2e-9)
    # many equal chunks: the last stage is never idle between its first forward and last backward
    many = simulate(one_f_one_b(4, 2), one(4), None, c).iteration_time
    assert lower_bound(one(4), c, "async") == pytest.approx(many, rel=2e-9)


def test_simulate_input_errors():
    with pytest.raises(ValueError, match="pp=2"):
        simulate(one_f_one_b(2, 3), one(2), None, cost())
    with pytest.raises(ValueError, match="shape"):
        simulate(one_f_one_b(2, 2), one(2), np.zeros((2, 3)), cost())
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        simulate(one_f_one_b(2, 2), one(2), np.full((2, 2), 2), cost())


def test_gantt_png_is_written(tmp_path):
    chunks = [ChunkShape(0, (2,), tail=False), ChunkShape(2, (1, 1)), ChunkShape(0, (1, 2))]
    s = token_level_1f1b([-1, 0, -1], 2, chunk_docs=[(0,), (0, 1), (2, 3)])
    r = simulate(s, chunks, np.array([[1, 0], [0, 1], [0, 0]]), cost(alltoall_default=Link(1.0, 0.1)))
    path = draw_gantt(r, s, tmp_path / "sub" / "gantt.png")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_gantt_every_n_steps(tmp_path):
    r = simulate(one_f_one_b(2, 2), one(2), None, cost())
    assert save_every(3, 2, r, one_f_one_b(2, 2), tmp_path) is None
    path = save_every(4, 2, r, one_f_one_b(2, 2), tmp_path)
    assert path.endswith("gantt/step_0000004.png") and open(path, "rb").read(4) == b"\x89PNG"


def test_simulate_without_memory_times_alike_and_refuses_to_say_it_fits():
    """``memory=False`` (the planner's time-only searches) gives the same times; ``fits`` is unknown."""
    chunks = [ChunkShape(0, (10,), True)] * 3
    ckpt = np.ones((3, 2), np.int64)
    for mode in ("async", "ticks", "paired"):
        full = simulate(one_f_one_b(3, 2), chunks, ckpt, cost(), mode)
        times = simulate(one_f_one_b(3, 2), chunks, ckpt, cost(), mode, memory=False)
        assert times.iteration_time == full.iteration_time and times.bubble_ratio == full.bubble_ratio
        assert np.isnan(times.peak_memory).all() and times.memory == []
        with pytest.raises(ValueError, match="memory=False"):
            assert times.fits
    sched = sequential([one_f_one_b(1, 2), one_f_one_b(2, 2)])
    full = simulate_in_parts(sched, chunks, ckpt, cost(), (1, 2), "paired")
    times = simulate_in_parts(sched, chunks, ckpt, cost(), (1, 2), "paired", memory=False)
    assert times.iteration_time == full.iteration_time and times.memory == [] and times.over_budget is None
