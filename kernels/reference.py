"""Dense pure-jnp varlen attention: the reference every fast path is tested against.

Materialises the full [B, H, T, S] score matrix: for tests and small inputs only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jvarlen.kernels.common import EMPTY_ROW_LSE, visible


def reference_attention(
    q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, causal: bool, sm_scale: float, return_lse: bool = False
):
    """q [B, T, H, D], k/v [B, S, Hkv, D], ids/positions [B, T] / [B, S].

    Returns out [B, T, H, D] (dtype of q) and, if asked, lse [B, H, T] float32.
    Scores and softmax in float32 at HIGHEST precision; rows seeing no key give 0.
    """
    _, _, h, _ = q.shape
    hkv = k.shape[2]
    g = h // hkv
    hp = jax.lax.Precision.HIGHEST
    qf = q.astype(jnp.float32)
    kf = jnp.repeat(k.astype(jnp.float32), g, axis=2)  # [B, S, H, D]
    vf = jnp.repeat(v.astype(jnp.float32), g, axis=2)
    s_bhts = jnp.einsum("bthd,bshd->bhts", qf, kf, precision=hp) * sm_scale
    mask_bts = visible(q_seg, q_pos, kv_seg, kv_pos, causal)
    mask_bhts = mask_bts[:, None]
    m_bht = jax.lax.stop_gradient(jnp.max(jnp.where(mask_bhts, s_bhts, -jnp.inf), axis=-1))
    m_bht = jnp.where(jnp.isfinite(m_bht), m_bht, 0.0)
    p_bhts = jnp.where(mask_bhts, jnp.exp(jnp.where(mask_bhts, s_bhts, 0.0) - m_bht[..., None]), 0.0)
    l_bht = jnp.sum(p_bhts, axis=-1)
    safe_l = jnp.where(l_bht > 0, l_bht, 1.0)
    o_bhtd = jnp.einsum("bhts,bshd->bhtd", p_bhts, vf, precision=hp) / safe_l[..., None]
    out = jnp.transpose(o_bhtd, (0, 2, 1, 3)).astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.where(l_bht > 0, m_bht + jnp.log(safe_l), EMPTY_ROW_LSE)
    return out, lse
