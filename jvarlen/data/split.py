"""Long documents -> pieces that fit one packed row, by splitting or (on request) truncating.

Nothing is dropped silently: the :class:`SplitReport` counts split and truncated
documents and the tokens truncation dropped.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


class Pieces(NamedTuple):
    """Table of document pieces, P rows; piece p is ``document(doc[p])[start[p] : start[p] + length[p]]``.

    ``has_next[p]``: the piece is followed by more tokens of its document (it is not the
    document's last piece), so its last token's target is the document's next token.
    """

    doc: np.ndarray  # int64 [P]
    start: np.ndarray  # int64 [P]
    length: np.ndarray  # int64 [P], 1 <= length <= max_doc_tokens
    has_next: np.ndarray  # bool [P]

    @property
    def num_pieces(self) -> int:
        return int(self.doc.shape[0])


@dataclasses.dataclass(frozen=True)
class SplitReport:
    policy: str
    max_doc_tokens: int
    documents: int
    pieces: int
    documents_split: int  # policy "split": documents cut into more than one piece
    documents_truncated: int  # policy "truncate": documents cut short
    tokens_kept: int
    tokens_dropped: int  # only ever non-zero under policy "truncate"

    def __str__(self) -> str:
        if self.policy == "split":
            return (
                f"{self.documents_split:,} of {self.documents:,} documents longer than {self.max_doc_tokens:,} "
                f"tokens split -> {self.pieces:,} pieces"
            )
        share = self.tokens_dropped / max(1, self.tokens_dropped + self.tokens_kept)
        return (
            f"{self.documents_truncated:,} of {self.documents:,} documents truncated to {self.max_doc_tokens:,} "
            f"tokens, {self.tokens_dropped:,} tokens dropped ({share:.1%})"
        )


def split_documents(lengths: np.ndarray, max_doc_tokens: int, policy: str = "split") -> tuple[Pieces, SplitReport]:
    """Cuts documents of ``lengths`` (int [N]) into pieces of at most ``max_doc_tokens`` tokens.

    "split": a document of L tokens becomes ceil(L / max) pieces, all but the last of
    exactly ``max_doc_tokens`` tokens. "truncate": one piece of its first
    ``max_doc_tokens`` tokens; the rest is dropped and counted.
    """
    if max_doc_tokens <= 0:
        raise ValueError(f"max_doc_tokens must be > 0, got {max_doc_tokens}")
    lengths = np.asarray(lengths, dtype=np.int64)
    docs = np.arange(lengths.size, dtype=np.int64)
    if policy == "split":
        counts = -(-lengths // max_doc_tokens)
        doc = np.repeat(docs, counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        start = (np.arange(doc.size, dtype=np.int64) - first) * max_doc_tokens
        length = np.minimum(max_doc_tokens, lengths[doc] - start)
        has_next = start + length < lengths[doc]
        report = SplitReport(
            policy,
            max_doc_tokens,
            int(lengths.size),
            int(doc.size),
            documents_split=int((counts > 1).sum()),
            documents_truncated=0,
            tokens_kept=int(lengths.sum()),
            tokens_dropped=0,
        )
    elif policy == "truncate":
        doc, start = docs, np.zeros_like(docs)
        length = np.minimum(lengths, max_doc_tokens)
        has_next = np.zeros(lengths.size, dtype=bool)
        dropped = int((lengths - length).sum())
        report = SplitReport(
            policy,
            max_doc_tokens,
            int(lengths.size),
            int(doc.size),
            documents_split=0,
            documents_truncated=int((lengths > max_doc_tokens).sum()),
            tokens_kept=int(length.sum()),
            tokens_dropped=dropped,
        )
    else:
        raise ValueError(f"unknown long_doc_policy {policy!r}; use 'split' or 'truncate'")
    return Pieces(doc, start, length, has_next), report
