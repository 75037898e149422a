"""Host data pipeline (pure numpy): tokenizers, cached corpora, splitting, token-budget sampling, packing.

Entry point for training: :class:`DataPipeline`. See each module's docstring for the
contracts (:mod:`jvarlen.data.packer` documents the packed arrays).
"""

from jvarlen.data.corpus import Corpus, load_corpus
from jvarlen.data.errors import (
    CacheWriteError,
    DataError,
    EmptyCorpusError,
    MissingFieldError,
    SamplerStateError,
    TokenIdError,
    TokenizerError,
    UnreadableFileError,
)
from jvarlen.data.packer import PackedBatch, Piece, pack, place
from jvarlen.data.pipeline import DataPipeline, make_batches
from jvarlen.data.sampler import SampledBatch, TokenBudgetSampler
from jvarlen.data.sources import Source, stdlib_files
from jvarlen.data.split import Pieces, SplitReport, split_documents
from jvarlen.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "CacheWriteError",
    "Corpus",
    "DataError",
    "DataPipeline",
    "EmptyCorpusError",
    "HFTokenizer",
    "MissingFieldError",
    "PackedBatch",
    "Piece",
    "Pieces",
    "SampledBatch",
    "SamplerStateError",
    "Source",
    "SplitReport",
    "TokenBudgetSampler",
    "TokenIdError",
    "Tokenizer",
    "TokenizerError",
    "UnreadableFileError",
    "load_corpus",
    "load_tokenizer",
    "make_batches",
    "pack",
    "place",
    "split_documents",
    "stdlib_files",
]
