"""The head's memory on the last stage, in bytes per device (docs/design/head.md): exact per chunk
(:meth:`HeadMemory.head_memory`) and as an affine bound in the chunk's tokens
(:meth:`HeadMemory.head_memory_lines`), which the capacity searches that divide a probe chunk's
memory by its tokens need: the tiled logits do not grow with the tokens past one tile. A mixin of
:class:`jvarlen.plan.cost.CostModel`."""

from __future__ import annotations

import math

from jvarlen import head_tiles
from jvarlen.plan.chunk import ChunkShape


class HeadMemory:
    def _head_shape(self) -> tuple[int, float]:
        """(logit columns on a device, bytes per row of its tokens besides the logits)."""
        m, sp, e = self.model, self.layout.sp, self.coeffs.bytes_per_element
        if self.splits_vocab:
            return m.vocab_size // sp, (e + 4.0) * m.d_model
        return m.vocab_size, e * m.d_model

    def _head_rows(self, tokens: int) -> float:
        """A device's rows of the chunk's logits: all ``T`` split by vocabulary, else ``T/sp`` (a
        fraction where the planner's unpadded ``T`` is not a multiple of sp: linear in ``T``, as
        the rest of the account)."""
        return float(tokens) if self.splits_vocab else tokens / self.layout.sp

    def head_memory(self, chunk: ChunkShape) -> float:
        """Bytes the head holds on one device of the last stage while it computes a chunk's loss and
        gradient, a tile of tokens at a time (``jvarlen.model.head``):

        - ``m_head_token / V`` per logit of one tile (fp32 logits and their gradient in the compute
          dtype: ``4 + e`` bytes), the tile of ``jvarlen.head_tiles.logits_tiles`` over the
          device's ``T/sp`` tokens and ``V`` columns, or, split by vocabulary over sp
          (:attr:`splits_vocab`), over the chunk's ``T`` tokens and ``V/sp`` columns;
        - with more than one tile, the fp32 sum of the head's gradient, ``4 · d · columns``;
        - per token, the outputs' gradient (``e · d``), or, split, the chunk's outputs gathered over
          sp and their fp32 gradient before its reduce-scatter (``(e + 4) · d`` per token of ``T``).

        On abstract H100s (llama-7b's width, 32K / 128K vocabularies, 1K-64K tokens, whole and split
        over 2: ``scripts/head_memory.py``) this is 1.01-3.1× XLA's temporaries for the head alone,
        never under: XLA fuses a single tile's gradient into its matmuls (2-4 B per logit), and the
        whole head's outputs' gradient is the program's output there. Coefficients whose
        ``m_head_token`` is 0 charge no head."""
        rows = self._head_rows(chunk.tokens)
        if rows == 0 or self.coeffs.m_head_token <= 0:
            return 0.0
        columns, per_row = self._head_shape()
        tiles, _ = head_tiles.logits_tiles(math.ceil(rows), columns, self.model.d_model)
        tile_rows = rows / tiles  # the executor's tiles hold whole rows; the planner's rows are T/sp
        carry = 4.0 * self.model.d_model * columns if tiles > 1 else 0.0
        return self.coeffs.m_head_token / self.model.vocab_size * tile_rows * columns + carry + per_row * rows

    def head_memory_lines(self) -> list[tuple[float, float, float]]:
        """Affine bounds of :meth:`head_memory` in a chunk's tokens ``T``: ``(fixed, per token,
        limit)``, each ``head_memory <= fixed + per · T`` for every ``T <= limit``. While a device's
        rows are one tile (at most ``R1 = (tile + 4·d·C) / 4C``) the head is linear in them; past
        that the logits and their gradient sum are at most the largest tile's (tiles of up to
        ``tile / 4C + 1`` rows) and only the rows' own bytes grow. The lines' ``per`` is also a
        lower bound of the head's growth (its rows' own bytes)."""
        m, sp = self.model, self.layout.sp
        if self.coeffs.m_head_token <= 0:
            return [(0.0, 0.0, math.inf)]
        columns, per_row = self._head_shape()
        per_logit = self.coeffs.m_head_token / m.vocab_size
        carry = 4.0 * m.d_model * columns
        one_tile = (head_tiles.LOGITS_TILE_BYTES + carry) // (4 * columns)
        tiled = head_tiles.LOGITS_TILE_BYTES // (4 * columns) + 1
        cap = max(per_logit * one_tile * columns, per_logit * tiled * columns + carry)
        rows = 1.0 if self.splits_vocab else 1.0 / sp  # a device's rows per chunk token
        return [(0.0, (per_logit * columns + per_row) * rows, one_tile / rows), (cap, per_row * rows, math.inf)]

    def activation_per_token(self, stage: int, ckpt_layers: int, tail: bool = True) -> float:
        """:meth:`activation_memory` per token of a chunk without context on ``stage``, all but the
        last stage's head (every other term is linear in the tokens)."""
        probe = ChunkShape(0, (self.layout.sp,), tail=tail)
        head = self.head_memory(probe) if self._is_last(stage) else 0.0
        return (self.activation_memory(probe, ckpt_layers, stage) - head) / self.layout.sp

    def chunk_memory_lines(self, stage: int, ckpt_layers: int, in_flight: int = 1, tail: bool = True) -> list:
        """Affine bounds ``(fixed, per token, limit)`` of ``in_flight · activation_memory +
        working_memory`` of a chunk of ``T`` tokens without context on ``stage`` (every term is
        linear in ``T`` but the last stage's head: :meth:`head_memory_lines`)."""
        sp = self.layout.sp
        linear = self.activation_per_token(stage, ckpt_layers, tail)
        work = self.working_memory(ChunkShape(0, (sp,), tail=tail), ckpt_layers) / sp
        heads = self.head_memory_lines() if self._is_last(stage) else [(0.0, 0.0, math.inf)]
        return [(in_flight * fixed, in_flight * (linear + per) + work, limit) for fixed, per, limit in heads]

    @staticmethod
    def fitting_tokens(free: float, lines) -> int:
        """The most tokens whose memory, bounded by ``lines`` (:meth:`chunk_memory_lines`), stays
        within ``free`` bytes: under one line within its limit (a chunk of fewer fits too)."""
        best = 0
        for fixed, per, limit in lines:
            if free > fixed and per > 0:
                best = max(best, int(min(limit, (free - fixed) // per)))
        return best
