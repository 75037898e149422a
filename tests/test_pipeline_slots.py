"""The executor's in-place pool writes (jvarlen.parallel.pipeline.slots) against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jvarlen.parallel.pipeline import slots


def cleared(pool: np.ndarray, start: int, mask: np.ndarray) -> np.ndarray:
    out = pool.copy()
    for j in np.flatnonzero(mask):
        if start + j < pool.shape[1]:
            out[:, start + j] = 0
    return out


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 12),
    width=st.integers(1, 6),
    start=st.integers(0, 16),
    bits=st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_clear_rows_zeroes_the_masked_rows_and_keeps_every_other(rows, width, start, bits):
    """Rows ``start + j`` where ``mask[j]`` become zero, rows past the pool are dropped, every other
    row keeps its value: the slice is clamped into the pool as XLA clamps it, and pools shorter than
    the mask take the scatter."""
    pool = np.arange(2 * rows * 3, dtype=np.float32).reshape(2, rows, 3) + 1
    mask = np.array(bits[:width])
    out = jax.jit(slots.clear_rows)(jnp.asarray(pool), jnp.int32(start), jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(out), cleared(pool, start, mask))


def test_clear_rows_holds_no_block_of_zeros():
    """Clearing 512 rows of a donated ``[2, 4096, 2, 32]`` pool compiles in place, without the
    ``[2, 512, 2, 32]`` zero block (262 KB) a scatter of zeros holds: the pipeline's forwards clear
    a continuing document's dK/dV rows this way every tick (docs/design/executor-memory.md)."""
    pool = jax.ShapeDtypeStruct((2, 4096, 2, 32), jnp.float32)
    mask = jax.ShapeDtypeStruct((512,), jnp.bool_)
    block = 2 * 512 * 2 * 32 * 4

    def scatter(p, start, m):
        rows = jnp.where(m, start + jnp.arange(512), p.shape[1] + jnp.arange(512))
        return slots.put_rows(p, rows, jnp.zeros((2, 512, 2, 32), p.dtype))

    def temp(fn):
        lowered = jax.jit(fn, donate_argnums=0).lower(pool, jax.ShapeDtypeStruct((), jnp.int32), mask)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    assert temp(scatter) >= block  # the premise: XLA materialises the zeros a scatter writes
    assert temp(slots.clear_rows) < block // 8
