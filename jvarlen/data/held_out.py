"""Held-out documents (``eval.documents``) and the fixed batches they are evaluated in.

Documents are held out whole: each of a document's pieces goes to the same side.
The set is the first ``count`` indices of a fixed permutation of the documents, and the
permutation's seed is a constant. So the set depends on the corpus and on ``count`` only, not
on ``data.seed``: runs in another batch order evaluate on the same documents (docs/design/evaluation.md).
"""

from __future__ import annotations

import numpy as np

from jvarlen.data.packer import place
from jvarlen.data.permutation import IndexPermutation
from jvarlen.data.split import Pieces

HELD_OUT_SEED = 0x5EED_E7A1  # fixed: the set must not follow data.seed


def held_out_documents(num_documents: int, count: int) -> np.ndarray:
    """The sorted indices (int64 ``[count]``) of the ``count`` documents held out of ``num_documents``.
    At least one document must be left to train on."""
    if not 0 <= count < num_documents:
        raise ValueError(
            f"eval.documents={count} must be below the corpus' {num_documents:,} documents: at least one "
            "is needed for training"
        )
    if count == 0:
        return np.zeros(0, np.int64)
    perm = IndexPermutation(num_documents, HELD_OUT_SEED)
    return np.sort(np.fromiter((perm[i] for i in range(count)), np.int64, count))


def select(pieces: Pieces, mask: np.ndarray) -> Pieces:
    """The rows of the piece table where ``mask`` (bool ``[P]``) is set, in their order."""
    return Pieces(*(np.asarray(column)[mask] for column in pieces))


def split_held_out(pieces: Pieces, documents: np.ndarray) -> tuple[Pieces, Pieces]:
    """(training pieces, held-out pieces): the held-out side has the pieces of ``documents``."""
    held = np.isin(pieces.doc, documents)
    return select(pieces, ~held), select(pieces, held)


def pack_all(lengths: np.ndarray, rows: int, seq_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every item of ``lengths`` (int ``[n]``, each at most ``seq_len``) in batches of ``rows`` rows:
    one ``(items, row of each)`` pair per batch.

    Each batch is a best-fit placement of the items left, longest first (:func:`place`); the items
    that do not fit go to the next batch. Each batch places at least the longest item left, so
    the loop ends, and every item is in exactly one batch."""
    left = np.arange(len(lengths), dtype=np.int64)
    lengths = np.asarray(lengths, np.int64)
    batches = []
    while left.size:
        row_of = place(lengths[left], rows, seq_len)
        placed = row_of >= 0
        batches.append((left[placed], row_of[placed]))
        left = left[~placed]
    return batches
