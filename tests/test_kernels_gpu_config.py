"""Kernel launch configurations: sub-block tiles, head-dim padding, float16, refusals, the
per-GPU table, ``compile_for`` and the layer remat policy (one attention forward)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import values_compile
from test_kernels_attention import BF16_TOL, CONTEXT, F32_TOL, SELF, make_inputs

from jvarlen import gpu_aot, kernels
from jvarlen.config import ModelConfig
from jvarlen.kernels import BlockSizes, KernelConfig, KernelTiles, UnsupportedError, varlen_attention
from jvarlen.kernels import testing as kt
from jvarlen.kernels.gpu_config import GpuTarget, compiles_for_gpu, current_target, kernel_config
from jvarlen.model import AttentionInputs, build_model
from jvarlen.model.transformer import resolve_compute_dtype


@functools.partial(jax.jit, static_argnames=("impl", "config", "bq", "bk"), compiler_options=values_compile())
def _fwd_vjp(q, k, v, ct, q_seg, kv_seg, q_pos, kv_pos, *, impl, config=None, bq=32, bk=32):
    def f(q, k, v):
        return varlen_attention(
            q,
            k,
            v,
            q_segment_ids=q_seg,
            kv_segment_ids=kv_seg,
            q_positions=q_pos,
            kv_positions=kv_pos,
            block_sizes=BlockSizes(bq, bk),
            implementation=impl,
            kernel_config=config,
        )

    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(ct)


def _check(layout, h, hkv, d, config, dtype=jnp.float32):
    ids = [jnp.asarray(x) for x in (layout[0], layout[2], layout[1], layout[3])]
    q, k, v, ct = make_inputs(3, len(layout[0]), len(layout[2]), h, hkv, d, dtype)
    out, grads = _fwd_vjp(q, k, v, ct, *ids, impl="pallas", config=config)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]
    ref_out, ref_grads = _fwd_vjp(*f32, *ids, impl="reference")
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    assert out.shape == q.shape and out.dtype == dtype
    assert kt.rel_err(out, ref_out) <= tol, ("out", kt.rel_err(out, ref_out))
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert g.dtype == dtype
        assert kt.rel_err(g, rg) <= tol, ("d" + name, kt.rel_err(g, rg))


# Tiles smaller than the 32 x 32 schedule blocks, different per kernel: programs own half
# or a quarter of a block and walk its list in sub-tiles (the dkv program loops over the G
# heads of its kv head with a fori_loop).
SUB_TILES = KernelConfig(fwd=KernelTiles(16, 16), dq=KernelTiles(32, 16), dkv=KernelTiles(16, 16))


@pytest.mark.parametrize("layout,h,hkv", [(CONTEXT, 4, 2), (SELF, 4, 1)])
def test_sub_block_tiles_are_exact(layout, h, hkv):
    _check(layout, h, hkv, 64, SUB_TILES)


def test_head_dim_not_a_power_of_two_is_padded_exactly():
    _check(CONTEXT, 4, 2, 80, None)


def test_float16_inputs():
    _check(CONTEXT, 4, 2, 64, SUB_TILES, dtype=jnp.float16)


def test_head_dim_above_256_is_refused_for_pallas():
    q = jnp.zeros((32, 2, 320), jnp.bfloat16)
    ids = jnp.ones((32,), jnp.int32)
    kw = dict(q_segment_ids=ids, kv_segment_ids=ids, q_positions=ids, kv_positions=ids)
    with pytest.raises(UnsupportedError, match="head dim 320 .* implementation='xla'"):
        varlen_attention(q, q, q, implementation="pallas", **kw)
    assert varlen_attention(q, q, q, implementation="xla", **kw).shape == q.shape


def test_target_spec_parsing():
    h100, a100 = gpu_aot.gpu_target("h100"), gpu_aot.gpu_target("a100")
    assert (h100.compute_capability, h100.shared_memory_per_block) == ((9, 0), 232_448)
    assert (a100.compute_capability, a100.shared_memory_per_block) == ((8, 0), 166_912)
    assert h100.memory_bytes == 84_942_979_072 and a100.memory_bytes == 85_100_068_864


@pytest.mark.parametrize("smem", [232_448, 166_912, 101_376])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_table_covers_supported_head_dims(smem, dtype):
    target = GpuTarget("gpu", (8, 0), smem)
    for d in (16, 32, 64, 80, 96, 128, 256):
        cfg = kernels.kernel_config_for(dtype, d, target)
        for tiles in (cfg.fwd, cfg.dq, cfg.dkv):
            assert 128 % tiles.block_q == 0 and 128 % tiles.block_kv == 0
            assert tiles.num_warps in (4, 8)
    with pytest.raises(UnsupportedError):
        kernel_config(jnp.float64, 64, target)
    assert kernel_config(dtype, 64, None) == KernelConfig()  # interpret mode: schedule blocks


def test_compile_for_selects_gpu_settings():
    assert not compiles_for_gpu() and current_target() is None
    assert resolve_compute_dtype("auto") == jnp.float32
    with kernels.compile_for(gpu_aot.target_spec("h100")) as target:
        assert compiles_for_gpu() and current_target() == target
        assert target.shared_memory_per_block == 232_448
        assert resolve_compute_dtype("auto") == jnp.bfloat16
    assert current_target() is None


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_layer_remat_keeps_attention_output_and_lse(implementation):
    """With model.remat a layer saves what its policy names, attention's output and
    logsumexp, so its backward never reruns the attention forward (the compiled-HLO kernel
    count is in tests/test_gpu_aot.py); the model's gradients equal the un-rematerialised ones."""
    import contextlib
    import io

    from flax import nnx
    from jax.ad_checkpoint import print_saved_residuals

    from jvarlen.model.attention import make_attention_fn
    from jvarlen.model.transformer import layer_body

    cfgs = [
        ModelConfig(
            num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=128, remat=r, attention=implementation
        )
        for r in (True, False)
    ]
    tokens = jnp.asarray(np.arange(64) % 300, jnp.int32)[None]
    seg, pos = jnp.ones((1, 64), jnp.int32), jnp.arange(64, dtype=jnp.int32)[None]
    model = build_model(cfgs[0])
    inputs = AttentionInputs(seg, pos).with_block_info(implementation)
    layers_graphdef, stacked = nnx.split(model.layers)
    body = layer_body(layers_graphdef, inputs, make_attention_fn(implementation), compute_dtype=jnp.float32, remat=True)
    one_layer = jax.tree.map(lambda x: x[0], stacked)
    x = jax.random.normal(jax.random.key(0), (1, 64, 64))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda x, s: body(x, s)[0].sum(), x, one_layer)
    saved = out.getvalue()
    assert "named 'attention_out'" in saved and "named 'attention_lse'" in saved, saved
    assert "pallas_call" not in saved and "while" not in saved, saved  # no other attention value

    if implementation != "xla":  # interpret-mode Pallas gradients are slow; kernels are tested elsewhere
        return
    graphdef, params = nnx.split(model)
    plain_graphdef, _ = nnx.split(build_model(cfgs[1]))

    def loss(p, gd=graphdef):
        return nnx.merge(gd, p)(tokens, AttentionInputs(seg, pos)).sum()

    g_remat = jax.grad(loss)(params)
    g_plain = jax.grad(functools.partial(loss, gd=plain_graphdef))(params)
    for a, b in zip(jax.tree.leaves(g_remat), jax.tree.leaves(g_plain)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
