"""In-place reads and writes of the pipeline executor's slot buffers (``[slots, ...]`` arrays in the
tick loop's carry) and of its context pools (``[Ls, rows, K, D]``, a split document's keys at its
region's rows, read one layer at a time). A write to the slot one past the last is dropped, or
lands in a dummy slot where the buffer has one; reads clip their index. Pool rows past the last
are dropped on write and read as zeros (device code)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def put(buf, i, value):
    return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, 0)


def get(buf, i):
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def put_rows(pool, rows, value):
    """``pool[:, rows] = value`` in place (``pool``: ``[Ls, R, ...]``, ``value``: ``[Ls, len(rows), ...]``);
    rows past the pool are dropped. ``rows`` must be distinct (:func:`context_rows`)."""
    return pool.at[:, rows].set(value.astype(pool.dtype), mode="drop", unique_indices=True)


def clear_rows(pool, start, mask):
    """``pool[:, start + j] = 0`` in place where ``mask[j]`` (``mask``: ``[W]`` bool); rows past the
    pool are left alone. One dynamic slice of ``W`` rows, zeroed where masked and written back where
    it was read, which XLA fuses into an in-place update: a scatter of zeros would hold an
    ``[Ls, W, ...]`` zero block (``L/pp · T · K · D`` per pool in the pipeline's ticks)."""
    rows, width = pool.shape[1], mask.shape[0]
    ar = jnp.arange(width, dtype=jnp.int32)
    if rows < width:  # the slice must fit the pool
        zeros = jnp.zeros((pool.shape[0], width) + pool.shape[2:], pool.dtype)
        return put_rows(pool, jnp.where(mask, start + ar, rows + ar), zeros)
    at = jnp.clip(start, 0, rows - width)  # where the slice lands (XLA clamps its start the same way)
    token = ar + at - start
    clear = (token >= 0) & mask[jnp.clip(token, 0, width - 1)]
    block = jax.lax.dynamic_slice_in_dim(pool, at, width, axis=1)
    block = jnp.where(clear.reshape((1, width) + (1,) * (pool.ndim - 2)), jnp.zeros((), pool.dtype), block)
    return jax.lax.dynamic_update_slice_in_dim(pool, block, at, axis=1)


def add_rows(pool, rows, value):
    """``pool[:, rows] += value`` in place; rows past the pool are dropped (distinct ``rows``)."""
    return pool.at[:, rows].add(value.astype(pool.dtype), mode="drop", unique_indices=True)


def add_layer(s, acc, j, c, active, dlp, dck, dcv) -> dict:
    """A backward's layer ``j`` added into the step's buffers ``acc`` in place: its gradient ``dlp``
    into the accumulators' row ``j`` (``g_layers``: ``[Ls, ...]``), and where ``active`` its
    context's dK/dV ``[Sc, K, D]`` into the pools' rows of chunk ``c`` (``dck``, ``dcv``). A
    descent that adds as it goes holds one layer's gradient, not the stage's stack of them."""
    acc = dict(acc)
    acc["g_layers"] = jax.tree.map(lambda g, d: put(g, j, get(g, j) + d.astype(g.dtype)), acc["g_layers"], dlp)
    if s.Sc:
        rows = dctx_rows(s, c, active)
        for name, d in (("dck", dck), ("dcv", dcv)):
            pool = acc[name]
            acc[name] = pool.at[j, rows].add(d.astype(pool.dtype), mode="drop", unique_indices=True)
    return acc


def keep_layer(s, acc, j, c, writes, x, res, k_own, v_own) -> dict:
    """A forward's layer ``j`` written into the step's buffers ``acc`` in place, where ``writes``:
    its residuals ``res`` into its residual slot (``acc["res"]``), its input ``x`` into its
    checkpoint slot (``acc["ckpt"]``), the chunk's own K/V ``[T, K, D]`` into its document's rows
    of the context pools (``acc["ck"]``, ``acc["cv"]``; where a later slice reads them). A layer
    without a slot (one past the last) is dropped. A forward that writes as it goes holds one
    layer's residuals and K/V, not the stage's stack of them."""
    acc = dict(acc)
    if "ck" in acc:
        rows = written_own_rows(s, c, writes)
        for name, kv in (("ck", k_own), ("cv", v_own)):
            own = (kv * c["own"][0]).astype(acc[name].dtype)
            acc[name] = acc[name].at[j, rows].set(own, mode="drop", unique_indices=True)
    if "res" in acc:
        slot = jnp.where(writes, c["res_slot"][j], s.dummy("res"))
        acc["res"] = [buf.at[slot].set(r.astype(buf.dtype), mode="drop") for buf, r in zip(acc["res"], res)]
    if "ckpt" in acc:
        slot = jnp.where(writes, c["ckpt_slot"][j], s.dummy("ckpt"))
        acc["ckpt"] = acc["ckpt"].at[slot].set(x.astype(acc["ckpt"].dtype), mode="drop")
    return acc


def dctx_rows(s, c, takes):
    """The pool rows ``[Sc]`` an op's context dK/dV go to: chunk ``c``'s context rows where the op
    ``takes`` them, else rows past the pool (dropped)."""
    return jnp.where(takes, c["ctx_rows"], s.R + jnp.arange(s.Sc, dtype=jnp.int32))


# ---- a split document's context in the pool (``s``: the StageShapes, ``c``: a chunk view)
def context_rows(s, c):
    """The pool rows ``[Sc]`` of the context as a layer of chunk ``c`` sees it: the document's keys
    0..C-1 (rows ``base..base+C-1``) at ``[Sc - C, Sc)``, right before the chunk's own keys; rows
    past the pool, all different, where the window holds none (so a scatter to them is dropped
    and the indices stay unique)."""
    ar = jnp.arange(s.Sc, dtype=jnp.int32)
    return jnp.where(ar >= c["shift"], c["ctx_base"] + ar - c["shift"], s.R + ar)


def _owned(c):
    """``[T]``: the chunk's tokens whose keys a later slice of its document reads (its first piece,
    when it continues); they go to the pool rows from ``c["ctx_base"] + c["C"]`` on."""
    return c["own"][0, :, 0, 0] > 0


def own_rows(s, c):
    """The pool rows ``[T]`` of the chunk's own keys, where a later slice of its document reads
    them; past the pool elsewhere."""
    ar = jnp.arange(s.T, dtype=jnp.int32)
    return jnp.where(_owned(c), c["ctx_base"] + c["C"] + ar, s.R + ar)


def written_own_rows(s, c, writes):
    """:func:`own_rows` where a forward ``writes``, else rows past the pool (dropped)."""
    return jnp.where(writes, own_rows(s, c), s.R + jnp.arange(s.T, dtype=jnp.int32))


def clear_own_rows(pool, c, writes):
    """The chunk's own rows of a dK/dV pool cleared in place where ``writes`` (:func:`clear_rows`)."""
    return clear_rows(pool, c["ctx_base"] + c["C"], writes & _owned(c))


def context_of(s, r, c, j):
    """Layer j's context K/V ``[Sc, K, D]`` of chunk view ``c``, as the stage sees them, gathered
    from the pools in ``r`` where the layer uses them (zeros where the window holds no context)."""
    if not s.Sc:
        return (jnp.zeros((0, s.K, s.D), s.compute_dtype),) * 2
    return tuple(
        r[name].at[j, c["ctx_rows"]].get(mode="fill", fill_value=0, unique_indices=True) for name in ("ck", "cv")
    )


def own_context_grads(s, r, c, j):
    """dK/dV [T, K, D] of the chunk's own keys in layer j: what later slices' backwards added."""
    if not s.Sc:
        return (jnp.zeros((s.T, s.K, s.D), s.compute_dtype),) * 2
    rows = own_rows(s, c)
    return tuple(r[n].at[j, rows].get(mode="fill", fill_value=0, unique_indices=True) for n in ("dck", "dcv"))
