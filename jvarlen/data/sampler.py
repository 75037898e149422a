"""Token-budget sampler: global batches of pieces that fill ``rows x seq_len`` when packed.

Each epoch visits the pieces in a fresh permutation. A batch takes the pieces carried
over from the previous batch, then draws new ones until the candidates hold
``rows * seq_len + lookahead`` tokens; best-fit placement (:func:`place`, carried
pieces first, oldest first) decides what fits, and the rest is carried to the next
batch, never dropped. The epoch ends only once the permutation is exhausted *and*
the carry-over is empty, so every token of every piece is in exactly one batch per
epoch (the epoch's last batch may be partly empty).

The permutation is random-access (:class:`~jvarlen.data.permutation.IndexPermutation`):
element ``cursor`` of it is computed on demand, so the whole sampler position is
``(epoch, cursor, carry)``: a few integers to checkpoint, nothing to regenerate or store
per piece, and identical across restarts. Grain's packing iterators are not used: they
work on a record stream and cannot report or carry over pieces by our token-budget rule.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jvarlen.data.errors import SamplerStateError
from jvarlen.data.packer import place
from jvarlen.data.permutation import FEISTEL, LEGACY, IndexPermutation


class SampledBatch(NamedTuple):
    piece_ids: np.ndarray  # int64 [k] indices into the piece table
    rows: np.ndarray  # int64 [k] row each piece is placed in
    epoch: int  # epoch these pieces belong to


def epoch_seed(seed: int, epoch: int) -> int:
    """A 32-bit shuffle seed per (seed, epoch)."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, np.uint32)[0])


class TokenBudgetSampler:
    """Draws batches (:class:`SampledBatch`) of pieces, lengths ``piece_lengths`` (int [P]), for ``rows x seq_len``.

    ``lookahead``: extra candidate tokens drawn beyond the budget, giving best fit some
    choice (default one row).
    """

    def __init__(self, piece_lengths: np.ndarray, rows: int, seq_len: int, seed: int = 0, lookahead: int | None = None):
        self.lengths = np.asarray(piece_lengths, dtype=np.int64)
        if self.lengths.size == 0:
            raise ValueError("TokenBudgetSampler needs at least one piece")
        if self.lengths.min() < 1 or self.lengths.max() > seq_len:
            raise ValueError(f"piece lengths must be in [1, seq_len={seq_len}]; split documents first")
        self.rows, self.seq_len, self.seed = int(rows), int(seq_len), int(seed)
        self.lookahead = self.seq_len if lookahead is None else int(lookahead)
        self.epoch, self.cursor, self.carry, self.batches = 0, 0, [], 0
        self.shuffle = FEISTEL
        self._perm_epoch, self._perm = -1, None

    @property
    def num_pieces(self) -> int:
        return int(self.lengths.size)

    def _permutation(self):
        if self._perm_epoch != self.epoch:
            seed = epoch_seed(self.seed, self.epoch)
            if self.shuffle == LEGACY:  # a run resumed from a state written with grain's shuffle
                import grain

                self._perm = grain.MapDataset.range(self.num_pieces).shuffle(seed=seed)
            else:
                self._perm = IndexPermutation(self.num_pieces, seed)
            self._perm_epoch = self.epoch
        return self._perm

    def next(self) -> SampledBatch:
        budget = self.rows * self.seq_len
        candidates = list(self.carry)
        total = int(self.lengths[candidates].sum()) if candidates else 0
        perm = self._permutation()
        while total < budget + self.lookahead and self.cursor < self.num_pieces:
            pid = int(perm[self.cursor])
            self.cursor += 1
            candidates.append(pid)
            total += int(self.lengths[pid])
        ids = np.asarray(candidates, dtype=np.int64)
        rows = place(self.lengths[ids], self.rows, self.seq_len, num_priority=len(self.carry))
        placed = rows >= 0
        batch = SampledBatch(ids[placed], rows[placed], self.epoch)
        self.carry = [int(i) for i in ids[~placed]]
        self.batches += 1
        if self.cursor == self.num_pieces and not self.carry:
            self.epoch, self.cursor = self.epoch + 1, 0
        return batch

    def state(self) -> dict:
        """JSON-serialisable position; :meth:`restore` of it replays the same future batches."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "carry": list(self.carry),
            "batches": self.batches,
            "seed": self.seed,
            "num_pieces": self.num_pieces,
            "num_piece_tokens": int(self.lengths.sum()),
            "rows": self.rows,
            "seq_len": self.seq_len,
            "lookahead": self.lookahead,
            "shuffle": self.shuffle,
        }

    def restore(self, state: dict) -> None:
        mine = self.state()
        for key in ("seed", "num_pieces", "num_piece_tokens", "rows", "seq_len", "lookahead"):
            if key in state and state[key] != mine[key]:
                raise SamplerStateError(
                    f"sampler state has {key}={state[key]} but this pipeline has {key}={mine[key]}: "
                    "the checkpoint was written for a different corpus or batch shape"
                )
        carry = [int(i) for i in state["carry"]]
        if not 0 <= int(state["cursor"]) <= self.num_pieces or any(not 0 <= i < self.num_pieces for i in carry):
            raise SamplerStateError(f"sampler state out of range for {self.num_pieces} pieces: {state}")
        shuffle = state.get("shuffle", LEGACY)
        if shuffle not in (FEISTEL, LEGACY):
            raise SamplerStateError(f"sampler state uses the permutation {shuffle!r}, unknown to this version")
        self.epoch, self.cursor, self.carry = int(state["epoch"]), int(state["cursor"]), carry
        self.shuffle, self._perm_epoch = shuffle, -1
        self.batches = int(state.get("batches", 0))
