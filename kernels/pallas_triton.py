"""Pallas (Triton lowering) varlen flash attention: forward, dq and dk/dv kernels.

Runs compiled on GPU and with ``interpret=True`` on CPU. Every kernel walks a
``BlockInfo`` tile list: partial tiles (mask evaluated) in one loop, fully visible
tiles (no mask) in a second one; invisible tiles are never loaded.

Layout (padded to whole blocks; G = H // Hkv):
  q, do, o [B, T, H, D]; k, v [B, S, Hkv, D]; ids/positions [B, T] / [B, S] int32;
  lse, delta [B, H, T] float32.
Grids: forward and dq (B, T / tq, H); dk/dv (B, S / tk, Hkv) with the G query heads of
a kv head reduced inside the kernel (no atomics, deterministic). The kernels' tiles
(``gpu_config.KernelTiles``: tq, tk, warps, stages) may be fractions of the schedule's
blocks: a program then owns part of a block and walks that block's list, each listed
tile in ``block / tile`` steps (exact: sub-tiles of full tiles are full, partial ones masked).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jvarlen.kernels.block_ranges import BlockInfo
from jvarlen.kernels.common import EMPTY_ROW_LSE, visible
from jvarlen.kernels.gpu_config import KernelConfig, KernelTiles

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a [m, d] x b [n, d] -> [m, n]
_TN = (((0,), (0,)), ((), ()))  # a [m, n] x b [m, d] -> [n, d]


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
    return lax.dot_general(a, b, dims, preferred_element_type=_F32)


def _params(tiles: KernelTiles):
    """Triton compiler params: also selects the Triton lowering (Mosaic GPU is the default)."""
    return pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _tile_start(blk_ref, step, block, tile):
    """Row offset of loop step ``step``: listed block ``step // (block / tile)``, sub-tile
    ``step % (block / tile)``."""
    if tile == block:
        return pl.multiple_of(blk_ref[step] * block, block)
    split = block // tile  # lax.div/rem: jnp's floor division lowers to selects Triton rejects
    return pl.multiple_of(blk_ref[lax.div(step, split)] * block + lax.rem(step, split) * tile, tile)


def _fwd_kernel(
    q_ref,
    k_ref,
    v_ref,
    qs_ref,
    qp_ref,
    ks_ref,
    kp_ref,
    blk_ref,
    cnt_ref,
    o_ref,
    lse_ref,
    *tiles_ref,
    causal,
    sm_scale,
    block_kv,
    tile_kv,
):
    """One (batch, q tile, head): online softmax over the listed kv tiles."""
    q = q_ref[...]  # [bq, D]
    qs, qp = qs_ref[...], qp_ref[...]
    split = block_kv // tile_kv
    n_part, n_full = cnt_ref[0] * split, cnt_ref[1] * split
    bq, d = q.shape

    def tile(masked):
        def body(step, carry):
            m, l, acc, n = carry
            start = _tile_start(blk_ref, step, block_kv, tile_kv)
            k = k_ref[pl.ds(start, tile_kv), :]
            v = v_ref[pl.ds(start, tile_kv), :]
            s = _dot(q, k, _NT) * sm_scale  # [bq, bk]
            if masked:
                mask = visible(qs, qp, ks_ref[pl.ds(start, tile_kv)], kp_ref[pl.ds(start, tile_kv)], causal)
                s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_safe[:, None])
            alpha = jnp.exp(m - m_safe)
            acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
            return m_new, alpha * l + p.sum(-1), acc, n + 1

        return body

    carry = (jnp.full((bq,), -jnp.inf, _F32), jnp.zeros((bq,), _F32), jnp.zeros((bq, d), _F32), jnp.int32(0))
    carry = lax.fori_loop(0, n_part, tile(True), carry)
    m, l, acc, n = lax.fori_loop(n_part, n_part + n_full, tile(False), carry)
    safe_l = jnp.where(l > 0, l, 1.0)
    o_ref[...] = (acc / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(l > 0, m + jnp.log(safe_l), EMPTY_ROW_LSE)
    if tiles_ref:  # debug: kv tiles this q block visited, written on every row
        tiles_ref[0][...] = jnp.full((bq,), lax.div(n, split), jnp.int32)


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qs_ref,
    qp_ref,
    ks_ref,
    kp_ref,
    blk_ref,
    cnt_ref,
    dq_ref,
    *,
    causal,
    sm_scale,
    block_kv,
    tile_kv,
):
    """One (batch, q tile, head): dq over the listed kv tiles."""
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qs, qp = qs_ref[...], qp_ref[...]
    split = block_kv // tile_kv
    n_part, n_full = cnt_ref[0] * split, cnt_ref[1] * split

    def tile(masked):
        def body(step, dq):
            start = _tile_start(blk_ref, step, block_kv, tile_kv)
            k = k_ref[pl.ds(start, tile_kv), :]
            v = v_ref[pl.ds(start, tile_kv), :]
            p = jnp.exp(_dot(q, k, _NT) * sm_scale - lse[:, None])
            if masked:
                mask = visible(qs, qp, ks_ref[pl.ds(start, tile_kv)], kp_ref[pl.ds(start, tile_kv)], causal)
                p = jnp.where(mask, p, 0.0)
            ds = p * (_dot(do, v, _NT) - delta[:, None])
            return dq + _dot(ds.astype(k.dtype), k)

        return body

    dq = jnp.zeros(q.shape, _F32)
    dq = lax.fori_loop(0, n_part, tile(True), dq)
    dq = lax.fori_loop(n_part, n_part + n_full, tile(False), dq)
    dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qs_ref,
    qp_ref,
    ks_ref,
    kp_ref,
    blk_ref,
    cnt_ref,
    dk_ref,
    dv_ref,
    *,
    causal,
    sm_scale,
    block_q,
    tile_q,
    group,
):
    """One (batch, kv tile, kv head): dk, dv over the listed q tiles of all G q heads."""
    k, v = k_ref[...], v_ref[...]  # [bk, D]
    ks, kp = ks_ref[...], kp_ref[...]
    split = block_q // tile_q
    n_part, n_full = cnt_ref[0] * split, cnt_ref[1] * split

    def tile(masked, g):
        def body(step, carry):
            dk, dv = carry
            start = _tile_start(blk_ref, step, block_q, tile_q)
            q = q_ref[pl.ds(start, tile_q), g, :]  # [bq, D]
            do = do_ref[pl.ds(start, tile_q), g, :]
            lse = lse_ref[g, pl.ds(start, tile_q)]
            delta = delta_ref[g, pl.ds(start, tile_q)]
            p = jnp.exp(_dot(q, k, _NT) * sm_scale - lse[:, None])  # [bq, bk]
            if masked:
                mask = visible(qs_ref[pl.ds(start, tile_q)], qp_ref[pl.ds(start, tile_q)], ks, kp, causal)
                p = jnp.where(mask, p, 0.0)
            dv = dv + _dot(p.astype(do.dtype), do, _TN)
            ds = p * (_dot(do, v, _NT) - delta[:, None])
            return dk + _dot(ds.astype(q.dtype), q, _TN), dv

        return body

    def head(g, carry):  # the G query heads sharing this kv head, one loop (not unrolled)
        carry = lax.fori_loop(0, n_part, tile(True, g), carry)
        return lax.fori_loop(n_part, n_part + n_full, tile(False, g), carry)

    carry = (jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
    dk, dv = head(0, carry) if group == 1 else lax.fori_loop(0, group, head, carry)
    dk_ref[...] = (dk * sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _forward(
    q, k, v, q_seg, q_pos, kv_seg, kv_pos, info: BlockInfo, *, causal, sm_scale, interpret, config, debug_tiles=False
):
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    tiles = config.fwd.fit(info.block_q, info.block_kv)
    tq, sq = tiles.block_q, info.block_q // tiles.block_q  # q tile, q tiles per schedule block
    lk = info.fwd_blocks.shape[-1]
    row = pl.BlockSpec((None, tq), lambda bi, i, hi: (bi, i))
    full_row = pl.BlockSpec((None, s), lambda bi, i, hi: (bi, 0))
    kv_spec = pl.BlockSpec((None, s, None, d), lambda bi, i, hi: (bi, 0, hi // g, 0))
    q_spec = pl.BlockSpec((None, tq, None, d), lambda bi, i, hi: (bi, i, hi, 0))
    lse_spec = pl.BlockSpec((None, None, tq), lambda bi, i, hi: (bi, hi, i))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t), _F32)]
    out_specs = [q_spec, lse_spec]
    if debug_tiles:
        out_shape.append(jax.ShapeDtypeStruct((b, h, t), jnp.int32))
        out_specs.append(lse_spec)
    kernel = functools.partial(
        _fwd_kernel, causal=causal, sm_scale=sm_scale, block_kv=info.block_kv, tile_kv=tiles.block_kv
    )
    return pl.pallas_call(
        kernel,
        grid=(b, t // tq, h),
        in_specs=[
            q_spec,
            kv_spec,
            kv_spec,
            row,
            row,
            full_row,
            full_row,
            pl.BlockSpec((None, None, lk), lambda bi, i, hi: (bi, i // sq, 0)),
            pl.BlockSpec((None, None, 2), lambda bi, i, hi: (bi, i // sq, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=_params(tiles),
        name="varlen_flash_fwd",
    )(q, k, v, q_seg, q_pos, kv_seg, kv_pos, info.fwd_blocks, info.fwd_counts)


def forward(
    q, k, v, q_seg, q_pos, kv_seg, kv_pos, info: BlockInfo, *, causal, sm_scale, interpret, config=KernelConfig()
):
    """-> out [B, T, H, D] (q.dtype), lse [B, H, T] f32."""
    o, lse = _forward(
        q,
        k,
        v,
        q_seg,
        q_pos,
        kv_seg,
        kv_pos,
        info,
        causal=causal,
        sm_scale=sm_scale,
        interpret=interpret,
        config=config,
    )
    return o, lse


def tiles_visited(
    q, k, v, q_seg, q_pos, kv_seg, kv_pos, info: BlockInfo, *, causal, sm_scale, interpret=True, config=KernelConfig()
):
    """Debug: [B, H, nq] number of kv tiles (schedule blocks) the forward kernel loaded per q block."""
    _, _, tiles = _forward(
        q,
        k,
        v,
        q_seg,
        q_pos,
        kv_seg,
        kv_pos,
        info,
        causal=causal,
        sm_scale=sm_scale,
        interpret=interpret,
        config=config,
        debug_tiles=True,
    )
    return tiles[:, :, :: info.block_q]


def backward(
    q,
    k,
    v,
    q_seg,
    q_pos,
    kv_seg,
    kv_pos,
    info: BlockInfo,
    o,
    lse,
    do,
    dlse=None,
    *,
    causal,
    sm_scale,
    interpret,
    config=KernelConfig(),
):
    """-> dq [B, T, H, D], dk, dv [B, S, Hkv, D] in the input dtypes. dlse [B, H, T] or None."""
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    bq, bk = info.block_q, info.block_kv
    delta = jnp.einsum("bthd,bthd->bht", o.astype(_F32), do.astype(_F32))
    if dlse is not None:  # lse cotangent: d lse_i / d s_ij = p_ij
        delta = delta - dlse

    # dq: grid (B, T / tq, H), walks fwd lists.
    dq_tiles = config.dq.fit(bq, bk)
    tq, sq = dq_tiles.block_q, bq // dq_tiles.block_q
    q_blk = pl.BlockSpec((None, tq, None, d), lambda bi, i, hi: (bi, i, hi, 0))
    kv_all = pl.BlockSpec((None, s, None, d), lambda bi, i, hi: (bi, 0, hi // g, 0))
    lse_blk = pl.BlockSpec((None, None, tq), lambda bi, i, hi: (bi, hi, i))
    q_row = pl.BlockSpec((None, tq), lambda bi, i, hi: (bi, i))
    kv_row = pl.BlockSpec((None, s), lambda bi, i, hi: (bi, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, causal=causal, sm_scale=sm_scale, block_kv=bk, tile_kv=dq_tiles.block_kv),
        grid=(b, t // tq, h),
        in_specs=[
            q_blk,
            kv_all,
            kv_all,
            q_blk,
            lse_blk,
            lse_blk,
            q_row,
            q_row,
            kv_row,
            kv_row,
            pl.BlockSpec((None, None, info.fwd_blocks.shape[-1]), lambda bi, i, hi: (bi, i // sq, 0)),
            pl.BlockSpec((None, None, 2), lambda bi, i, hi: (bi, i // sq, 0)),
        ],
        out_specs=q_blk,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        compiler_params=_params(dq_tiles),
        name="varlen_flash_dq",
    )(q, k, v, do, lse, delta, q_seg, q_pos, kv_seg, kv_pos, info.fwd_blocks, info.fwd_counts)

    # dk/dv: grid (B, S / tk, Hkv), walks bwd lists; the G heads of kv head hk are q heads hk*G...
    kv_tiles = config.dkv.fit(bq, bk)
    tk, sk = kv_tiles.block_kv, bk // kv_tiles.block_kv
    q_grp = pl.BlockSpec((None, t, g, d), lambda bi, j, hk: (bi, 0, hk, 0))
    kv_blk = pl.BlockSpec((None, tk, None, d), lambda bi, j, hk: (bi, j, hk, 0))
    lse_grp = pl.BlockSpec((None, g, t), lambda bi, j, hk: (bi, hk, 0))
    q_all = pl.BlockSpec((None, t), lambda bi, j, hk: (bi, 0))
    kv_r = pl.BlockSpec((None, tk), lambda bi, j, hk: (bi, j))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, causal=causal, sm_scale=sm_scale, block_q=bq, tile_q=kv_tiles.block_q, group=g),
        grid=(b, s // tk, hkv),
        in_specs=[
            q_grp,
            kv_blk,
            kv_blk,
            q_grp,
            lse_grp,
            lse_grp,
            q_all,
            q_all,
            kv_r,
            kv_r,
            pl.BlockSpec((None, None, info.bwd_blocks.shape[-1]), lambda bi, j, hk: (bi, j // sk, 0)),
            pl.BlockSpec((None, None, 2), lambda bi, j, hk: (bi, j // sk, 0)),
        ],
        out_specs=[kv_blk, kv_blk],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        interpret=interpret,
        compiler_params=_params(kv_tiles),
        name="varlen_flash_dkv",
    )(q, k, v, do, lse, delta, q_seg, q_pos, kv_seg, kv_pos, info.bwd_blocks, info.bwd_counts)
    return dq, dk, dv
