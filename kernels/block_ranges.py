"""Tile schedule for block skipping, computed once per packed batch.

For every q block: which kv blocks hold at least one visible (q, k) pair, split
into *partial* tiles (the mask must be evaluated) and *full* tiles (every pair
visible: no mask). The transposed lists (for every kv block, which q blocks) drive
the dk/dv pass. Invisible tiles appear in no list, so kernels never load them.

The lists generalise "a kv range plus a fully-visible sub-range": in a packed
batch a q block that holds the end of one document and the start of the next, with
a padding run between them in the keys, has two disjoint visible ranges; a list
skips the gap. The schedule depends only on segment ids and positions, so the
model computes it once per batch (``compute_block_info``) and passes it to every
layer (``varlen_attention(..., block_info=...)``).

Exactness: full tiles are exact for any input. A tile is listed iff some query of
the q block has its [first, last] visible-key index interval intersecting the kv
block; this is exact whenever each document's keys are contiguous with
non-decreasing positions (every packed layout) and a superset otherwise (still
correct: partial tiles are masked).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jvarlen.kernels.common import next_power_of_2

_BIG = jnp.iinfo(jnp.int32).max


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockInfo:
    """Block-skipping schedule of one packed batch (nq = ceil(T/bq), nk = ceil(S/bk)).

    fwd_blocks:  [B, nq, Lk] int32 kv block ids per q block: partial tiles first
                 (ascending), then full tiles (ascending); Lk = next_pow2(nk).
    fwd_counts:  [B, nq, 2] int32 (number of partial tiles, number of full tiles).
    bwd_blocks:  [B, nk, Lq] int32 q block ids per kv block, same order; Lq = next_pow2(nq).
    bwd_counts:  [B, nk, 2] int32.
    block_q, block_kv, causal, t, s: static metadata the schedule was built for.
    """

    fwd_blocks: jax.Array
    fwd_counts: jax.Array
    bwd_blocks: jax.Array
    bwd_counts: jax.Array
    block_q: int = dataclasses.field(metadata=dict(static=True), default=128)
    block_kv: int = dataclasses.field(metadata=dict(static=True), default=128)
    causal: bool = dataclasses.field(metadata=dict(static=True), default=True)
    t: int = dataclasses.field(metadata=dict(static=True), default=0)
    s: int = dataclasses.field(metadata=dict(static=True), default=0)

    def num_tiles(self):
        """[B, nq] number of kv tiles each q block visits."""
        return self.fwd_counts.sum(-1)


def _segmented_min_max(lo, hi, starts):
    """Inclusive running (min of ``lo``, max of ``hi``), restarting where ``starts``. 1-D."""

    def combine(a, b):
        fa, lo_a, hi_a = a
        fb, lo_b, hi_b = b
        return (fa | fb, jnp.where(fb, lo_b, jnp.minimum(lo_a, lo_b)), jnp.where(fb, hi_b, jnp.maximum(hi_a, hi_b)))

    _, lo, hi = lax.associative_scan(combine, (starts, lo, hi))
    return lo, hi


def token_intervals(q_seg, q_pos, kv_seg, kv_pos, causal: bool):
    """Per query, first and last index of a visible key ([T] each, -1 if none). 1-D inputs.

    One sort of keys and queries together by (segment, position, key-before-query);
    a segmented running min/max of key indices then gives each query's interval.
    O((T + S) log(T + S)), no T x S matrix.
    """
    t = q_seg.shape[0]
    s = kv_seg.shape[0]
    if not causal:
        q_pos = jnp.zeros_like(q_pos)
        kv_pos = jnp.zeros_like(kv_pos)
    seg = jnp.concatenate([kv_seg, q_seg]).astype(jnp.int32)
    pos = jnp.concatenate([kv_pos, q_pos]).astype(jnp.int32)
    tag = jnp.concatenate([jnp.zeros(s, jnp.int32), jnp.ones(t, jnp.int32)])
    idx = jnp.arange(s + t, dtype=jnp.int32)
    seg_s, _, tag_s, idx_s = lax.sort((seg, pos, tag, idx), num_keys=3)
    is_kv = tag_s == 0
    starts = jnp.concatenate([jnp.ones(1, bool), seg_s[1:] != seg_s[:-1]])
    first, last = _segmented_min_max(jnp.where(is_kv, idx_s, _BIG), jnp.where(is_kv, idx_s, -1), starts)
    has = (first != _BIG) & (seg_s != 0)
    first = jnp.where(has, first, -1)
    last = jnp.where(has, last, -1)
    dest = jnp.where(is_kv, t, idx_s - s)  # queries back to their own order; keys dropped
    q_first = jnp.full((t,), -1, jnp.int32).at[dest].set(first, mode="drop")
    q_last = jnp.full((t,), -1, jnp.int32).at[dest].set(last, mode="drop")
    return q_first, q_last


def _block_uniform(seg, pos, block, reduce_pos):
    """[N] -> per block (uniform non-zero segment id or -1, reduced position)."""
    seg_b = seg.reshape(-1, block)
    pos_b = pos.reshape(-1, block)
    lo = seg_b.min(-1)
    hi = seg_b.max(-1)
    uniform = jnp.where((lo == hi) & (lo != 0), lo, -1)
    return uniform, reduce_pos(pos_b, axis=-1)


def _compact(vis, full, length):
    """[R, C] bool -> ([R, length] ids: partial then full, ascending; [R, 2] counts)."""
    c = vis.shape[-1]
    col = jnp.arange(c, dtype=jnp.int32)
    key = jnp.where(vis & ~full, col, jnp.where(full, c + col, 2 * c + col))
    key = jnp.sort(key, axis=-1) % c
    if length > c:
        key = jnp.pad(key, ((0, 0), (0, length - c)))
    counts = jnp.stack([(vis & ~full).sum(-1), full.sum(-1)], -1).astype(jnp.int32)
    return key.astype(jnp.int32), counts


def _tile_masks(q_seg, q_pos, kv_seg, kv_pos, *, causal, block_q, block_kv):
    """1-D padded inputs -> (visible [nq, nk], full [nq, nk]) tile masks."""
    nq = q_seg.shape[0] // block_q
    nk = kv_seg.shape[0] // block_kv
    first, last = token_intervals(q_seg, q_pos, kv_seg, kv_pos, causal)
    has = first >= 0
    row = jnp.arange(q_seg.shape[0], dtype=jnp.int32) // block_q
    # Difference array over kv blocks: +1 at the first block, -1 after the last.
    diff = jnp.zeros((nq, nk + 1), jnp.int32)
    diff = diff.at[row, jnp.where(has, first // block_kv, nk)].add(has.astype(jnp.int32))
    diff = diff.at[row, jnp.where(has, last // block_kv + 1, nk)].add(-has.astype(jnp.int32))
    vis = jnp.cumsum(diff, axis=-1)[:, :nk] > 0
    q_uni, q_min = _block_uniform(q_seg, q_pos, block_q, jnp.min)
    k_uni, k_max = _block_uniform(kv_seg, kv_pos, block_kv, jnp.max)
    full = (q_uni[:, None] >= 0) & (q_uni[:, None] == k_uni[None, :])
    if causal:
        full = full & (k_max[None, :] <= q_min[:, None])
    return vis | full, full


@functools.partial(jax.jit, static_argnames=("causal", "block_q", "block_kv"))
def compute_block_info(
    q_segment_ids,
    kv_segment_ids,
    q_positions,
    kv_positions,
    *,
    causal: bool = True,
    block_q: int = 128,
    block_kv: int = 128,
) -> BlockInfo:
    """Builds the tile schedule. Ids/positions [B, T] / [B, S] (or [T] / [S]) int.

    ``block_q``/``block_kv`` must be the block sizes the kernel will use (see
    ``varlen_attention``'s ``block_sizes``; blocks are shrunk for short inputs with
    ``common.fit_block_sizes``). Jittable: depends on runtime ids, not on their values.
    """
    q_seg = jnp.asarray(q_segment_ids, jnp.int32)
    kv_seg = jnp.asarray(kv_segment_ids, jnp.int32)
    q_pos = jnp.asarray(q_positions, jnp.int32)
    kv_pos = jnp.asarray(kv_positions, jnp.int32)
    if q_seg.ndim == 1:
        q_seg, kv_seg, q_pos, kv_pos = (x[None] for x in (q_seg, kv_seg, q_pos, kv_pos))
    t, s = q_seg.shape[1], kv_seg.shape[1]
    nq, nk = -(-t // block_q), -(-s // block_kv)
    pad_q = ((0, 0), (0, nq * block_q - t))
    pad_k = ((0, 0), (0, nk * block_kv - s))
    q_seg, q_pos = jnp.pad(q_seg, pad_q), jnp.pad(q_pos, pad_q)
    kv_seg, kv_pos = jnp.pad(kv_seg, pad_k), jnp.pad(kv_pos, pad_k)

    def one(qs, qp, ks, kp):
        vis, full = _tile_masks(qs, qp, ks, kp, causal=causal, block_q=block_q, block_kv=block_kv)
        fb, fc = _compact(vis, full, next_power_of_2(nk))
        bb, bc = _compact(vis.T, full.T, next_power_of_2(nq))
        return fb, fc, bb, bc

    fb, fc, bb, bc = jax.vmap(one)(q_seg, q_pos, kv_seg, kv_pos)
    return BlockInfo(fb, fc, bb, bc, block_q=block_q, block_kv=block_kv, causal=causal, t=t, s=s)
