"""Packer and best-fit placement: hand-computed layout plus invariants on random inputs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jvarlen.data import PackedBatch, Piece, pack, place


def test_pack_hand_computed_layout():
    pieces = [
        Piece(np.array([10, 11, 12]), doc_id=7),  # a whole document
        Piece(np.array([20, 21]), doc_id=3, next_token=22),  # split piece: its document goes on with 22
        Piece(np.array([30, 31, 32, 33]), doc_id=5),
    ]
    batch = pack(pieces, rows=2, seq_len=5, placement=np.array([0, 0, 1]))
    np.testing.assert_array_equal(batch.tokens, [[10, 11, 12, 20, 21], [30, 31, 32, 33, 0]])
    np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 2, 2], [1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(batch.positions, [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]])
    np.testing.assert_array_equal(batch.targets, [[11, 12, 0, 21, 22], [31, 32, 33, 0, 0]])
    np.testing.assert_array_equal(batch.loss_mask, [[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch.doc_ids, [[7, 7, 7, 3, 3], [5, 5, 5, 5, -1]])
    assert batch.num_tokens == 9 and batch.num_target_tokens == 7 and batch.num_pieces == 3
    assert batch.padding_ratio == pytest.approx(0.1)
    arrays = batch.as_dict()
    assert set(arrays) == {"tokens", "segment_ids", "positions", "targets", "loss_mask"}
    assert all(a.shape == (2, 5) for a in arrays.values())
    assert arrays["tokens"].dtype == np.int32 and arrays["loss_mask"].dtype == np.float32


def test_place_is_best_fit_decreasing():
    # Decreasing order: 6 -> row 0 (tie, lowest row), 5 -> row 1, 4 -> row 0 (room 4 is tighter than 5),
    # 3 -> row 1 (the only room), 2 -> row 1 (fills it exactly).
    rows = place(np.array([3, 6, 2, 4, 5]), rows=2, seq_len=10)
    np.testing.assert_array_equal(rows, [1, 0, 1, 0, 1])


def test_place_priority_items_go_first_and_unfit_items_are_reported():
    # Without priority the two 6s would be placed first; with priority the 3 (oldest carry) goes first.
    rows = place(np.array([3, 6, 6]), rows=1, seq_len=8, num_priority=1)
    np.testing.assert_array_equal(rows, [0, -1, -1])
    rows = place(np.array([3, 6, 6]), rows=1, seq_len=8)
    np.testing.assert_array_equal(rows, [-1, 0, -1])


def test_pack_never_drops_pieces():
    pieces = [Piece(np.arange(1, 5), 0), Piece(np.arange(1, 5), 1), Piece(np.arange(1, 5), 2)]
    with pytest.raises(ValueError, match="never dropped"):
        pack(pieces, rows=1, seq_len=8)
    with pytest.raises(ValueError, match="piece lengths"):
        place(np.array([9]), rows=1, seq_len=8)
    # an empty piece with its own placement: its next token would be the previous piece's target
    empty = [Piece(np.arange(1, 4), 0, -1), Piece(np.zeros(0, np.int32), 1, 9)]
    with pytest.raises(ValueError, match="piece 1 is empty"):
        pack(empty, rows=1, seq_len=4, placement=np.array([0, 0]))


def _check_invariants(batch: PackedBatch, pieces: list[Piece], seq_len: int) -> None:
    rows = batch.tokens.shape[0]
    seen = []
    for r in range(rows):
        seg = batch.segment_ids[r]
        used = int(np.count_nonzero(seg))
        # Pieces are laid from the row start; padding only at the tail, and it carries nothing.
        assert (seg[:used] > 0).all() and (seg[used:] == 0).all()
        pad = slice(used, seq_len)
        assert (batch.tokens[r, pad] == 0).all() and (batch.targets[r, pad] == 0).all()
        assert (batch.loss_mask[r, pad] == 0).all() and (batch.doc_ids[r, pad] == -1).all()
        assert (batch.positions[r, pad] == 0).all()
        # Segment ids count 1, 2, ... with each segment contiguous.
        if used:
            assert seg[0] == 1 and set(np.diff(seg[:used])) <= {0, 1}
        for s in range(1, int(seg.max(initial=0)) + 1):
            (idx,) = np.nonzero(seg == s)
            a, b = idx[0], idx[-1] + 1
            assert b - a == idx.size
            np.testing.assert_array_equal(batch.positions[r, a:b], np.arange(b - a))  # restart at 0
            doc = batch.doc_ids[r, a]
            assert (batch.doc_ids[r, a:b] == doc).all()
            # Targets never cross a document: inside the piece they are the next input token ...
            np.testing.assert_array_equal(batch.targets[r, a : b - 1], batch.tokens[r, a + 1 : b])
            assert (batch.loss_mask[r, a : b - 1] == 1).all()
            last = (int(batch.targets[r, b - 1]), float(batch.loss_mask[r, b - 1]))
            seen.append((int(doc), tuple(batch.tokens[r, a:b]), *last))
    # ... and at the piece end, its own document's next token or nothing (masked).
    expected = sorted(
        (p.doc_id, tuple(int(t) for t in p.tokens), max(p.next_token, 0), float(p.next_token >= 0)) for p in pieces
    )
    assert sorted(seen) == expected
    assert batch.num_target_tokens == sum(len(p.tokens) - 1 + (p.next_token >= 0) for p in pieces)


@settings(max_examples=150, deadline=None)
@given(
    seq_len=st.integers(1, 24),
    rows=st.integers(1, 4),
    data=st.data(),
)
def test_pack_invariants_random(seq_len, rows, data):
    lengths = data.draw(st.lists(st.integers(1, seq_len), min_size=0, max_size=12))
    has_next = data.draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    rng = np.random.default_rng(len(lengths) * 1000 + seq_len)
    pieces = [
        Piece(rng.integers(1, 500, size=n), doc_id=i, next_token=int(rng.integers(1, 500)) if nxt else -1)
        for i, (n, nxt) in enumerate(zip(lengths, has_next))
    ]
    row_of = place(np.array(lengths, dtype=np.int64), rows, seq_len)
    placed = [p for p, r in zip(pieces, row_of) if r >= 0]
    ok = row_of >= 0
    free = seq_len - np.bincount(row_of[ok], weights=np.array(lengths)[ok], minlength=rows)
    assert (free >= 0).all()
    # Best fit never leaves out a piece that would still fit somewhere (free space only shrinks).
    for n, r in zip(lengths, row_of):
        if r < 0:
            assert n > free.max()
    batch = pack(placed, rows, seq_len, row_of[row_of >= 0])
    assert batch.shape == (rows, seq_len)
    _check_invariants(batch, placed, seq_len)
    assert batch.padding_ratio == pytest.approx(1 - sum(len(p.tokens) for p in placed) / (rows * seq_len))
