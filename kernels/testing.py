"""Packed layouts, comparison and timing helpers shared by the kernel tests and the benchmarks.

A layout is a list of pieces ``(segment_id, first_position, length)``; segment 0 is
padding (its positions are 0). ``context_layout`` builds the slice-attends-to-context
case: keys = cached context of the first document + the slice's own tokens.
"""

from __future__ import annotations

import numpy as np

Piece = tuple[int, int, int]


def build(pieces: list[Piece]) -> tuple[np.ndarray, np.ndarray]:
    """pieces -> (segment_ids [N] int32, positions [N] int32)."""
    seg, pos = [], []
    for sid, start, n in pieces:
        seg.append(np.full(n, sid, np.int32))
        pos.append(np.zeros(n, np.int32) if sid == 0 else np.arange(start, start + n, dtype=np.int32))
    if not seg:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    return np.concatenate(seg), np.concatenate(pos)


def context_layout(q_pieces: list[Piece], context: int):
    """Queries = ``q_pieces``; keys = ``context`` cached tokens of the first piece's
    document (positions first_position - context .. first_position - 1) + the queries.

    Returns (q_seg, q_pos, kv_seg, kv_pos), int32 numpy arrays.
    """
    sid, start, _ = q_pieces[0]
    if context > start:
        raise ValueError(f"context {context} exceeds the first piece's start position {start}")
    q_seg, q_pos = build(q_pieces)
    ctx = [(sid, start - context, context)] if context else []
    kv_seg, kv_pos = build(ctx + list(q_pieces))
    return q_seg, q_pos, kv_seg, kv_pos


def pack_documents(doc_lens, total: int, rng: np.random.Generator | None = None):
    """Greedy packing of documents (lengths, truncated to ``total``) into one row of
    ``total`` tokens, padding at the end. Returns (segment_ids, positions)."""
    pieces, used, sid = [], 0, 1
    for n in doc_lens:
        n = int(min(n, total - used))
        if n <= 0:
            break
        pieces.append((sid, 0, n))
        used += n
        sid += 1
    if used < total:
        pieces.append((0, 0, total - used))
    return build(pieces)


def visible_pairs(q_seg, q_pos, kv_seg, kv_pos, causal=True) -> np.ndarray:
    """Dense numpy visibility [T, S] (independent of the kernels' code)."""
    m = (q_seg[:, None] == kv_seg[None, :]) & (q_seg[:, None] != 0)
    if causal:
        m &= kv_pos[None, :] <= q_pos[:, None]
    return m


def visible_tiles(mask: np.ndarray, block_q: int, block_kv: int) -> np.ndarray:
    """[T, S] bool -> [nq] number of kv tiles holding at least one visible pair."""
    t, s = mask.shape
    nq, nk = -(-t // block_q), -(-s // block_kv)
    padded = np.zeros((nq * block_q, nk * block_kv), bool)
    padded[:t, :s] = mask
    return padded.reshape(nq, block_q, nk, block_kv).any(axis=(1, 3)).sum(-1)


def rel_err(got, want) -> float:
    """max |got - want| / max |want| (float64)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    scale = max(float(np.abs(want).max()), 1e-30)
    return float(np.abs(got - want).max()) / scale


def rel_norm_err(got, want) -> float:
    """||got - want||_F / ||want||_F (float64): bf16 rounding lands near 1e-3..1e-2, float32 far below."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def call_seconds(fn, *args, repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn(*args)``, each waited for, after one warm-up
    (compile) call."""
    import time

    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times
