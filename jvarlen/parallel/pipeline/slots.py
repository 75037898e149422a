"""In-place reads and writes of the pipeline executor's slot buffers (``[slots, ...]`` arrays in the
tick loop's carry), and a split document's context read from them one layer at a time. A write to
the slot one past the last is dropped, or lands in a dummy slot where the buffer has one; reads
clip their index (device code)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def put(buf, i, value):
    return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, 0)


def get(buf, i):
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def layer_row(buf, i, j):
    """``buf[i, j]`` of a ``[slots, Ls, ...]`` buffer, without a copy of slot ``i``'s other layers."""
    at = (i, j) + (0,) * (buf.ndim - 2)
    return jax.lax.dynamic_slice(buf, at, (1, 1) + buf.shape[2:])[0, 0]


def put_or_drop(buf, i, value):
    """``buf[i] = value``, nothing where ``i`` is out of range (one past the last slot)."""
    return buf.at[i].set(value.astype(buf.dtype), mode="drop")


def add_or_drop(buf, i, value):
    """``buf[i] += value`` in place, nothing where ``i`` is out of range (one past the last slot)."""
    return buf.at[i].add(value.astype(buf.dtype), mode="drop")


def put_rows_or_drop(buf, i, start, value):
    """``buf[i, :, start:start + n] = value`` (``value``: ``[Ls, n, K, D]``) in place, nothing where
    ``i`` is out of range. The caller keeps ``start + n`` within the buffer
    (:func:`jvarlen.plan.chunk.executor_context`), so only the slot index decides."""
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(1, 2, 3, 4), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0, 2)
    )
    index = jnp.stack([jnp.asarray(i, jnp.int32), jnp.asarray(start, jnp.int32)])[None]
    return jax.lax.scatter(
        buf,
        index,
        value[None].astype(buf.dtype),
        dims,
        indices_are_sorted=True,
        unique_indices=True,
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )


# ---- a split document's context as a layer sees it (``s``: the StageShapes, ``c``: a chunk view)
def roll_context(s, a, c, back=False):
    """One layer's context K/V (or their gradients) [Sc, K, D] between the buffers' layout and the
    stage's (rolled by Sc - C); ``back`` undoes it. Identity without context."""
    if not s.Sc:
        return a
    return jnp.roll(a, -c["shift"] if back else c["shift"], axis=0)


def context_of(s, r, c, j):
    """Layer j's context K/V [Sc, K, D] of chunk view ``c``, as the stage sees them, read from the
    whole buffers in ``r`` where the layer uses them: a stage's worth of them, read before the op,
    were several ``[Ls, Sc, K, D]`` copies per op (the read, its roll)."""
    slot = c["slots"]["ctx"]
    return tuple(roll_context(s, layer_row(r[name], slot, j), c) for name in ("ck", "cv"))


def own_context_grads(s, r, c, j):
    """dK/dV [T, K, D] of the chunk's own keys in layer j: what later slices' backwards added."""
    if not s.Sc:
        return (jnp.zeros((s.T, s.K, s.D), s.compute_dtype),) * 2
    at = (c["slots"]["ctx"], j, c["C"], 0, 0)
    return tuple(jax.lax.dynamic_slice(r[n], at, (1, 1, s.T, s.K, s.D))[0, 0] * c["own"][0] for n in ("dck", "dcv"))
