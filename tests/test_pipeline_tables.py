"""Host side of the pipeline executor: chunk packing, buffer slots following the window,
and tables the executor refuses (each kind of broken dependency, window overflow)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline_helpers import PLAN_A, plan_documents

from jvarlen.layout import Layout
from jvarlen.parallel import pipeline as pl
from jvarlen.parallel.pipeline import pack_chunks
from jvarlen.plan import schedule as sch
from jvarlen.plan.buffers import FUSED, assign_slots, fuse_single_stage, op_ticks, plan_ticks, slot_counts
from jvarlen.plan.chunk import ChunkShape, executor_context
from jvarlen.plan.cost import CostCoefficients, CostModel, LayerTime, ModelShape
from jvarlen.plan.live_ranges import Live, colour, peak_of
from jvarlen.plan.schedule import BWD, FWD, IDLE, ScheduleError
from jvarlen.plan.simulator import simulate
from jvarlen.plan.units import PlannedChunk

LAYOUT = Layout(dp=1, pp=2, sp=1)


def _plan_a():
    docs, chunks = plan_documents(PLAN_A, seed=1)
    return docs, pack_chunks(chunks, docs, 32)


def test_pack_chunks_lays_out_all_three_kinds():
    docs, pack = _plan_a()
    a = pack.arrays
    assert pack.chunk_prev == (-1, -1, 1, 2, 3, -1)
    np.testing.assert_array_equal(pack.ctx_len, [0, 0, 16, 32, 48, 0])
    np.testing.assert_array_equal(pack.has_next, [0, 1, 1, 1, 0, 0])
    # hybrid chunk 4: tail slice of doc 2 (positions 48..59), then docs 3 and 4 from 0
    np.testing.assert_array_equal(a["positions"][4, :12], np.arange(48, 60))
    np.testing.assert_array_equal(a["segment_ids"][4, :26], [1] * 12 + [2] * 5 + [3] * 9)
    np.testing.assert_array_equal(a["segment_ids"][4, 26:], 0)
    np.testing.assert_array_equal(a["tokens"][4, 12:17], docs[3])
    # a split slice's last target is the next slice's first token
    assert a["targets"][1, 15] == docs[2][16] and a["loss_mask"][1, 15] == 1
    # every token is a target once, except each document's last token
    assert a["loss_mask"].sum() == sum(len(d) - 1 for d in docs)
    assert pack.context_bucket() == 48 + 32


def test_pack_chunks_rejects_bad_pieces():
    docs, _ = _plan_a()
    with pytest.raises(ValueError, match="bucket"):
        pack_chunks([[(2, 0, 60)]], docs, 32)
    with pytest.raises(ValueError, match="alone"):
        pack_chunks([[(2, 0, 16), (0, 0, 10)]], docs, 32)
    with pytest.raises(ValueError, match="whole documents"):
        pack_chunks([[(0, 0, 10), (2, 0, 16)]], docs, 32)
    with pytest.raises(ValueError, match="no chunk's piece 0 ends there"):
        pack_chunks([[(2, 16, 16)]], docs, 32)


@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_slots_follow_the_window_gpipe_slots_the_chunks(pp):
    for n in (4, 8, 16):
        ones = np.zeros((n, pp), np.int32)
        f1b = assign_slots(sch.one_f_one_b(n, pp).to_ticks(), [-1] * n, ones, 1)
        gp = assign_slots(sch.gpipe(n, pp).to_ticks(), [-1] * n, ones, 1)
        assert f1b.n_stash == pp and f1b.n_res == pp  # Eq. 7 window without split documents
        assert gp.n_stash == n and gp.n_res == n


def test_split_document_window_and_context_slots():
    # one document split in 4 slices, then 2 batched chunks: window d_p - p + N_prefill
    prev = [-1, 0, 1, 2, -1, -1]
    slots = assign_slots(sch.token_level_1f1b(prev, 2).to_ticks(), prev, np.zeros((6, 2), np.int32), 1)
    assert slots.n_stash == 2 - 1 + 4 and slots.ctx_rows == 1  # one document, one row each (default need)
    assert (slots.ctx_base[:4] == 0).all() and (slots.ctx_base[4:] == slots.ctx_rows).all()


def test_context_pool_gives_each_document_its_own_rows():
    """Three split documents in flight at once (GPipe) take the sum of their regions (32 + 8 + 4
    rows), not three regions of the longest."""
    prev = [-1, 0, 1, -1, 3, -1, 5]
    need = [16, 32, 32, 8, 8, 4, 4]  # C (+ own tokens where a later slice continues)
    slots = assign_slots(sch.gpipe(7, 2, prev).to_ticks(), prev, np.zeros((7, 2), np.int32), 1, ctx_need=need)
    assert slots.ctx_rows == 32 + 8 + 4
    for p in range(2):
        assert [int(slots.ctx_base[k, p]) for k in (0, 3, 5)] == [0, 32, 40]  # first fit, in forward order
        for root, chain in ((0, (1, 2)), (3, (4,)), (5, (6,))):
            assert all(slots.ctx_base[k, p] == slots.ctx_base[root, p] for k in chain)


@st.composite
def _split_batches(draw):
    """(chunk_prev, ctx_need, pp, schedule kind) of up to 9 chunks, some of them slices of one document."""
    n = draw(st.integers(2, 9))
    prev = [k - 1 if k > 0 and draw(st.booleans()) else -1 for k in range(n)]
    need = [draw(st.integers(1, 64)) for _ in range(n)]
    return prev, need, draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from(["gpipe", "1f1b"]))


@settings(max_examples=60, deadline=None)
@given(_split_batches())
def test_context_regions_live_at_once_never_share_a_row(case):
    """Property: on every stage, two documents whose live ranges (first forward to the first
    slice's backward, in the phases of the paired table) meet have disjoint regions inside the
    pool, every chunk of a document uses its document's base, and the pool is never larger than
    equal slots of the largest region (one per document in flight)."""
    prev, need, pp, kind = case
    n = len(prev)
    sched = sch.gpipe(n, pp, prev) if kind == "gpipe" else sch.token_level_1f1b(prev, pp)
    ticks = sch.paired_ticks(sched)
    slots = assign_slots(ticks, prev, np.zeros((n, pp), np.int32), 1, ctx_need=need)
    root = list(range(n))
    for k in range(n):
        while prev[root[k]] >= 0:
            root[k] = prev[root[k]]
    linked = [k for k in range(n) if prev[k] >= 0 or k in prev]
    docs = sorted({root[k] for k in linked})
    rows = {r: max(need[k] for k in linked if root[k] == r) for r in docs}
    tf, tb = op_ticks(ticks, n)
    worst = 0
    for p in range(pp):
        live = {r: (3 * tf[r, p] + (0 if tf[r, p] == tb[r, p] else 1), 3 * tb[r, p]) for r in docs}
        worst = max(worst, colour([(a, b, r) for r, (a, b) in live.items()])[1])
        for k in range(n):
            expected = slots.ctx_base[root[k], p] if k in linked else slots.ctx_rows
            assert slots.ctx_base[k, p] == expected
        for i, r in enumerate(docs):
            base = int(slots.ctx_base[r, p])
            assert 0 <= base and base + rows[r] <= slots.ctx_rows
            for q in docs[i + 1 :]:
                (a0, a1), (b0, b1) = live[r], live[q]
                if a0 <= b1 and b0 <= a1:
                    other = int(slots.ctx_base[q, p])
                    assert base + rows[r] <= other or other + rows[q] <= base, (p, r, q)
    assert slots.ctx_rows <= worst * max(rows.values(), default=0)


_intervals = st.lists(
    st.tuples(st.integers(0, 30), st.integers(-2, 12)).map(lambda se: (se[0], se[0] + se[1])), max_size=40
).map(lambda ses: [(s, e, (i % 5, i)) for i, (s, e) in enumerate(ses)])


@settings(max_examples=300, deadline=None)
@given(_intervals)
def test_colouring_takes_the_lowest_free_slot_and_the_peak_is_the_first_fullest_start(intervals):
    """Reference: the quadratic definitions. In order of (start, end), an interval takes the lowest
    slot every earlier holder of which ended before it starts; the peak is the first start (in the
    intervals' order) that most closed intervals hold, with the keys that hold it."""
    ends: list[int] = []
    slot_of = {}
    for s, e, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        free = [j for j, end in enumerate(ends) if end < s]
        j = free[0] if free else len(ends)
        ends[j : j + 1] = [e]
        slot_of[key] = j
    assert colour(intervals) == (slot_of, len(ends))
    live_at = [[key for s, e, key in intervals if s <= x <= e] for x, _, _ in intervals]
    if intervals:
        i = max(range(len(intervals)), key=lambda i: (len(live_at[i]), -i))
        assert peak_of(intervals) == (intervals[i][0] // 3, sorted(live_at[i]))
    else:
        assert peak_of(intervals) == (0, [])
    # no two intervals that meet share a slot
    for a, (s0, e0, k0) in enumerate(intervals):
        for s1, e1, k1 in intervals[a + 1 :]:
            if s0 <= e1 and s1 <= e0 and s0 <= e0 and s1 <= e1:
                assert slot_of[k0] != slot_of[k1]


@settings(max_examples=40, deadline=None)
@given(
    _split_batches(),
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(0, 99), st.integers(0, 3), st.integers(0, 4)), min_size=1, max_size=6),
    st.booleans(),
)
def test_slots_with_a_memo_kept_across_recomputation_tables_are_the_slots_without(case, ls, changes, fuse):
    """The executor-memory repair keeps one memo per tick table while it raises (chunk, stage)
    entries: every table's slots must be those of a fresh call."""
    prev, need, pp, kind = case
    n = len(prev)
    sched = sch.gpipe(n, pp, prev) if kind == "gpipe" else sch.token_level_1f1b(prev, pp)
    ckpt = np.zeros((n, pp), np.int32)
    memo: dict = {}
    for k, p, layers in changes:
        ckpt = ckpt.copy()
        ckpt[k % n, p % pp] = min(layers, ls)
        ticks = plan_ticks(sched, ckpt, fuse)
        kept = assign_slots(ticks, prev, ckpt, ls, ctx_need=need, memo=memo)
        fresh = assign_slots(ticks, prev, ckpt, ls, ctx_need=need)
        counted = slot_counts(ticks, prev, ckpt, ls, ctx_need=need, memo=memo)
        for name in ("n_stash", "n_grad", "ctx_rows", "n_res", "n_ckpt", "fused", "peaks"):
            assert getattr(counted, name) == getattr(fresh, name), name
        for field in dataclasses.fields(fresh):
            a, b = getattr(kept, field.name), getattr(fresh, field.name)
            assert np.array_equal(a, b) if isinstance(b, np.ndarray) else a == b, field.name


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 12), st.integers(0, 4), st.integers(0, 4)), max_size=25))
def test_the_sweep_counts_what_the_colouring_uses(ranges):
    """A kind's slot count without colouring: the most live ranges at one phase, each chunk
    weighted by its stored layers; equal to the greedy colouring's count and peak on the
    expanded intervals (one per layer)."""
    chunks = list(range(len(ranges)))
    layers = [(lo, lo + w) for _, _, lo, w in ranges]
    live = Live(chunks, [s for s, _, _, _ in ranges], [s + d for s, d, _, _ in ranges], layers)
    expanded = [(s, s + d, (k, l)) for k, (s, d, lo, w) in enumerate(ranges) for l in range(lo, lo + w)]
    assert live.count == colour(expanded)[1]
    assert live.peak() == peak_of(expanded)
    assert live.peak_chunks() == sorted({k for k, _ in peak_of(expanded)[1]})
    assert live.slots == colour(expanded)[0]


def test_recomputed_layers_get_the_dummy_slot():
    n, pp, ls = 3, 2, 4
    ckpt = np.array([[0, 4], [2, 1], [4, 0]], np.int32)
    slots = assign_slots(sch.gpipe(n, pp).to_ticks(), [-1] * n, ckpt, ls)
    stored = slots.res_slot != slots.n_res
    for k in range(n):
        for p in range(pp):
            np.testing.assert_array_equal(stored[k, p], np.arange(ls) >= ckpt[k, p])
    with pytest.raises(ValueError, match="ckpt_layers"):
        assign_slots(sch.gpipe(n, pp).to_ticks(), [-1] * n, ckpt + 1, ls)


def test_one_stage_fuses_adjacent_forward_and_backward():
    # token-level order of a 3-slice document then a batched chunk: F0 F1 F2 B2 B1 B0 F3 B3
    prev = [-1, 0, 1, -1]
    ticks = sch.token_level_1f1b(prev, 1).to_ticks()
    fused = fuse_single_stage(ticks)
    ops = [(int(op), int(k)) for op, k in fused[:, 0]]
    assert ops == [(FWD, 0), (FWD, 1), (FUSED, 2), (BWD, 1), (BWD, 0), (FUSED, 3)]
    slots = assign_slots(fused, prev, np.zeros((4, 1), np.int32), 2)
    # fused chunks hold no stash, inbox or residual slot; the others keep theirs
    assert slots.stash_slot[2, 0] == slots.grad_slot[2, 0] == slots.n_stash == slots.n_grad == 2
    assert (slots.res_slot[[2, 3]] == slots.n_res).all() and slots.n_res == 2 * 2
    assert slots.ctx_base[2, 0] == slots.ctx_base[0, 0] == 0  # the last slice still reads context
    with pytest.raises(ValueError, match="one-stage"):
        fuse_single_stage(sch.one_f_one_b(2, 2).to_ticks())


def _prepare(ticks, pack, **kw):
    return pl.prepare_batch([pack], [ticks], [np.zeros((pack.n_chunks, 2), np.int32)], LAYOUT, 4, **kw)


def _swap(table, a, b):
    table = table.copy()
    table[[a, b]] = table[[b, a]]
    return table


def test_planner_tick_table_is_accepted_and_matches_the_schedule():
    _, pack = _plan_a()
    sched = sch.token_level_1f1b(pack.chunk_prev, 2)
    sig_a, batch_a = _prepare(sched.to_ticks(), pack)
    sig_b, batch_b = pl.prepare_batch([pack], [sched], [np.zeros((6, 2), np.int32)], LAYOUT, 4)
    assert sig_a == sig_b
    for key in batch_a:
        np.testing.assert_array_equal(batch_a[key], batch_b[key], err_msg=key)


def _find(table, stage, op, chunk):
    return int(np.nonzero((table[:, stage, 0] == op) & (table[:, stage, 1] == chunk))[0][0])


def test_rejects_stage_order_violation():
    _, pack = _plan_a()
    table = sch.token_level_1f1b(pack.chunk_prev, 2).to_ticks()
    t0, t1 = _find(table, 0, FWD, 0), _find(table, 1, FWD, 0)
    bad = table.copy()
    bad[t1, 1] = (IDLE, -1)
    bad[t0, 1] = (FWD, 0)  # F0 on stage 1 in the same tick as on stage 0
    with pytest.raises(ScheduleError, match=rf"tick {t0}, stage 1: F0 \(chunk 0\)"):
        _prepare(bad, pack)


def test_rejects_slice_order_violation():
    _, pack = _plan_a()
    table = sch.gpipe(6, 2, pack.chunk_prev).to_ticks()
    # F of slice 2 (chunk 2) before F of slice 1 (chunk 1) on both stages
    bad = table.copy()
    for p in range(2):
        a, b = _find(table, p, FWD, 1), _find(table, p, FWD, 2)
        bad[a, p, 1], bad[b, p, 1] = 2, 1
    with pytest.raises(ScheduleError, match=r"tick \d+: stage 0 waits at F2 \(chunk 2\) for F1 on stage 0"):
        _prepare(bad, pack)


def test_rejects_backward_before_forward():
    _, pack = _plan_a()
    table = sch.gpipe(6, 2, pack.chunk_prev).to_ticks()
    bad = table.copy()
    tf, tb = _find(table, 1, FWD, 5), _find(table, 1, BWD, 5)
    bad[tf, 1], bad[tb, 1] = table[tb, 1], table[tf, 1]
    with pytest.raises(ScheduleError, match=r"stage 1, position \d+: B5 comes before F5"):
        _prepare(bad, pack)


def test_rejects_backward_slice_order_violation():
    _, pack = _plan_a()
    table = sch.gpipe(6, 2, pack.chunk_prev).to_ticks()
    bad = table.copy()  # B of slice 1 before B of slice 2 on stage 0
    a, b = _find(table, 0, BWD, 1), _find(table, 0, BWD, 2)
    bad[a, 0, 1], bad[b, 0, 1] = 2, 1
    with pytest.raises(ScheduleError, match=r"tick \d+: stage 0 waits at B1 \(chunk 1\) for B2 on stage 0"):
        _prepare(bad, pack)


def test_rejects_window_overflow_naming_stage_tick_and_chunks():
    _, pack = _plan_a()
    sig, _ = _prepare(sch.token_level_1f1b(pack.chunk_prev, 2).to_ticks(), pack)
    gpipe = sch.gpipe(6, 2, pack.chunk_prev).to_ticks()
    small = dataclasses.replace(sig, n_ticks=max(sig.n_ticks, gpipe.shape[0]), n_grad=6, n_res=12)
    with pytest.raises(
        ScheduleError, match=r"window overflow: .*n_stash=6 .* has 5 \(stage 0, tick \d+: chunks \[0, 1, 2, 3, 4, 5\]"
    ):
        _prepare(gpipe, pack, signature=small)
    with pytest.raises(ValueError, match="n_chunks"):
        _prepare(gpipe, pack, signature=dataclasses.replace(sig, n_chunks=7))


def test_paired_ticks_pair_a_backward_with_a_forward_and_fuse_the_last_stage():
    ticks = sch.paired_ticks(sch.one_f_one_b(6, 2))
    # stage 0: F0 | F1 | B0 F2 | B1 F3 | ... | B5;  stage 1: - | X0 | X1 | ... | X5 | -
    assert ticks.shape == (8, 2, 2, 2)
    stage0 = [tuple(map(int, ticks[t, 0, :, 0])) for t in range(8)]
    assert stage0 == [(IDLE, FWD), (IDLE, FWD)] + [(BWD, FWD)] * 4 + [(BWD, IDLE)] * 2
    assert [int(k) for k in ticks[1:7, 1, 0, 1]] == list(range(6)) and (ticks[1:7, 1, 0, 0] == FUSED).all()
    sch.check_paired_table(ticks, sch.one_f_one_b(6, 2))
    bad = ticks.copy()
    bad[[2, 3], 0] = bad[[3, 2], 0]  # B1 before B0's cotangent arrived... and F3 before F2
    with pytest.raises(ScheduleError, match="runs before"):
        sch.check_paired_table(bad, sch.one_f_one_b(6, 2))


@pytest.mark.parametrize("pp", [2, 4])
def test_paired_ticks_keep_the_slot_counts(pp):
    """A backward frees its slots before its tick's forward takes one, and a forward never runs
    before a backward that precedes it: no buffer needs more slots than with one op per tick."""
    prev = [-1, 0, 1, 2, -1, -1, 5, -1]
    ckpt = np.zeros((8, pp), np.int32)
    for sched in (sch.one_f_one_b(8, pp), sch.gpipe(8, pp, prev), sch.token_level_1f1b(prev, pp)):
        one = assign_slots(sched.to_ticks(), sched.chunk_prev, ckpt, 1)
        two = assign_slots(sch.paired_ticks(sched), sched.chunk_prev, ckpt, 1)
        for name in ("n_stash", "n_grad", "ctx_rows", "n_res"):
            assert getattr(two, name) <= getattr(one, name), name
        assert sch.paired_ticks(sched).shape[0] < sched.to_ticks().shape[0]


def test_fusion_leaves_chunks_the_plan_recomputes_on_the_last_stage_apart():
    """A fused op keeps every activation of its chunk, so only chunks the plan does not recompute
    on the last stage are fused, and the simulator's paired model fuses the same ones."""
    _, pack = _plan_a()
    n = pack.n_chunks
    ckpt = np.zeros((n, 2), np.int32)
    ckpt[4, 1] = 2  # the tail slice 4 recomputes both layers of the last stage
    ckpt[0, 0] = 2  # chunk 0 only on the first stage
    sched = sch.token_level_1f1b(pack.chunk_prev, 2)
    fused = {}
    for fuse in (True, False):
        _, batch = pl.prepare_batch([pack], [sched], [ckpt], LAYOUT, 4, fuse=fuse)
        ops = batch["ops"][0]
        fused[fuse] = set(ops[:, 1, 0, 1][ops[:, 1, 0, 0] == FUSED].tolist())
        sch.check_paired_table(ops, sched)
    assert fused[False] == set()
    assert fused[True] == {0, 5}  # the last stage's adjacent F and B under token-level 1F1B, less 4
    model = ModelShape(num_layers=4, d_model=8, num_heads=2, num_kv_heads=2, head_dim=4, mlp_dim=16, vocab_size=10)
    cost = CostModel(model, LAYOUT, CostCoefficients(fwd=LayerTime(0.0, 1.0, 0.0)))
    shapes = [ChunkShape(0, (16,))] * n
    events = simulate(sched, shapes, ckpt, cost, mode="paired").events
    assert {(e.stage, e.chunk) for e in events if e.kind == "R"} == {(0, 0), (1, 4)}


@pytest.mark.parametrize("bucket", [32, 48])
def test_the_cost_models_context_bucket_is_the_executors(bucket):
    """``plan.chunk.executor_context`` (the tick overhead's context term) sizes the K/V buffers as
    ``prepare_batch`` does: split documents' max(C + bucket), rounded up to the bucket; 0 when
    nothing is split."""
    docs, chunks = plan_documents(PLAN_A, seed=1)
    lengths = [len(d) for d in docs]
    for kept in (chunks, [c for c in chunks if all(piece[2] == lengths[piece[0]] for piece in c)]):
        pack = pack_chunks(kept, docs, bucket)
        sched = sch.token_level_1f1b(pack.chunk_prev, 2)
        sig, _ = pl.prepare_batch([pack], [sched], [np.zeros((pack.n_chunks, 2), np.int32)], LAYOUT, 4)
        shapes = [PlannedChunk(tuple(c)).shape(lengths) for c in kept]
        assert executor_context(shapes, bucket) == sig.context
    assert sig.context == 0  # the second batch has no split document
