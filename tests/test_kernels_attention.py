"""varlen_attention (XLA blockwise path) against the dense reference; input validation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import values_compile

from jvarlen.kernels import BlockSizes, block_info_for, reference_attention, varlen_attention
from jvarlen.kernels import testing as kt

F32_TOL = 2e-5
BF16_TOL = 2e-2


@functools.partial(jax.jit, static_argnames=("impl", "causal", "bq", "bk"), compiler_options=values_compile())
def _fwd_vjp(q, k, v, ct, q_seg, kv_seg, q_pos, kv_pos, info, *, impl, causal, bq, bk):
    def f(q, k, v):
        return varlen_attention(
            q,
            k,
            v,
            q_segment_ids=q_seg,
            kv_segment_ids=kv_seg,
            q_positions=q_pos,
            kv_positions=kv_pos,
            causal=causal,
            block_sizes=BlockSizes(bq, bk),
            implementation=impl,
            block_info=info,
        )

    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(ct)


def fwd_vjp(q, k, v, ct, q_seg, kv_seg, q_pos, kv_pos, *, impl, causal, bq, bk):
    """-> (out, (dq, dk, dv)) for cotangent ``ct``.

    The schedule is built by its own (cached) jit outside, as the model does once per
    batch; this also keeps its compilation out of every test's compile time.
    """
    info = None
    if impl != "reference":
        info = block_info_for(q_seg, kv_seg, q_pos, kv_pos, causal=causal, block_sizes=BlockSizes(bq, bk))
    return _fwd_vjp(q, k, v, ct, q_seg, kv_seg, q_pos, kv_pos, info, impl=impl, causal=causal, bq=bq, bk=bk)


attention = jax.jit(
    varlen_attention,
    static_argnames=("causal", "sm_scale", "block_sizes", "implementation", "interpret"),
    compiler_options=values_compile(),
)


def make_inputs(seed, t, s, h, hkv, d, dtype=jnp.float32, batch=None):
    rng = np.random.default_rng(seed)
    lead = () if batch is None else (batch,)
    arrs = [
        rng.normal(size=lead + shape).astype(np.float32) for shape in ((t, h, d), (s, hkv, d), (s, hkv, d), (t, h, d))
    ]
    return [jnp.asarray(a, dtype) for a in arrs]


def check(impl, layout, h, hkv, d, causal, *, dtype=jnp.float32, bq=32, bk=32, seed=0):
    q_seg, q_pos, kv_seg, kv_pos = (jnp.asarray(x) for x in layout)
    q, k, v, ct = make_inputs(seed, q_seg.shape[-1], kv_seg.shape[-1], h, hkv, d, dtype)
    ids = (q_seg, kv_seg, q_pos, kv_pos)
    out, grads = fwd_vjp(q, k, v, ct, *ids, impl=impl, causal=causal, bq=bq, bk=bk)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]
    ref_out, ref_grads = fwd_vjp(*f32, *ids, impl="reference", causal=causal, bq=bq, bk=bk)
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    assert out.dtype == q.dtype and out.shape == q.shape
    assert kt.rel_err(out, ref_out) <= tol, ("out", kt.rel_err(out, ref_out))
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert g.dtype == dtype
        assert kt.rel_err(g, rg) <= tol, ("d" + name, kt.rel_err(g, rg))
    return out, grads


# The slice of a long document (positions 200..) attends to 70 context tokens of it,
# then short documents, a padding run and an empty-ish tail; T=100, S=170: neither a
# multiple of the 32-blocks.
CONTEXT = kt.context_layout([(1, 200, 37), (2, 0, 20), (0, 0, 9), (3, 0, 33), (4, 0, 1)], 70)
SELF = kt.build([(1, 0, 45), (0, 0, 3), (2, 0, 60), (3, 0, 7), (0, 0, 5)])
SELF = (SELF[0], SELF[1], SELF[0], SELF[1])
# GQA ratios 1, 2, 4; head dims 64, 128; causal and not; context and self attention.
GRID = [
    (4, 4, 64, CONTEXT, True),
    (4, 2, 128, SELF, True),
    (4, 1, 64, CONTEXT, False),
    (4, 2, 128, CONTEXT, False),
]


@pytest.mark.parametrize("h,hkv,d,layout,causal", GRID)
def test_xla_matches_reference_f32(causal, h, hkv, d, layout):
    check("xla", layout, h, hkv, d, causal)


def test_xla_matches_reference_bf16():
    check("xla", CONTEXT, 4, 2, 64, True, dtype=jnp.bfloat16)


def test_rows_without_keys_are_zero_and_finite():
    # Query segment 9 has no key; padding queries see nothing either. Same shapes and
    # settings as GRID[0], so the compiled functions are reused.
    q_seg, q_pos = kt.build([(9, 0, 40), (1, 0, 40), (0, 0, 20)])
    kv_seg, kv_pos = kt.build([(1, 0, 40), (0, 0, 130)])
    out, grads = check("xla", (q_seg, q_pos, kv_seg, kv_pos), 4, 4, 64, True)
    empty = np.asarray(q_seg != 1)
    assert empty.sum() == 60 and np.all(np.asarray(out)[empty] == 0)
    assert np.all(np.asarray(grads[0])[empty] == 0)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_precomputed_block_info_is_used_and_checked():
    q_seg, q_pos, kv_seg, kv_pos = CONTEXT
    q, k, v, _ = make_inputs(2, len(q_seg), len(kv_seg), 2, 2, 64)
    bs = BlockSizes(32, 32)
    info = block_info_for(q_seg, kv_seg, q_pos, kv_pos, causal=True, block_sizes=bs)
    kw = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=q_pos, kv_positions=kv_pos, block_sizes=bs)
    out = attention(q, k, v, block_info=info, **kw)
    ref = attention(q, k, v, implementation="reference", **kw)
    assert kt.rel_err(out, ref) <= F32_TOL
    with pytest.raises(ValueError, match="block_info was built for"):
        varlen_attention(q, k, v, block_info=info, causal=False, **kw)


def _call(q, k, v, q_seg=None, kv_seg=None, **kw):
    q_seg = jnp.ones(q.shape[:-2], jnp.int32) if q_seg is None else q_seg
    kv_seg = jnp.ones(k.shape[:-2], jnp.int32) if kv_seg is None else kv_seg
    return varlen_attention(
        q,
        k,
        v,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        q_positions=jnp.zeros_like(q_seg),
        kv_positions=jnp.zeros_like(kv_seg),
        **kw,
    )


@pytest.mark.parametrize(
    "args,err,match",
    [
        (((8, 64), (8, 1, 64), (8, 1, 64)), ValueError, "rank"),
        (((8, 2, 64), (8, 2, 1, 64), (8, 2, 1, 64)), ValueError, "rank of q"),
        (((8, 3, 64), (8, 2, 64), (8, 2, 64)), ValueError, "multiple of kv heads"),
        (((8, 2, 64), (8, 1, 32), (8, 1, 32)), ValueError, "head dims"),
        (((8, 2, 64), (8, 1, 64), (9, 1, 64)), ValueError, "k and v shapes"),
        (((2, 8, 2, 64), (3, 8, 1, 64), (3, 8, 1, 64)), ValueError, "batch sizes"),
    ],
)
def test_shape_errors(args, err, match):
    q, k, v = (jnp.zeros(s, jnp.float32) for s in args)
    with pytest.raises(err, match=match):
        if q.ndim < 3:
            varlen_attention(
                q,
                k,
                v,
                q_segment_ids=jnp.ones(8, jnp.int32),
                kv_segment_ids=jnp.ones(8, jnp.int32),
                q_positions=jnp.zeros(8, jnp.int32),
                kv_positions=jnp.zeros(8, jnp.int32),
            )
        else:
            _call(q, k, v)


def test_dtype_and_id_errors():
    q = jnp.zeros((8, 2, 64))
    k = jnp.zeros((8, 1, 64))
    with pytest.raises(TypeError, match="share a dtype"):
        _call(q, k.astype(jnp.bfloat16), k)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        _call(q.astype(jnp.int32), k.astype(jnp.int32), k.astype(jnp.int32))
    with pytest.raises(TypeError, match="integer"):
        _call(q, k, k, q_seg=jnp.ones(8, jnp.float32))
    with pytest.raises(ValueError, match="kv_segment_ids has shape"):
        _call(q, k, k, kv_seg=jnp.ones(7, jnp.int32))
    with pytest.raises(ValueError, match="implementation"):
        _call(q, k, k, implementation="cuda")
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(48, 32)


def test_reference_lse_for_empty_rows_is_finite():
    q_seg, q_pos = kt.build([(2, 0, 4), (1, 0, 4)])
    kv_seg, kv_pos = kt.build([(1, 0, 8)])
    q, k, v, _ = make_inputs(3, 8, 8, 1, 1, 16, batch=1)
    ids = [jnp.asarray(x)[None] for x in (q_seg, kv_seg, q_pos, kv_pos)]
    out, lse = reference_attention(q, k, v, *ids, causal=True, sm_scale=0.25, return_lse=True)
    assert np.isfinite(np.asarray(lse)).all()
    assert np.all(np.asarray(out)[0, :4] == 0)


def _loss_fn(impl, t, s):
    seg = jnp.ones((t,), jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)
    kv_seg = jnp.ones((s,), jnp.int32)
    kv_pos = jnp.arange(s, dtype=jnp.int32) - (s - t)  # context: S - T cached tokens

    def loss(q, k, v):
        o = varlen_attention(
            q, k, v, q_segment_ids=seg, kv_segment_ids=kv_seg, q_positions=pos, kv_positions=kv_pos, implementation=impl
        )
        return jnp.sum(o.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


def test_xla_path_does_not_materialise_scores():
    """fwd+bwd temp memory of the blockwise path stays far below one dense T x S score matrix."""
    t, s, h, d = 2048, 2048, 2, 64
    args = (
        jax.ShapeDtypeStruct((t, h, d), jnp.float32),
        jax.ShapeDtypeStruct((s, h, d), jnp.float32),
        jax.ShapeDtypeStruct((s, h, d), jnp.float32),
    )
    temp = jax.jit(_loss_fn("xla", t, s)).lower(*args).compile().memory_analysis().temp_size_in_bytes
    dense_scores = t * s * h * 4
    assert temp < dense_scores / 8, (temp, dense_scores)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_long_context_shapes(impl):
    """128K-token slice attending to 64K context: shapes and dtypes only (eval_shape)."""
    t, s = 131072, 196608
    args = (
        jax.ShapeDtypeStruct((t, 16, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((s, 4, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((s, 4, 128), jnp.bfloat16),
    )
    grads = jax.eval_shape(_loss_fn(impl, t, s), *args)
    assert [(g.shape, g.dtype) for g in grads] == [(a.shape, a.dtype) for a in args]


def test_xla_path_inside_shard_map_with_vma_checks():
    """Batch-sharded call inside shard_map(check_vma=True), as a DP layout would do."""
    from conftest import require_devices
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    require_devices(2)
    mesh = jax.make_mesh((2,), ("dp",), axis_types=(AxisType.Auto,))
    q_seg, q_pos, kv_seg, kv_pos = (jnp.stack([jnp.asarray(x)] * 2) for x in CONTEXT)
    q, k, v, _ = make_inputs(5, q_seg.shape[1], kv_seg.shape[1], 2, 1, 64, batch=2)

    def f(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
        return varlen_attention(
            q,
            k,
            v,
            q_segment_ids=q_seg,
            kv_segment_ids=kv_seg,
            q_positions=q_pos,
            kv_positions=kv_pos,
            implementation="xla",
            block_sizes=BlockSizes(32, 32),
        )

    sharded = jax.shard_map(f, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), check_vma=True)
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v, q_seg, kv_seg, q_pos, kv_pos) ** 2)  # noqa: E731
    g_sharded = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)), compiler_options=values_compile())(q, k, v)
    reference = functools.partial(varlen_attention, implementation="reference")
    g_plain = jax.jit(
        jax.grad(
            loss(
                lambda q, k, v, a, b, c, d: reference(
                    q, k, v, q_segment_ids=a, kv_segment_ids=b, q_positions=c, kv_positions=d
                )
            ),
            argnums=(0, 1, 2),
        ),
        compiler_options=values_compile(),
    )(q, k, v)
    for a, b in zip(g_sharded, g_plain):
        assert kt.rel_err(a, b) <= F32_TOL


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_logsumexp_output_and_its_gradient(impl):
    """return_lse: lse matches the reference on rows that see keys, is the finite
    sentinel on rows that do not, and its cotangent reaches dq, dk, dv."""
    q_seg, q_pos, kv_seg, kv_pos = (jnp.asarray(x) for x in CONTEXT)
    q, k, v, ct = make_inputs(4, len(q_seg), len(kv_seg), 4, 2, 64)
    ct_lse = jnp.asarray(np.random.default_rng(9).normal(size=(4, len(q_seg))), jnp.float32)

    def run(impl):
        def f(q, k, v):
            return varlen_attention(
                q,
                k,
                v,
                q_segment_ids=q_seg,
                kv_segment_ids=kv_seg,
                q_positions=q_pos,
                kv_positions=kv_pos,
                implementation=impl,
                block_sizes=BlockSizes(32, 32),
                return_lse=True,
            )

        (out, lse), vjp = jax.vjp(f, q, k, v)
        return out, lse, vjp((ct, ct_lse))

    run = jax.jit(run, static_argnums=0, compiler_options=values_compile())
    out, lse, grads = run(impl)
    ref_out, ref_lse, ref_grads = run("reference")
    seen = np.asarray(q_seg != 0)
    assert lse.shape == (4, len(q_seg)) and lse.dtype == jnp.float32
    assert np.all(np.asarray(lse)[:, ~seen] == -1e30)
    assert kt.rel_err(np.asarray(lse)[:, seen], np.asarray(ref_lse)[:, seen]) <= F32_TOL
    assert kt.rel_err(out, ref_out) <= F32_TOL
    for g, rg in zip(grads, ref_grads):
        assert kt.rel_err(g, rg) <= F32_TOL
