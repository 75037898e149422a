"""Shared pieces of the varlen attention kernels: block sizes, visibility, constants.

Visibility contract (see ``docs/architecture.md``, "Packed attention inputs"):
a query sees a key iff both carry the same non-zero segment id and, when causal,
``kv_position <= q_position``. Segment id 0 is padding.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# logsumexp written for rows that see no key. Finite (never -inf) and so negative
# that exp(EMPTY_ROW_LSE - x) == 0 for any realistic x, so merging partial results by
# logsumexp gives such rows zero weight.
EMPTY_ROW_LSE = -1e30


class UnsupportedError(ValueError):
    """A configuration the kernels refuse up front (rather than fail inside XLA/Triton)."""


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes. ``block_q`` x ``block_kv`` is one tile of the score matrix.

    Both must be powers of two >= 16 (Triton ``dot`` constraint). Inputs whose
    length is smaller than a block use a smaller power-of-two block automatically.
    """

    block_q: int = 128
    block_kv: int = 128

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 16 or val & (val - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {val!r}")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def fit_block_sizes(block_sizes: BlockSizes, t: int, s: int) -> BlockSizes:
    """Shrinks blocks to the smallest power of two >= the length (min 16)."""
    return BlockSizes(
        block_q=min(block_sizes.block_q, max(16, next_power_of_2(t))),
        block_kv=min(block_sizes.block_kv, max(16, next_power_of_2(s))),
    )


def visible(q_seg, q_pos, kv_seg, kv_pos, causal: bool):
    """[..., Tq] x [..., Tk] -> [..., Tq, Tk] bool visibility mask."""
    q_seg = q_seg[..., :, None]
    kv_seg = kv_seg[..., None, :]
    mask = (q_seg == kv_seg) & (q_seg != 0)
    if causal:
        mask = mask & (kv_pos[..., None, :] <= q_pos[..., :, None])
    return mask


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad_axis(x, axis: int, size: int, value=0):
    """Pads ``x`` along ``axis`` up to ``size`` with ``value``."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)
