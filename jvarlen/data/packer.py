"""Packing document pieces into fixed-size rows: best-fit-decreasing placement + array layout.

Contract of a :class:`PackedBatch` (R = rows, T = seq_len; every array ``[R, T]``):

=============  =======  ==================================================================
tokens         int32    input token ids; padding holds 0
segment_ids    int32    1, 2, ... per piece inside each row in order; 0 = padding
positions      int32    position inside the piece, restarting at 0 for every piece; 0 on padding
targets        int32    the next token of the same document; 0 where there is none
loss_mask      float32  1.0 where ``targets`` is a real next token of the same document, else 0
doc_ids        int32    global corpus document index; -1 on padding (host-side accounting)
=============  =======  ==================================================================

Each piece occupies one contiguous span of one row. Its last token's target is the
document's next token when the piece is followed by more of its document
(``Piece.next_token >= 0``, a split piece), otherwise it has none (mask 0): the
document's final EOS, or the cut of a truncated document. So over the pieces of a
split document every token is an input once and every token but the first is a
target once. Attention sees only the piece (same non-zero segment id, causal by
``positions``), per the packed-attention contract in docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

import numpy as np


class Piece(NamedTuple):
    tokens: np.ndarray  # int [n], 1 <= n <= seq_len
    doc_id: int  # global document index
    next_token: int = -1  # token that follows the piece in its document; -1: none (document end / truncated)


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Packed arrays ``[rows, seq_len]``; see the module docstring for each field's meaning."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    doc_ids: np.ndarray

    DEVICE_FIELDS = ("tokens", "segment_ids", "positions", "targets", "loss_mask")

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens."""
        return int(np.count_nonzero(self.segment_ids))

    @property
    def num_target_tokens(self) -> int:
        """Tokens whose loss counts (``loss_mask`` sum)."""
        return int(np.count_nonzero(self.loss_mask))

    @property
    def num_pieces(self) -> int:
        return int(self.segment_ids.max(axis=1).sum())

    @property
    def padding_ratio(self) -> float:
        return 1.0 - self.num_tokens / self.tokens.size

    def as_dict(self) -> dict[str, np.ndarray]:
        """The arrays the device step consumes: tokens, segment_ids, positions, targets, loss_mask."""
        return {name: getattr(self, name) for name in self.DEVICE_FIELDS}


def place(lengths: np.ndarray, rows: int, seq_len: int, num_priority: int = 0) -> np.ndarray:
    """Best-fit placement of items of ``lengths`` (int [n]) into ``rows`` bins of ``seq_len``.

    The first ``num_priority`` items are placed first, in the given order (the sampler's
    carried-over pieces, oldest first, so none waits forever); the rest in decreasing
    length (stable). Each goes to the row with the least room that still fits it.
    Returns int64 [n]: the row of each item, or -1 where it did not fit.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > seq_len):
        raise ValueError(f"piece lengths must be in [1, seq_len={seq_len}], got {lengths.min()}..{lengths.max()}")
    rest = num_priority + np.argsort(-lengths[num_priority:], kind="stable")
    order = np.concatenate([np.arange(num_priority), rest])
    free = np.full(rows, seq_len, dtype=np.int64)
    row_of = np.full(lengths.size, -1, dtype=np.int64)
    for i in order:
        fits = free >= lengths[i]
        if fits.any():
            row = int(np.argmin(np.where(fits, free, seq_len + 1)))
            row_of[i] = row
            free[row] -= lengths[i]
    return row_of


def pack(pieces: Sequence[Piece], rows: int, seq_len: int, placement: Optional[np.ndarray] = None) -> PackedBatch:
    """Lays ``pieces`` out in ``rows`` rows of ``seq_len`` tokens.

    ``placement`` (int [len(pieces)]) gives each piece's row; by default best-fit
    decreasing (:func:`place`). Pieces are never dropped: if they do not all fit,
    ValueError. Inside a row pieces keep their order in ``pieces``.
    """
    lengths = np.array([len(p.tokens) for p in pieces], dtype=np.int64)
    if (lengths < 1).any():  # its next_token would land on the previous piece's last token
        raise ValueError(f"piece {int(np.argmin(lengths))} is empty; every piece needs at least one token")
    if placement is None:
        placement = place(lengths, rows, seq_len)
    placement = np.asarray(placement, dtype=np.int64)
    if placement.shape != lengths.shape or (placement < 0).any() or (placement >= rows).any():
        raise ValueError(
            f"{int((placement < 0).sum())} of {len(pieces)} pieces ({int(lengths.sum())} tokens) do not fit "
            f"{rows} rows x {seq_len} tokens; pieces are never dropped, so pack fewer"
        )
    shape = (rows, seq_len)
    tokens = np.zeros(shape, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    targets = np.zeros(shape, np.int32)
    loss_mask = np.zeros(shape, np.float32)
    doc_ids = np.full(shape, -1, np.int32)
    fill = np.zeros(rows, np.int64)
    segment = np.zeros(rows, np.int32)
    for piece, row, n in zip(pieces, placement, lengths):
        a, b = int(fill[row]), int(fill[row] + n)
        if b > seq_len:
            raise ValueError(f"row {row} overflows: placement puts {b} > seq_len={seq_len} tokens in it")
        segment[row] += 1
        tokens[row, a:b] = piece.tokens
        segment_ids[row, a:b] = segment[row]
        positions[row, a:b] = np.arange(n, dtype=np.int32)
        doc_ids[row, a:b] = piece.doc_id
        targets[row, a : b - 1] = piece.tokens[1:]
        loss_mask[row, a : b - 1] = 1.0
        if piece.next_token >= 0:
            targets[row, b - 1] = piece.next_token
            loss_mask[row, b - 1] = 1.0
        fill[row] = b
    return PackedBatch(tokens, segment_ids, positions, targets, loss_mask, doc_ids)
