"""Public varlen attention entry point: validation, padding, dispatch, custom_vjp."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jvarlen.kernels import xla_blockwise
from jvarlen.kernels.block_ranges import BlockInfo, compute_block_info
from jvarlen.kernels.common import BlockSizes, UnsupportedError, fit_block_sizes, next_power_of_2, pad_axis, round_up
from jvarlen.kernels.gpu_config import MAX_HEAD_DIM, KernelConfig, compiles_for_gpu, current_target, kernel_config
from jvarlen.kernels.reference import reference_attention

IMPLEMENTATIONS = ("auto", "pallas", "xla", "reference")
ATTENTION_RESIDUALS = ("attention_out", "attention_lse")  # checkpoint names of the saved forward
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _backend(name):
    """-> (forward, backward) of the blockwise backend ``name``."""
    if name == "pallas":
        from jvarlen.kernels import pallas_triton  # lazy: pulls in jax.experimental.pallas

        return pallas_triton.forward, pallas_triton.backward
    return xla_blockwise.forward, xla_blockwise.backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _flash(backend, causal, sm_scale, launch, q, k, v, q_seg, q_pos, kv_seg, kv_pos, info):
    """-> (out [B, T, H, D], lse [B, H, T] f32); both differentiable.

    ``launch``: (interpret, KernelConfig) for the Pallas backend, None for XLA."""
    return _flash_fwd(backend, causal, sm_scale, launch, q, k, v, q_seg, q_pos, kv_seg, kv_pos, info)[0]


def _kw(backend, causal, sm_scale, launch):
    kw = dict(causal=causal, sm_scale=sm_scale)
    if backend == "pallas":
        kw["interpret"], kw["config"] = launch
    return kw


def _flash_fwd(backend, causal, sm_scale, launch, q, k, v, q_seg, q_pos, kv_seg, kv_pos, info):
    fwd, _ = _backend(backend)
    o, lse = fwd(q, k, v, q_seg, q_pos, kv_seg, kv_pos, info, **_kw(backend, causal, sm_scale, launch))
    # named so that a jax.checkpoint policy can keep them (ATTENTION_RESIDUALS) and a
    # rematerialised backward does not rerun the attention forward
    o, lse = checkpoint_name(o, "attention_out"), checkpoint_name(lse, "attention_lse")
    return (o, lse), (q, k, v, q_seg, q_pos, kv_seg, kv_pos, info, o, lse)


def _flash_bwd(backend, causal, sm_scale, launch, res, cts):
    q, k, v, q_seg, q_pos, kv_seg, kv_pos, info, o, lse = res
    do, dlse = cts
    _, bwd = _backend(backend)
    # d lse_i / d s_ij = p_ij, so an lse cotangent enters as delta_i -= dlse_i.
    dq, dk, dv = bwd(
        q, k, v, q_seg, q_pos, kv_seg, kv_pos, info, o, lse, do, dlse, **_kw(backend, causal, sm_scale, launch)
    )
    return dq, dk, dv, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check_int(name, x, shape):
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32), got dtype {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} (one entry per token, batch axis matching q)"
        )


def _validate(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if q.ndim not in (3, 4):
        raise ValueError(f"q must be [T, H, D] or [B, T, H, D], got rank {q.ndim} shape {q.shape}")
    for name, x in (("k", k), ("v", v)):
        if x.ndim != q.ndim:
            raise ValueError(f"{name} must have the rank of q ({q.ndim}), got shape {x.shape}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not any(x.dtype == dt for dt in _FLOAT_DTYPES):
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    *qb, t, h, d = q.shape
    *kb, s, hkv, dk = k.shape
    if qb != kb:
        raise ValueError(f"batch sizes of q {q.shape} and k {k.shape} differ")
    if t == 0 or s == 0 or 0 in qb or d == 0 or h == 0:
        raise ValueError(
            f"varlen_attention needs at least one query and one key token (and non-empty batch, heads and head "
            f"dim); got q {tuple(q.shape)}, k {tuple(k.shape)}: nothing to attend over, drop the empty batch instead"
        )
    if dk != d:
        raise ValueError(f"head dims differ: q has {d}, k/v have {dk}")
    if hkv == 0 or h % hkv:
        raise ValueError(f"q heads ({h}) must be a multiple of kv heads ({hkv}) (GQA/MQA)")
    _check_int("q_segment_ids", q_segment_ids, (*qb, t))
    _check_int("q_positions", q_positions, (*qb, t))
    _check_int("kv_segment_ids", kv_segment_ids, (*qb, s))
    _check_int("kv_positions", kv_positions, (*qb, s))


def varlen_attention(
    q,
    k,
    v,
    *,
    q_segment_ids,
    kv_segment_ids,
    q_positions,
    kv_positions,
    causal: bool = True,
    sm_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    implementation: str = "auto",
    interpret: bool | None = None,
    block_info: BlockInfo | None = None,
    return_lse: bool = False,
    kernel_config: KernelConfig | None = None,
):
    """Attention over packed variable-length documents.

    q [T, H, D] or [B, T, H, D]; k, v [S, Hkv, D] or [B, S, Hkv, D] with H % Hkv == 0;
    segment ids / positions [T] / [S] (or [B, T] / [B, S]) int32. A query sees a key
    iff both have the same non-zero segment id and (causal) kv_position <= q_position.
    Rows seeing no key return 0. Returns the shape and dtype of q; with
    ``return_lse`` also the softmax logsumexp [H, T] / [B, H, T] float32 (differentiable;
    ``EMPTY_ROW_LSE`` = -1e30 for rows seeing no key).

    implementation: "auto" (Pallas on GPU, XLA blockwise elsewhere), "pallas", "xla",
    "reference" (dense; small inputs only). ``interpret`` (Pallas only) defaults to
    True off GPU. ``block_info``: a schedule from ``block_info_for`` /
    ``compute_block_info`` computed once per batch and shared by all layers;
    computed here when omitted. ``kernel_config`` (Pallas only): the kernels' tiles,
    warps and stages; by default chosen for the GPU compiled for (``gpu_config``), the
    schedule's blocks in interpret mode. The Pallas kernels take head dims up to 256;
    others than 16, 32, 64, 128, 256 are zero-padded to the next one inside (exact).
    """
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    ids = [jnp.asarray(x) for x in (q_segment_ids, kv_segment_ids, q_positions, kv_positions)]
    _validate(q, k, v, *ids, implementation)
    q_seg, kv_seg, q_pos, kv_pos = (x.astype(jnp.int32) for x in ids)
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v, q_seg, kv_seg, q_pos, kv_pos = (x[None] for x in (q, k, v, q_seg, kv_seg, q_pos, kv_pos))
    t, d = q.shape[1], q.shape[3]
    s = k.shape[1]
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    on_gpu = compiles_for_gpu()
    if implementation == "auto":
        implementation = "pallas" if on_gpu else "xla"
    if interpret is None:
        interpret = not on_gpu

    if implementation == "reference":
        out, lse = reference_attention(
            q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal=causal, sm_scale=scale, return_lse=True
        )
    else:
        bs = fit_block_sizes(block_sizes or BlockSizes(), t, s)
        if block_info is None:
            block_info = compute_block_info(
                q_seg, kv_seg, q_pos, kv_pos, causal=causal, block_q=bs.block_q, block_kv=bs.block_kv
            )
        _check_block_info(block_info, bs, causal, q.shape[0], t, s)
        tp, sp = round_up(t, bs.block_q), round_up(s, bs.block_kv)
        launch = None
        if implementation == "pallas":
            dp = _kernel_head_dim(d)
            if kernel_config is None:
                kernel_config = kernel_config_for(q.dtype, dp, None if interpret else current_target())
            launch = (bool(interpret), kernel_config)
            # zero columns of q and k add 0 to every score; zero columns of v give zero
            # output columns (sliced off); the scale above used the true d.
            q, k, v = (pad_axis(x, 3, dp) for x in (q, k, v))
        qp, q_seg, q_pos = (pad_axis(x, 1, tp) for x in (q, q_seg, q_pos))
        kp, vp, kv_seg, kv_pos = (pad_axis(x, 1, sp) for x in (k, v, kv_seg, kv_pos))
        out, lse = _flash(
            implementation, bool(causal), scale, launch, qp, kp, vp, q_seg, q_pos, kv_seg, kv_pos, block_info
        )
        out, lse = out[:, :t, :, :d], lse[:, :, :t]
    if unbatched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def _kernel_head_dim(d: int) -> int:
    """The head dim the Pallas kernels run with: the next power of two >= 16 (Triton tiles
    must be powers of two); more than ``MAX_HEAD_DIM`` is refused."""
    if d > MAX_HEAD_DIM:
        raise UnsupportedError(
            f"head dim {d} is larger than the Pallas kernels support ({MAX_HEAD_DIM}: a kv tile and its "
            f"accumulators would not fit a GPU's shared memory and registers); use implementation='xla'"
        )
    return max(16, next_power_of_2(d))


def kernel_config_for(dtype, head_dim: int, target=None) -> KernelConfig:
    """The Pallas launch configuration ``varlen_attention`` uses for ``dtype`` inputs of
    ``head_dim`` (padded as the kernels pad it) on ``target`` (None: interpret mode)."""
    return kernel_config(dtype, _kernel_head_dim(head_dim), target)


def block_info_for(
    q_segment_ids,
    kv_segment_ids,
    q_positions,
    kv_positions,
    *,
    causal: bool = True,
    block_sizes: BlockSizes | None = None,
) -> BlockInfo:
    """The schedule ``varlen_attention`` would compute for these ids and block sizes.

    Call once per batch and pass as ``block_info=`` to every layer.
    """
    t, s = jnp.shape(q_segment_ids)[-1], jnp.shape(kv_segment_ids)[-1]
    bs = fit_block_sizes(block_sizes or BlockSizes(), t, s)
    return compute_block_info(
        q_segment_ids,
        kv_segment_ids,
        q_positions,
        kv_positions,
        causal=causal,
        block_q=bs.block_q,
        block_kv=bs.block_kv,
    )


def _check_block_info(info, bs, causal, b, t, s):
    want = (bs.block_q, bs.block_kv, bool(causal), t, s)
    got = (info.block_q, info.block_kv, info.causal, info.t, info.s)
    if got != want:
        raise ValueError(
            f"block_info was built for (block_q, block_kv, causal, T, S)={got}, "
            f"this call needs {want}; build it with block_info_for(...)"
        )
    if info.fwd_counts.shape[0] != b:
        raise ValueError(f"block_info batch {info.fwd_counts.shape[0]} != batch {b}")
