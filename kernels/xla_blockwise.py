"""Memory-efficient XLA varlen attention: blockwise online softmax with block skipping.

Same schedule as the Pallas kernels (``BlockInfo``): one ``lax.map`` step per q
block (forward, dq) or kv block (dk/dv), and inside it ``fori_loop``s with dynamic
trip counts over the listed tiles only: partial tiles with the mask, then full
tiles without. Nothing larger than one [H, bq, bk] tile of scores exists at a time.
Used by ``implementation="auto"`` on CPU.

Internal layout (padded to whole blocks): q/do/o [B, T, H, D], k/v [B, S, Hkv, D],
ids/positions [B, T] / [B, S], lse/delta [B, H, T] float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jvarlen.kernels.block_ranges import BlockInfo
from jvarlen.kernels.common import EMPTY_ROW_LSE, visible

_F32 = jnp.float32


def _varying_like(*arrays):
    """-> f(init) casting a loop-carry init to the mesh axes the inputs vary over.

    Inside ``shard_map(check_vma=True)`` a carry built from constants is unvarying while
    the loop body makes it varying; both must match.
    """
    vma = frozenset()
    for x in jax.tree.leaves(arrays):
        aval = jax.typeof(x)
        manual = getattr(aval, "manual_axis_type", None)  # jax 0.10+: aval.manual_axis_type.varying
        vma |= frozenset(manual.varying) if manual is not None else frozenset(getattr(aval, "vma", ()))
    axes = tuple(sorted(vma))
    if not axes:
        return lambda tree: tree
    return lambda tree: jax.tree.map(lambda x: lax.pcast(x, axes, to="varying"), tree)


def _rows(x, b, start, size):
    """x [B, N, ...] -> x[b, start:start+size] (dynamic b, start)."""
    idx = (b, start) + (0,) * (x.ndim - 2)
    return lax.dynamic_slice(x, idx, (1, size) + x.shape[2:])[0]


def _hg(x_bh, b, start, size, hkv):
    """lse/delta [B, H, T] -> [Hkv, G, size] rows of batch b."""
    blk = lax.dynamic_slice(x_bh, (b, 0, start), (1, x_bh.shape[1], size))[0]
    return blk.reshape(hkv, -1, size)


def forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, info: BlockInfo, *, causal, sm_scale):
    """-> out [B, T, H, D] (q.dtype), lse [B, H, T] f32."""
    bsz, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    bq, bk = info.block_q, info.block_kv
    nq = t // bq
    varying = _varying_like(q, k, v, q_seg, q_pos, kv_seg, kv_pos, info)

    def q_block(idx):
        b, i = idx // nq, idx % nq
        q_blk = _rows(q, b, i * bq, bq).reshape(bq, hkv, g, d)
        qs, qp = _rows(q_seg, b, i * bq, bq), _rows(q_pos, b, i * bq, bq)
        blocks = info.fwd_blocks[b, i]
        n_part, n_full = info.fwd_counts[b, i, 0], info.fwd_counts[b, i, 1]

        def tile(masked):
            def body(step, carry):
                m, l, acc = carry
                j = blocks[step]
                k_blk, v_blk = _rows(k, b, j * bk, bk), _rows(v, b, j * bk, bk)
                s = jnp.einsum("qhgd,khd->hgqk", q_blk, k_blk, preferred_element_type=_F32) * sm_scale
                if masked:
                    mask = visible(qs, qp, _rows(kv_seg, b, j * bk, bk), _rows(kv_pos, b, j * bk, bk), causal)
                    s = jnp.where(mask, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(-1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                l = alpha * l + p.sum(-1)
                pv = jnp.einsum("hgqk,khd->hgqd", p.astype(v.dtype), v_blk, preferred_element_type=_F32)
                return m_new, l, alpha[..., None] * acc + pv

            return body

        carry = varying(
            (jnp.full((hkv, g, bq), -jnp.inf, _F32), jnp.zeros((hkv, g, bq), _F32), jnp.zeros((hkv, g, bq, d), _F32))
        )
        carry = lax.fori_loop(0, n_part, tile(True), carry)
        m, l, acc = lax.fori_loop(n_part, n_part + n_full, tile(False), carry)
        safe_l = jnp.where(l > 0, l, 1.0)
        o = (acc / safe_l[..., None]).astype(q.dtype)  # [Hkv, G, bq, D]
        lse = jnp.where(l > 0, m + jnp.log(safe_l), EMPTY_ROW_LSE)
        return jnp.transpose(o, (2, 0, 1, 3)).reshape(bq, h, d), lse.reshape(h, bq)

    o, lse = lax.map(q_block, jnp.arange(bsz * nq))
    o = o.reshape(bsz, t, h, d)
    lse = jnp.transpose(lse.reshape(bsz, nq, h, bq), (0, 2, 1, 3)).reshape(bsz, h, t)
    return o, lse


def backward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, info: BlockInfo, o, lse, do, dlse=None, *, causal, sm_scale):
    """-> dq [B, T, H, D], dk, dv [B, S, Hkv, D] in the input dtypes. dlse [B, H, T] or None."""
    bsz, t, h, d = q.shape
    s_len, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    bq, bk = info.block_q, info.block_kv
    nq, nk = t // bq, s_len // bk
    delta = jnp.einsum("bthd,bthd->bht", o.astype(_F32), do.astype(_F32))
    if dlse is not None:
        delta = delta - dlse
    varying = _varying_like(q, k, v, q_seg, q_pos, kv_seg, kv_pos, info, lse, do)

    def scores(q_blk, k_blk, lse_blk, qs, qp, ks, kp, masked):
        s = jnp.einsum("qhgd,khd->hgqk", q_blk, k_blk, preferred_element_type=_F32) * sm_scale
        p = jnp.exp(s - lse_blk[..., None])
        if masked:
            p = jnp.where(visible(qs, qp, ks, kp, causal), p, 0.0)
        return p

    def q_block(idx):
        b, i = idx // nq, idx % nq
        q_blk = _rows(q, b, i * bq, bq).reshape(bq, hkv, g, d)
        do_blk = _rows(do, b, i * bq, bq).reshape(bq, hkv, g, d)
        lse_blk, delta_blk = _hg(lse, b, i * bq, bq, hkv), _hg(delta, b, i * bq, bq, hkv)
        qs, qp = _rows(q_seg, b, i * bq, bq), _rows(q_pos, b, i * bq, bq)
        blocks = info.fwd_blocks[b, i]
        n_part, n_full = info.fwd_counts[b, i, 0], info.fwd_counts[b, i, 1]

        def tile(masked):
            def body(step, dq):
                j = blocks[step]
                k_blk, v_blk = _rows(k, b, j * bk, bk), _rows(v, b, j * bk, bk)
                p = scores(
                    q_blk, k_blk, lse_blk, qs, qp, _rows(kv_seg, b, j * bk, bk), _rows(kv_pos, b, j * bk, bk), masked
                )
                dp = jnp.einsum("qhgd,khd->hgqk", do_blk, v_blk, preferred_element_type=_F32)
                ds = (p * (dp - delta_blk[..., None])).astype(k.dtype)
                return dq + jnp.einsum("hgqk,khd->qhgd", ds, k_blk, preferred_element_type=_F32)

            return body

        dq = varying(jnp.zeros((bq, hkv, g, d), _F32))
        dq = lax.fori_loop(0, n_part, tile(True), dq)
        dq = lax.fori_loop(n_part, n_part + n_full, tile(False), dq)
        return (dq * sm_scale).astype(q.dtype).reshape(bq, h, d)

    def kv_block(idx):
        b, j = idx // nk, idx % nk
        k_blk, v_blk = _rows(k, b, j * bk, bk), _rows(v, b, j * bk, bk)
        ks, kp = _rows(kv_seg, b, j * bk, bk), _rows(kv_pos, b, j * bk, bk)
        blocks = info.bwd_blocks[b, j]
        n_part, n_full = info.bwd_counts[b, j, 0], info.bwd_counts[b, j, 1]

        def tile(masked):
            def body(step, carry):
                dk, dv = carry
                i = blocks[step]
                q_blk = _rows(q, b, i * bq, bq).reshape(bq, hkv, g, d)
                do_blk = _rows(do, b, i * bq, bq).reshape(bq, hkv, g, d)
                lse_blk, delta_blk = _hg(lse, b, i * bq, bq, hkv), _hg(delta, b, i * bq, bq, hkv)
                p = scores(
                    q_blk, k_blk, lse_blk, _rows(q_seg, b, i * bq, bq), _rows(q_pos, b, i * bq, bq), ks, kp, masked
                )
                dv = dv + jnp.einsum("hgqk,qhgd->khd", p.astype(do.dtype), do_blk, preferred_element_type=_F32)
                dp = jnp.einsum("qhgd,khd->hgqk", do_blk, v_blk, preferred_element_type=_F32)
                ds = (p * (dp - delta_blk[..., None])).astype(q.dtype)
                dk = dk + jnp.einsum("hgqk,qhgd->khd", ds, q_blk, preferred_element_type=_F32)
                return dk, dv

            return body

        carry = varying((jnp.zeros((bk, hkv, d), _F32), jnp.zeros((bk, hkv, d), _F32)))
        carry = lax.fori_loop(0, n_part, tile(True), carry)
        dk, dv = lax.fori_loop(n_part, n_part + n_full, tile(False), carry)
        return (dk * sm_scale).astype(k.dtype), dv.astype(v.dtype)

    dq = lax.map(q_block, jnp.arange(bsz * nq)).reshape(bsz, t, h, d)
    dk, dv = lax.map(kv_block, jnp.arange(bsz * nk))
    return dq, dk.reshape(bsz, s_len, hkv, d), dv.reshape(bsz, s_len, hkv, d)
