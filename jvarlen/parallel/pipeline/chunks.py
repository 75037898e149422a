"""Packing a plan's chunks into the executor's device arrays (host side, numpy only).

A chunk is a tuple of pieces ``(doc, start, length)`` (``jvarlen.plan.plan.Plan.chunks``);
``pieces[0]`` may continue a split document after ``start`` tokens (its context C).
Pieces are laid out one after another from token 0; the rest of the bucket is padding
(segment id 0). Segment ids are local to a chunk (1, 2, ... per piece): a split slice
finds its context through the chunk's context slot, not through a global id.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jvarlen.parallel.pipeline.signature import CHUNK_KEYS


@dataclasses.dataclass(frozen=True)
class PackedChunks:
    """Arrays of one pipeline: ``[n, T]`` int32 per key of CHUNK_KEYS, plus per chunk
    ``ctx_len [n]`` (C; 0 for batched chunks) and ``has_next [n]`` (piece 0 is continued)."""

    arrays: dict
    ctx_len: np.ndarray
    has_next: np.ndarray
    chunk_prev: tuple[int, ...]

    @property
    def n_chunks(self) -> int:
        return int(self.ctx_len.shape[0])

    @property
    def bucket(self) -> int:
        return int(self.arrays["tokens"].shape[1])

    def context_bucket(self) -> int:
        """Tokens of context any chunk reads or writes: max(C + T) over linked chunks, or 0."""
        linked = (self.ctx_len > 0) | (self.has_next > 0)
        if not linked.any():
            return 0
        return int((self.ctx_len[linked] + self.bucket).max())


def chunk_links(chunks: Sequence[Sequence[tuple[int, int, int]]]) -> list[int]:
    """``prev[k]``: the chunk whose piece 0 ends where chunk k's piece 0 starts, else -1."""
    ends = {}
    for k, c in enumerate(chunks):
        if c:
            d, s, n = c[0]
            ends[(d, s + n)] = k
    prev = []
    for c in chunks:
        if not c:  # an empty (all padding) chunk
            prev.append(-1)
            continue
        d, s, _ = c[0]
        if s > 0 and (d, s) not in ends:
            raise ValueError(f"piece {c[0]} continues document {d} at {s} but no chunk's piece 0 ends there")
        prev.append(ends[(d, s)] if s > 0 else -1)
    return prev


def document_tokens(document) -> tuple[np.ndarray, int]:
    """(tokens, next_token) of a planned document: a token array (``next_token = -1``), or a
    :class:`jvarlen.data.packer.Piece` of a longer corpus document whose ``next_token`` is the
    target of its last token (-1: the document ends there)."""
    if hasattr(document, "next_token"):
        return np.asarray(document.tokens), int(document.next_token)
    return np.asarray(document), -1


def pack_chunks(
    chunks: Sequence[Sequence[tuple[int, int, int]]],
    documents: Sequence,
    bucket: int,
) -> PackedChunks:
    """Lays out each chunk's pieces in a ``bucket``-token row.

    ``documents[d]``: token array or :class:`~jvarlen.data.packer.Piece` (see
    :func:`document_tokens`). Targets are the next token of the same document; the last
    token's target is the piece's ``next_token`` when it has one (a corpus document cut into
    pieces by ``data.max_doc_tokens``), else it has none (``loss_mask`` 0, as on padding). So a
    corpus document of n tokens contributes exactly n - 1 targets however it is split.
    """
    n = len(chunks)
    arrays = {key: np.zeros((n, bucket), np.int32) for key in CHUNK_KEYS}
    ctx_len = np.zeros(n, np.int32)
    has_next = np.zeros(n, np.int32)
    for k, pieces in enumerate(chunks):
        used = sum(p[2] for p in pieces)
        if used > bucket:
            raise ValueError(f"chunk {k} holds {used} tokens, more than the bucket of {bucket}")
        off = 0
        for i, (d, s, length) in enumerate(pieces):
            doc, next_token = document_tokens(documents[d])
            if s < 0 or length <= 0 or s + length > len(doc):
                raise ValueError(f"chunk {k}: piece {(d, s, length)} is outside document {d} of {len(doc)} tokens")
            if i > 0 and (s > 0 or s + length < len(doc)):
                raise ValueError(f"chunk {k}: pieces after the first must be whole documents, got {(d, s, length)}")
            sl = slice(off, off + length)
            arrays["tokens"][k, sl] = doc[s : s + length]
            arrays["segment_ids"][k, sl] = i + 1
            arrays["positions"][k, sl] = np.arange(s, s + length)
            nxt = np.arange(s + 1, s + length + 1)
            valid = nxt < len(doc)
            arrays["targets"][k, sl] = np.where(valid, doc[np.minimum(nxt, len(doc) - 1)], 0)
            if s + length == len(doc) and next_token >= 0:  # the piece continues in the corpus
                arrays["targets"][k, off + length - 1] = next_token
                valid[-1] = True
            arrays["loss_mask"][k, sl] = valid
            off += length
        if not pieces:
            continue
        d0, s0, l0 = pieces[0]
        ctx_len[k] = s0
        has_next[k] = int(s0 + l0 < len(document_tokens(documents[d0])[0]))
        if has_next[k] and len(pieces) > 1:
            raise ValueError(f"chunk {k}: a slice that is continued later must be alone in its chunk")
    return PackedChunks(arrays, ctx_len, has_next, tuple(chunk_links(chunks)))


def stack_pipelines(packs: Sequence[PackedChunks]) -> dict:
    """``{key: [dp, n, T]}`` plus ``ctx_len``/``has_next`` ``[dp, n]`` for dp pipelines of one signature."""
    shapes = {(p.n_chunks, p.bucket) for p in packs}
    if len(shapes) != 1:
        raise ValueError(f"all pipelines need the same (n_chunks, bucket), got {sorted(shapes)}")
    out = {key: np.stack([p.arrays[key] for p in packs]) for key in CHUNK_KEYS}
    out["ctx_len"] = np.stack([p.ctx_len for p in packs])
    out["has_next"] = np.stack([p.has_next for p in packs])
    return out
