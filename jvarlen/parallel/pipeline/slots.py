"""In-place reads and writes of the pipeline executor's slot buffers (``[slots, ...]`` arrays in the
tick loop's carry). A write to the slot one past the last is dropped, or lands in a dummy slot where
the buffer has one; reads clip their index (device code)."""

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
