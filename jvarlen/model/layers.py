"""Building blocks of the LLaMA-style decoder: RMSNorm, rotary embeddings, GQA, SwiGLU.

Parameters carry logical axis names (``axes=``); jvarlen.parallel maps them to mesh axes.
Shapes: B batch rows, T tokens, d model width, H query heads, K kv heads, D head dim,
F MLP width.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jvarlen.config import ModelConfig
from jvarlen.model.attention import AttentionFn, AttentionInputs
from jvarlen.model.rope import inverse_frequencies, rotary

# The data-parallel layouts leave the reduction of a weight's gradient over dp / sp to GSPMD, which
# places it at the dot that produces the gradient, in that dot's output dtype: on a GPU, bf16 partial
# sums summed in bf16 (XLA:CPU sums in fp32). Under :func:`fp32_weight_gradients` the layer matmuls
# give their weight gradient an fp32 output, so the sum is fp32 and rounded to bf16 once, as one
# device's dot rounds it (twice the bytes of that reduction). Only there: the pipeline executor and
# the groups sum per-device fp32 accumulators themselves, and their residual policies must see the
# dots, which a custom VJP hides.
_FP32_WEIGHT_GRADIENTS = contextvars.ContextVar("fp32_weight_gradients", default=False)


@contextlib.contextmanager
def fp32_weight_gradients():
    """While tracing inside it, :func:`project` computes weight gradients with an fp32 output."""
    token = _FP32_WEIGHT_GRADIENTS.set(True)
    try:
        yield
    finally:
        _FP32_WEIGHT_GRADIENTS.reset(token)


def project(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``einsum(spec, x, w)`` of activations ``x`` and a weight ``w`` (see :func:`fp32_weight_gradients`)."""
    if _FP32_WEIGHT_GRADIENTS.get():
        return _project_fp32_weight_gradient(spec, x, w)
    return jnp.einsum(spec, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _project_fp32_weight_gradient(spec, x, w):
    return jnp.einsum(spec, x, w)


def _project_forward(spec, x, w):
    return jnp.einsum(spec, x, w), (x, w)


def _project_backward(spec, residuals, dy):
    x, w = residuals
    inputs, y_axes = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    dx = jnp.einsum(f"{y_axes},{w_axes}->{x_axes}", dy, w)
    dw = jnp.einsum(f"{x_axes},{y_axes}->{w_axes}", x, dy, preferred_element_type=jnp.float32)
    return dx, dw.astype(w.dtype)


_project_fp32_weight_gradient.defvjp(_project_forward, _project_backward)


def _param(rngs: nnx.Rngs, shape, axes, dtype, scale: float) -> nnx.Param:
    init = jax.nn.initializers.normal(stddev=scale)
    return nnx.Param(init(rngs.params(), shape, dtype), axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype), axes=("embed",))
        self.eps = eps

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x32 = x_btd.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x_btd.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention over packed documents (optional q/k/v biases, as Qwen2 has)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype):
        d, h, k, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = _param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), dtype, d**-0.5)
        self.wk = _param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), dtype, d**-0.5)
        self.wv = _param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), dtype, d**-0.5)
        self.wo = _param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), dtype, (h * hd) ** -0.5)
        if cfg.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((h, hd), dtype), axes=("heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((k, hd), dtype), axes=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((k, hd), dtype), axes=("kv_heads", "head_dim"))
        self.qkv_bias = cfg.qkv_bias
        self.head_dim = hd
        self.rope_theta = cfg.rope_theta
        self.rope_scaling = cfg.rope_scaling

    def qkv(self, x_btd: jax.Array, positions_bt: jax.Array, compute_dtype):
        q = project("btd,dhk->bthk", x_btd, self.wq[...].astype(compute_dtype))
        k = project("btd,dhk->bthk", x_btd, self.wk[...].astype(compute_dtype))
        v = project("btd,dhk->bthk", x_btd, self.wv[...].astype(compute_dtype))
        if self.qkv_bias:
            q = q + self.q_bias[...].astype(compute_dtype)
            k = k + self.k_bias[...].astype(compute_dtype)
            v = v + self.v_bias[...].astype(compute_dtype)
        inv_freq = inverse_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
        return rotary(q, positions_bt, inv_freq), rotary(k, positions_bt, inv_freq), v

    def __call__(self, x_btd, inputs: AttentionInputs, attention_fn: AttentionFn, compute_dtype):
        q, k, v = self.qkv(x_btd, inputs.positions, compute_dtype)
        out_bthk = attention_fn(q, k, v, inputs)
        return project("bthk,hkd->btd", out_bthk.astype(compute_dtype), self.wo[...].astype(compute_dtype))


class SwiGLU(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype):
        d, f = cfg.d_model, cfg.mlp_dim
        self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), dtype, d**-0.5)
        self.w_up = _param(rngs, (d, f), ("embed", "mlp"), dtype, d**-0.5)
        self.w_down = _param(rngs, (f, d), ("mlp", "embed"), dtype, f**-0.5)

    def __call__(self, x_btd, compute_dtype):
        gate = project("btd,df->btf", x_btd, self.w_gate[...].astype(compute_dtype))
        up = project("btd,df->btf", x_btd, self.w_up[...].astype(compute_dtype))
        return project("btf,fd->btd", jax.nn.silu(gate) * up, self.w_down[...].astype(compute_dtype))


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)); x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.param_dtype)
        self.attention_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype)
        self.attention = Attention(cfg, rngs=rngs, dtype=dtype)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype)
        self.mlp = SwiGLU(cfg, rngs=rngs, dtype=dtype)

    def __call__(self, x_btd, inputs: AttentionInputs, attention_fn: AttentionFn, compute_dtype):
        x_btd = x_btd + self.attention(self.attention_norm(x_btd), inputs, attention_fn, compute_dtype)
        return x_btd + self.mlp(self.mlp_norm(x_btd), compute_dtype)


def layer_with_context(
    layer: DecoderLayer,
    x_btd,
    inputs: AttentionInputs,
    attention_fn: AttentionFn,
    compute_dtype,
    ctx_k=None,
    ctx_v=None,
    *,
    rotary_positions=None,
    to_heads=None,
    to_seq=None,
):
    """One decoder layer whose keys are ``[ctx_k; own k]``; returns ``(y, k, v)``.

    x [B, T, d]; ctx_k/ctx_v [B, Sc, K, D] (or None: plain self-attention); ``inputs``'
    kv fields then describe the Sc + T keys. k/v [B, T, K, D] are this layer's own keys
    and values (after rotary), for later slices of the same document. Used by the
    pipeline executor; equal to ``layer(...)`` when there is no context and no hooks.

    Sequence parallelism (Ulysses): x holds this device's T/sp tokens, ``rotary_positions``
    their positions, ``to_heads(q, k, v)`` trades tokens for heads before attention (k/v and
    the context are then [B, T, K/sp, D]) and ``to_seq(out)`` trades back.
    """
    attn = layer.attention
    positions = inputs.positions if rotary_positions is None else rotary_positions
    q, k, v = attn.qkv(layer.attention_norm(x_btd), positions, compute_dtype)
    if to_heads is not None:
        q, k, v = to_heads(q, k, v)
    keys, values = k, v
    if ctx_k is not None:
        keys = jnp.concatenate([ctx_k.astype(k.dtype), k], axis=1)
        values = jnp.concatenate([ctx_v.astype(v.dtype), v], axis=1)
    out_bthk = attention_fn(q, keys, values, inputs)
    if to_seq is not None:
        out_bthk = to_seq(out_bthk)
    x_btd = x_btd + jnp.einsum("bthk,hkd->btd", out_bthk.astype(compute_dtype), attn.wo[...].astype(compute_dtype))
    return x_btd + layer.mlp(layer.mlp_norm(x_btd), compute_dtype), k, v
