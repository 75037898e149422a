"""The host data pipeline: corpus -> pieces -> token-budget sampler -> packer.

Used by the training loop as::

    pipeline = DataPipeline(config.data, vocab_size=config.model.vocab_size)
    batch = pipeline.next_batch()      # PackedBatch, arrays [data.rows_per_batch, data.seq_len]
    saved = pipeline.state()           # JSON-serialisable; store it in the checkpoint
    pipeline.restore(saved)            # continues with exactly the same batches
    print(pipeline.summary())          # one line for the logs

With ``held_out=N`` (``eval.documents``), N whole documents are kept out of the batches;
``pipeline.eval_batches()`` packs them (:mod:`jvarlen.data.held_out`).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Optional

import numpy as np

from jvarlen.config import ConfigError, DataConfig
from jvarlen.data.corpus import Corpus, load_corpus
from jvarlen.data.errors import SamplerStateError
from jvarlen.data.held_out import held_out_documents, pack_all, split_held_out
from jvarlen.data.packer import PackedBatch, Piece, pack
from jvarlen.data.sampler import SampledBatch, TokenBudgetSampler
from jvarlen.data.sources import Source
from jvarlen.data.split import Pieces, split_documents
from jvarlen.data.tokenizer import ByteTokenizer, load_tokenizer

STATE_VERSION = 1


def _human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


class DataPipeline:
    """Builds the corpus (cached), splits long documents, samples and packs batches.

    ``vocab_size``: the model's vocabulary; every corpus token id must be below it
    (checked once here, :class:`TokenIdError` otherwise). ``None`` skips the check. ``say``: where
    the progress of a tokenization goes (a corpus not cached yet; nothing without it). ``held_out``:
    documents kept out of training for evaluation (``eval.documents``, :meth:`eval_batches`).
    """

    def __init__(
        self,
        config: DataConfig,
        vocab_size: Optional[int] = None,
        say: Optional[Callable[[str], None]] = None,
        held_out: int = 0,
    ):
        self.config = config
        start = time.perf_counter()
        self.tokenizer = load_tokenizer(config.tokenizer)
        source = Source.create(config.source, config.path, config.text_field, config.tokens_field)
        self.corpus: Corpus = load_corpus(source, self.tokenizer, config.cache_dir, config.max_documents, say)
        self.skipped_files = source.skipped_other  # listed anew each start: not part of the cached corpus
        self.load_seconds = time.perf_counter() - start
        if vocab_size is not None:
            self.corpus.check_vocab(vocab_size)
        self.pieces, self.split_report = split_documents(
            self.corpus.lengths, config.max_doc_tokens, config.long_doc_policy
        )
        try:
            self.held_out = held_out_documents(self.corpus.num_documents, held_out)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self.pieces, self.eval_pieces = split_held_out(self.pieces, self.held_out)
        self.rows, self.seq_len = config.rows_per_batch, config.seq_len
        self.sampler = TokenBudgetSampler(self.pieces.length, self.rows, self.seq_len, seed=config.seed)
        self.last_sample: Optional[SampledBatch] = None
        self._fingerprint: Optional[str] = None

    @property
    def epoch(self) -> int:
        """Epoch of the next batch."""
        return self.sampler.epoch

    def piece(self, p: int, table: Optional[Pieces] = None) -> Piece:
        """Piece ``p`` of the training piece table (or of ``table``): its tokens, corpus document and
        the token that follows it."""
        table = self.pieces if table is None else table
        doc, start, n = int(table.doc[p]), int(table.start[p]), int(table.length[p])
        tokens = self.corpus.document(doc)
        next_token = int(tokens[start + n]) if table.has_next[p] else -1
        return Piece(np.asarray(tokens[start : start + n]), doc, next_token)

    def eval_batches(self, rows: Optional[int] = None, every: bool = False) -> list[tuple[list[Piece], np.ndarray]]:
        """The held-out documents' pieces (``every``: all the corpus' pieces, a validation corpus's) in
        batches of ``rows`` (default ``rows_per_batch``) x ``seq_len``: one ``(pieces, row of each)``
        pair per batch, the same on every call and process; [] without held-out documents."""
        table = self.pieces if every else self.eval_pieces
        batches = pack_all(table.length, rows or self.rows, self.seq_len)
        return [([self.piece(int(p), table) for p in items], rows) for items, rows in batches]

    def next_batch(self) -> PackedBatch:
        """The next global batch, arrays ``[rows_per_batch, seq_len]``."""
        sample = self.sampler.next()
        self.last_sample = sample
        return pack([self.piece(int(p)) for p in sample.piece_ids], self.rows, self.seq_len, sample.rows)

    def __iter__(self) -> Iterator[PackedBatch]:
        while True:
            yield self.next_batch()

    def state(self) -> dict:
        """JSON-serialisable pipeline position (sampler state plus a corpus identity check)."""
        return {
            "version": STATE_VERSION,
            "corpus": self.corpus.directory.name,
            "num_documents": self.corpus.num_documents,
            "fingerprint": self.fingerprint(),
            "seq_len": self.seq_len,
            "held_out": len(self.held_out),
            "sampler": self.sampler.state(),
        }

    def restore(self, state: dict) -> None:
        """Continues from ``state``; raises :class:`SamplerStateError` if it belongs to another corpus/shape."""
        if state.get("version") != STATE_VERSION:
            raise SamplerStateError(f"data pipeline state version {state.get('version')} != {STATE_VERSION}")
        if state.get("num_documents") != self.corpus.num_documents:
            raise SamplerStateError(
                f"data pipeline state is for {state.get('num_documents')} documents, this corpus has "
                f"{self.corpus.num_documents} (data.source / data.max_documents changed?)"
            )
        seq_len = state.get("seq_len", self.seq_len)  # absent in states written before 2026-12-02
        if seq_len != self.seq_len:
            raise SamplerStateError(
                f"data pipeline state was saved with data.seq_len={seq_len}, this run has {self.seq_len}: "
                "documents are cut into pieces of at most data.seq_len tokens, so the saved position would point "
                f"at other pieces; resume with data.seq_len={seq_len} or start a new run"
            )
        held_out = state.get("held_out", 0)  # absent in states written before 2026-12-04: none held out
        if held_out != len(self.held_out):
            raise SamplerStateError(
                f"data pipeline state was saved with eval.documents={held_out}, this run has {len(self.held_out)}: "
                "the held-out documents are not trained on, so another count changes the training data under "
                f"the run; resume with eval.documents={held_out} or start a new run"
            )
        saved = state.get("fingerprint")  # absent in states written before 2026-11-28
        if saved is not None and saved != self.fingerprint():
            raise SamplerStateError(
                "data pipeline state was saved for other data: the corpus' tokens or its pieces differ "
                f"from this run's (corpus {state.get('corpus')!r}, now {self.corpus.directory.name!r}; a data "
                "file edited, reordered or replaced, another tokenizer or data.max_doc_tokens). Resuming would "
                "train some documents twice and others never in this epoch; restore the data or start a new run"
            )
        self.sampler.restore(state["sampler"])

    def fingerprint(self) -> str:
        """A digest of the corpus' tokens and pieces (what the batches depend on besides the sampler's
        position): equal on every process of a run, and from a checkpoint to its resume."""
        if self._fingerprint is None:
            import hashlib

            h = hashlib.sha256(self.corpus.digest.encode())
            for a in (self.pieces.doc, self.pieces.start, self.pieces.length, self.pieces.has_next):
                h.update(np.asarray(a, np.int64).tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def summary(self) -> str:
        """One line for the logs: documents, tokens, length quantiles, split/truncation counts."""
        c, lengths = self.corpus, self.corpus.lengths
        median, p99 = np.percentile(lengths, [50, 99])
        cache = "cached" if c.cache_hit else "tokenized"
        return (
            f"{c.meta['kind']} corpus, {c.num_documents:,} documents ({c.skipped_empty} empty skipped"
            f"{f', {len(c.skipped_binary)} binary files skipped' if c.skipped_binary else ''}"
            f"{_not_utf8(c)}{_skipped_files(self.skipped_files)}), "
            f"{_human(c.num_tokens)} tokens; length median {_human(median)} / p99 {_human(p99)} / "
            f"max {_human(lengths.max())}; {self.split_report}; {_held_out(self)}batch {self.rows}x{self.seq_len}; "
            f"{_epoch_length(int(self.pieces.length.sum()), self.rows * self.seq_len)}; "
            f"{cache} in {self.load_seconds:.2f}s"
        )


def make_batches(config: DataConfig, model_vocab_size: Optional[int] = None) -> Iterator[PackedBatch]:
    """Endless iterator of packed batches (a :class:`DataPipeline` without checkpointing)."""
    return iter(DataPipeline(config, vocab_size=model_vocab_size))


def _epoch_length(tokens: int, batch_tokens: int) -> str:
    """The summary's epoch length in batches: at least the pieces' tokens over a batch's (the packing
    leaves room in some rows; a batch never takes pieces of the next epoch)."""
    if tokens < batch_tokens:
        return (
            f"the corpus' {tokens:,} tokens are {tokens / batch_tokens:.1%} of a batch's {batch_tokens:,}: "
            "an epoch is one step (two where its pieces do not pack into one batch)"
        )
    return f"an epoch is at least {-(-tokens // batch_tokens):,} batches"


def _held_out(pipeline: DataPipeline) -> str:
    """The summary's note on the documents held out for evaluation (empty when there are none)."""
    n = len(pipeline.held_out)
    if not n:
        return ""
    tokens = int(pipeline.eval_pieces.length.sum())
    return f"{n:,} document{'s' if n > 1 else ''} ({_human(tokens)} tokens) held out for evaluation; "


def _skipped_files(paths: list[str]) -> str:
    """The summary's note on files in the data directory of a suffix the source does not read."""
    if not paths:
        return ""
    n = len(paths)
    return f", {n} file{'s' if n > 1 else ''} of another suffix skipped (first: {paths[0]})"


def _not_utf8(corpus: Corpus) -> str:
    """The summary's note on files that are not valid UTF-8 (empty when there are none)."""
    if not corpus.not_utf8:
        return ""
    what = "read as bytes" if corpus.meta["tokenizer"] == ByteTokenizer.identity else "undecodable bytes read as U+FFFD"
    n = len(corpus.not_utf8)
    return f", {n} file{'s' if n > 1 else ''} not valid UTF-8 ({what}; first: {corpus.not_utf8[0]})"
