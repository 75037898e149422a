"""Property-based tests: random packed layouts through the schedule and the kernels."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from conftest import values_compile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kernels_attention import F32_TOL, fwd_vjp, make_inputs

from jvarlen.kernels import BlockSizes, block_info_for, pallas_triton
from jvarlen.kernels import testing as kt

T, CMAX, B = 80, 40, 16  # queries, max context, block size: T, S = T + CMAX not multiples of B
S = T + CMAX
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def packed_layouts(draw):
    """A slice of T tokens: the tail of a long document that started mid-context, then
    short documents, padding runs and "empty" segments (queries whose document has no
    keys); keys = padding, the document's context, the slice. Or one document spanning
    every block."""
    context = draw(st.integers(0, CMAX))
    first_start = context + draw(st.integers(0, 30))
    if draw(st.booleans()) and draw(st.booleans()):
        q_pieces = [(1, first_start, T)]
    else:
        q_pieces = [(1, first_start, draw(st.integers(1, 40)))]
        while sum(p[2] for p in q_pieces) < T:
            kind = draw(st.sampled_from(["doc", "short", "pad", "empty"]))
            n = draw(st.integers(1, 40) if kind in ("doc", "pad") else st.integers(1, 3))
            sid = 0 if kind == "pad" else len(q_pieces) + 1
            q_pieces.append((sid, 0, n) if kind != "empty" else (-sid, 0, n))
        extra = sum(p[2] for p in q_pieces) - T
        sid, start, n = q_pieces[-1]
        q_pieces[-1] = (sid, start, n - extra)
    # "empty" pieces (negative ids): queries keep the id, keys get an id no query has.
    q_seg, q_pos = kt.build([(abs(i), p, n) for i, p, n in q_pieces])
    kv_pieces = [(0, 0, CMAX - context), (1, first_start - context, context)]
    kv_pieces += [(1000 - i if i < 0 else i, p, n) for i, p, n in q_pieces]
    kv_seg, kv_pos = kt.build(kv_pieces)
    assert len(q_seg) == T and len(kv_seg) == S
    return q_seg, q_pos, kv_seg, kv_pos


@st.composite
def scrambled_layouts(draw):
    """Arbitrary ids and positions per token: documents not contiguous, positions not
    monotone. The schedule may then list invisible tiles but must never miss one."""
    ids = st.integers(0, 3)
    q_seg = np.array(draw(st.lists(ids, min_size=T, max_size=T)), np.int32)
    kv_seg = np.array(draw(st.lists(ids, min_size=S, max_size=S)), np.int32)
    q_pos = np.array(draw(st.lists(st.integers(0, 30), min_size=T, max_size=T)), np.int32)
    kv_pos = np.array(draw(st.lists(st.integers(0, 30), min_size=S, max_size=S)), np.int32)
    return q_seg, q_pos, kv_seg, kv_pos


def _schedule_sets(layout, causal):
    """-> per q block (partial set, full set) from the schedule, and numpy truth."""
    q_seg, q_pos, kv_seg, kv_pos = layout
    info = block_info_for(
        q_seg[None], kv_seg[None], q_pos[None], kv_pos[None], causal=causal, block_sizes=BlockSizes(B, B)
    )
    mask = np.zeros((T + (-T) % B, S + (-S) % B), bool)
    mask[:T, :S] = kt.visible_pairs(q_seg, q_pos, kv_seg, kv_pos, causal)
    nq, nk = mask.shape[0] // B, mask.shape[1] // B
    tiles = mask.reshape(nq, B, nk, B).transpose(0, 2, 1, 3)
    any_vis, all_vis = tiles.any((2, 3)), tiles.all((2, 3))
    return info, any_vis, all_vis


def _listed(blocks, counts):
    part, full = [], []
    for row, (n_part, n_full) in zip(np.asarray(blocks), np.asarray(counts)):
        part.append(set(row[:n_part].tolist()))
        full.append(set(row[n_part : n_part + n_full].tolist()))
    return part, full


@settings(max_examples=60, **SETTINGS)
@given(layout=packed_layouts(), causal=st.booleans())
def test_schedule_is_exact_on_packed_layouts(layout, causal):
    info, any_vis, all_vis = _schedule_sets(layout, causal)
    part, full = _listed(info.fwd_blocks[0], info.fwd_counts[0])
    for i in range(any_vis.shape[0]):
        assert full[i] == set(np.flatnonzero(all_vis[i]).tolist())
        assert part[i] == set(np.flatnonzero(any_vis[i] & ~all_vis[i]).tolist())
    part_t, full_t = _listed(info.bwd_blocks[0], info.bwd_counts[0])
    for j in range(any_vis.shape[1]):
        assert full_t[j] == set(np.flatnonzero(all_vis[:, j]).tolist())
        assert part_t[j] == set(np.flatnonzero(any_vis[:, j] & ~all_vis[:, j]).tolist())


@settings(max_examples=30, **SETTINGS)
@given(layout=scrambled_layouts(), causal=st.booleans())
def test_schedule_never_misses_a_tile(layout, causal):
    info, any_vis, all_vis = _schedule_sets(layout, causal)
    part, full = _listed(info.fwd_blocks[0], info.fwd_counts[0])
    for i in range(any_vis.shape[0]):
        assert full[i] == set(np.flatnonzero(all_vis[i]).tolist())  # full is always exact
        assert set(np.flatnonzero(any_vis[i]).tolist()) <= part[i] | full[i]


_tiles_visited = jax.jit(
    pallas_triton.tiles_visited, static_argnames=("causal", "sm_scale"), compiler_options=values_compile()
)


@functools.lru_cache(maxsize=None)
def _inputs():
    return make_inputs(0, T, S, 4, 2, 64)


def _check_all(layout, causal, exact_tiles):
    q, k, v, ct = _inputs()
    ids = [jnp.asarray(layout[i]) for i in (0, 2, 1, 3)]  # q_seg, kv_seg, q_pos, kv_pos
    ref_o, ref_g = fwd_vjp(q, k, v, ct, *ids, impl="reference", causal=causal, bq=B, bk=B)
    for impl in ("pallas", "xla"):
        o, g = fwd_vjp(q, k, v, ct, *ids, impl=impl, causal=causal, bq=B, bk=B)
        assert kt.rel_err(o, ref_o) <= F32_TOL, impl
        # Gradient errors relative to the scale of the whole VJP output (dq, dk, dv): random
        # layouts include degenerate ones (e.g. only single-token documents) where a true
        # gradient is identically 0 and its own scale is rounding noise.
        vjp_scale = max(float(np.abs(np.asarray(y)).max()) for y in ref_g)
        for x, y in zip(g, ref_g):
            assert np.isfinite(np.asarray(x)).all()
            err = float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max())
            assert err <= F32_TOL * vjp_scale, impl
    # Visited-tile counter of the Pallas forward vs an independent numpy count.
    info = block_info_for(*(x[None] for x in ids), causal=causal, block_sizes=BlockSizes(B, B))
    pad = lambda x, n: jnp.pad(x[None], [(0, 0), (0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
    tp, sp = T + (-T) % B, S + (-S) % B
    visited = _tiles_visited(
        pad(q, tp),
        pad(k, sp),
        pad(v, sp),
        pad(ids[0], tp),
        pad(ids[2], tp),
        pad(ids[1], sp),
        pad(ids[3], sp),
        info,
        causal=causal,
        sm_scale=0.125,
    )
    want = kt.visible_tiles(kt.visible_pairs(*layout, causal=causal), B, B)
    got = np.asarray(visited)[0]
    if exact_tiles:
        assert (got == want[None]).all(), (got[0], want)
    else:
        assert (got >= want[None]).all()


@settings(max_examples=40, **SETTINGS)
@given(layout=packed_layouts())
def test_kernels_on_random_packed_layouts(layout):
    _check_all(layout, True, exact_tiles=True)


@settings(max_examples=25, **SETTINGS)
@given(layout=scrambled_layouts())
def test_kernels_on_scrambled_layouts_non_causal(layout):
    _check_all(layout, False, exact_tiles=False)
