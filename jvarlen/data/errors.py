"""Data errors. Every one is a ``ValueError`` whose message names the file, field or value at fault."""

from __future__ import annotations


class DataError(ValueError):
    """Base class of every error raised by :mod:`jvarlen.data` for bad input."""


class EmptyCorpusError(DataError):
    """The source produced no non-empty document."""


class UnreadableFileError(DataError):
    """A data file is missing, unreadable, or not in the expected format (bad JSON line, bad Parquet)."""


class MissingFieldError(DataError):
    """A record lacks the configured text/token field, or the field has the wrong type."""


class TokenIdError(DataError):
    """A token id is negative, too large to store, or not below the model's vocabulary size."""


class TokenizerError(DataError):
    """The tokenizer spec names a missing or unreadable tokenizer file."""


class SamplerStateError(DataError):
    """A saved sampler state does not belong to this corpus / batch shape."""


class CacheWriteError(DataError):
    """The corpus cache could not be written (a full disk, a file-size limit, a read-only mount)."""
