"""Pallas (interpret mode) varlen attention against the dense reference and the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import values_compile
from test_kernels_attention import CONTEXT, GRID, SELF, check, fwd_vjp, make_inputs

from jvarlen.kernels import BlockSizes, block_info_for, pallas_triton
from jvarlen.kernels import testing as kt
from jvarlen.kernels.common import pad_axis, round_up


@pytest.mark.parametrize("h,hkv,d,layout,causal", GRID)
def test_pallas_matches_reference_f32(causal, h, hkv, d, layout):
    check("pallas", layout, h, hkv, d, causal)


def test_pallas_matches_reference_bf16():
    # (The XLA bf16 test uses D=64; f32 grids cover both head dims for both paths.)
    check("pallas", CONTEXT, 4, 2, 128, True, dtype=jnp.bfloat16)


def test_three_implementations_agree_with_batch_axis():
    # Row 0: context attention; row 1: the same keys, a different slice layout.
    other = kt.build([(1, 150, 50), (0, 0, 10), (3, 5, 40)])
    q_seg, q_pos, kv_seg, kv_pos = (
        jnp.stack([jnp.asarray(a), jnp.asarray(b)]) for a, b in zip(CONTEXT, (*other, *CONTEXT[2:]))
    )
    q, k, v, ct = make_inputs(7, q_seg.shape[1], kv_seg.shape[1], 4, 2, 64, batch=2)
    res = {
        impl: fwd_vjp(q, k, v, ct, q_seg, kv_seg, q_pos, kv_pos, impl=impl, causal=True, bq=32, bk=16)
        for impl in ("pallas", "xla", "reference")
    }
    for a, b in (("pallas", "xla"), ("pallas", "reference"), ("xla", "reference")):
        (oa, ga), (ob, gb) = res[a], res[b]
        assert kt.rel_err(oa, ob) <= 2e-5, (a, b)
        for x, y in zip(ga, gb):
            assert kt.rel_err(x, y) <= 2e-5, (a, b)


def _padded(layout, h, hkv, d, bs, seed=0):
    """Kernel-level inputs: padded to whole blocks, batch axis, plus the schedule."""
    q_seg, q_pos, kv_seg, kv_pos = (jnp.asarray(x)[None] for x in layout)
    t, s = q_seg.shape[1], kv_seg.shape[1]
    q, k, v, do = make_inputs(seed, t, s, h, hkv, d, batch=1)
    info = block_info_for(q_seg, kv_seg, q_pos, kv_pos, causal=True, block_sizes=bs)
    tp, sp = round_up(t, bs.block_q), round_up(s, bs.block_kv)
    q, do, q_seg, q_pos = (pad_axis(x, 1, tp) for x in (q, do, q_seg, q_pos))
    k, v, kv_seg, kv_pos = (pad_axis(x, 1, sp) for x in (k, v, kv_seg, kv_pos))
    return (q, k, v, q_seg, q_pos, kv_seg, kv_pos, info), do


def test_every_output_element_is_written():
    """Interpret mode fills kernel outputs with NaN before running: any element a
    kernel forgets to write (padding rows, tiles with nothing visible, empty kv
    blocks) stays NaN."""
    # kv block 2 (tokens 64..95) is all padding; the last q rows are padding too.
    q_seg, q_pos = kt.build([(1, 10, 30), (2, 0, 20), (0, 0, 50)])
    kv_seg, kv_pos = kt.build([(1, 0, 40), (2, 0, 20), (0, 0, 36), (2, 0, 0)])
    layout = (q_seg, q_pos, kv_seg, kv_pos)
    args, do = _padded(layout, 4, 2, 64, BlockSizes(32, 32))
    kw = dict(causal=True, sm_scale=0.125, interpret=True)
    options = values_compile()
    o, lse = jax.jit(pallas_triton.forward, static_argnames=tuple(kw), compiler_options=options)(*args, **kw)
    grads = jax.jit(pallas_triton.backward, static_argnames=tuple(kw), compiler_options=options)(
        *args, o, lse, do, **kw
    )
    for name, x in zip(["o", "lse", "dq", "dk", "dv"], [o, lse, *grads]):
        assert np.isfinite(np.asarray(x)).all(), name
    assert np.all(np.asarray(lse)[:, :, 50:] == -1e30)  # padding rows: finite sentinel lse
    assert np.all(np.asarray(grads[1])[0, 64:96] == 0)  # padding keys get zero grads


# Causal context layouts are covered by hypothesis in test_kernels_properties.py.
@pytest.mark.parametrize("layout,causal", [(CONTEXT, False), (SELF, True)])
def test_block_skipping_counts_visited_tiles(layout, causal):
    bs = BlockSizes(16, 16)
    args, _ = _padded(layout, 2, 1, 64, bs)
    q, k, v, q_seg, q_pos, kv_seg, kv_pos, _ = args
    info = block_info_for(
        *(jnp.asarray(x)[None] for x in (layout[0], layout[2], layout[1], layout[3])), causal=causal, block_sizes=bs
    )
    visited = jax.jit(
        pallas_triton.tiles_visited, static_argnames=("causal", "sm_scale"), compiler_options=values_compile()
    )(q, k, v, q_seg, q_pos, kv_seg, kv_pos, info, causal=causal, sm_scale=0.125)
    expected = kt.visible_tiles(kt.visible_pairs(*layout[:2], *layout[2:], causal=causal), 16, 16)
    np.testing.assert_array_equal(np.asarray(visited)[0, 0], expected)
    np.testing.assert_array_equal(np.asarray(visited)[0, 1], expected)
    nk = -(-len(layout[2]) // 16)
    assert expected.sum() < len(expected) * nk  # the layout does hide tiles


@pytest.mark.parametrize("d,hkv", [(64, 4), (128, 1)])
def test_kernels_lower_to_triton(d, hkv):
    """The kernels pass the real (non-interpret) Triton lowering for a GPU target."""
    from jvarlen.kernels import varlen_attention

    def loss(q, k, v, qs, ks, qp, kp):
        o = varlen_attention(
            q,
            k,
            v,
            q_segment_ids=qs,
            kv_segment_ids=ks,
            q_positions=qp,
            kv_positions=kp,
            implementation="pallas",
            interpret=False,
            block_sizes=BlockSizes(64, 64),
        )
        return o.astype(jnp.float32).sum()

    sds = jax.ShapeDtypeStruct
    args = (
        sds((2, 200, 4, d), jnp.bfloat16),
        sds((2, 300, hkv, d), jnp.bfloat16),
        sds((2, 300, hkv, d), jnp.bfloat16),
        sds((2, 200), jnp.int32),
        sds((2, 300), jnp.int32),
        sds((2, 200), jnp.int32),
        sds((2, 300), jnp.int32),
    )
    try:
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",))
    except RuntimeError as e:  # JAX >= 0.12 asks Triton lowering for a (real or abstract) GPU device
        if "No supported GPU devices found" not in str(e):
            raise
        pytest.skip("this JAX lowers Triton only for a GPU device; tests/test_gpu_aot.py compiles for an abstract one")
    text = lowered.as_text()
    for name in ("varlen_flash_fwd", "varlen_flash_dq", "varlen_flash_dkv"):
        assert name in text


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_blocks_on_a_packed_context_slice(dtype):
    """Default 128x128 blocks, 1024 queries: a long document's slice after 512 context
    tokens, then documents of assorted lengths and a padding tail."""
    pieces = [(1, 700, 300), (2, 0, 129), (3, 0, 1), (4, 0, 255), (5, 0, 200), (0, 0, 139)]
    layout = kt.context_layout(pieces, 512)
    check("pallas", layout, 8, 2, 128, True, dtype=dtype, bq=128, bk=128)
    check("xla", layout, 8, 2, 128, True, dtype=dtype, bq=128, bk=128)
