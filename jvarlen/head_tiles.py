"""How the head's logits are tiled over tokens. Pure Python: the planner imports it.

The head computes a tile of tokens' logits, their loss and their gradient at a time
(:func:`jvarlen.model.head.head_loss`), so at most one tile's fp32 logits ``[tile, columns]``
exist at once, however many tokens a device has (docs/design/head.md).
"""

from __future__ import annotations

import math

# fp32 logits of one tile: with their gradient in the compute dtype, ~(4 + e)/4 of this in flight.
LOGITS_TILE_BYTES = 256 * 2**20


def logits_tiles(rows: int, columns: int, width: int, tile_bytes: int | None = None) -> tuple[int, int]:
    """(number of tiles, rows per tile) of ``rows`` tokens' fp32 logits over ``columns`` vocabulary
    entries, for a head of hidden size ``width``: as few tiles as keep each within ``tile_bytes``
    (a tile of one row where even that does not), of equal rows (the last padded: at most
    ``tiles - 1`` padding rows in all). More than one tile adds the fp32 sum of the head's gradient
    over them (``4 · width · columns`` bytes), so ``rows`` are one tile while their logits are at
    most that plus a tile's. ``tile_bytes`` defaults to :data:`LOGITS_TILE_BYTES` as it is when
    called (tests lower it)."""
    if rows < 1 or columns < 1:
        raise ValueError(f"rows and columns must be positive, got {rows}, {columns}")
    tile_bytes = LOGITS_TILE_BYTES if tile_bytes is None else tile_bytes
    logits = 4 * rows * columns
    if logits <= tile_bytes + 4 * width * columns:
        return 1, rows
    tiles = min(math.ceil(logits / tile_bytes), rows)
    return tiles, math.ceil(rows / tiles)
