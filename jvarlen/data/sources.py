"""Where raw documents come from: the stdlib sources, JSONL (plain or gzip/bzip2/xz/zstd), a text directory, Parquet.

A :class:`Source` lists its files (sorted, for determinism), gives a fingerprint of
them (paths, sizes, mtimes, ctimes, inodes: part of the corpus cache key) and yields
:class:`RawDocument` records, each either text (``str``/``bytes``) or token ids.
Read errors become :class:`UnreadableFileError` / :class:`MissingFieldError` naming
the file, line/row and field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sysconfig
from typing import Iterator, NamedTuple, Optional

import numpy as np

from jvarlen.data.compression import DAMAGED, open_data_file
from jvarlen.data.errors import EmptyCorpusError, MissingFieldError, TokenIdError, UnreadableFileError

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# what a directory source reads; other files in it are listed as skipped (Source.skipped_other)
SUFFIXES = {
    "jsonl": (".jsonl", ".jsonl.gz", ".jsonl.bz2", ".jsonl.xz", ".jsonl.zst"),
    "parquet": (".parquet",),
    "text_dir": None,
}


class RawDocument(NamedTuple):
    file_index: int  # index into Source.files
    record: int  # line (jsonl, 1-based), row (parquet, 0-based) or 0 (one file = one document)
    text: Optional[str | bytes]  # exactly one of text / token_ids is set
    token_ids: Optional[np.ndarray]


def stdlib_files() -> list[pathlib.Path]:
    """All ``*.py`` files of the running Python's standard library, sorted; no site-packages."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        files.extend(pathlib.Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files)


def _files_under(path: pathlib.Path, suffixes: tuple[str, ...] | None) -> tuple[list[pathlib.Path], list[str]]:
    """The files a source reads under ``path`` (sorted; hidden ones left out) and the others it
    skips (their suffix is not one it reads: said in the corpus summary, never silently)."""
    if not path.exists():
        raise UnreadableFileError(f"data path {str(path)!r} does not exist")
    if path.is_file():
        return [path], []
    visible, seen = [], set()
    # linked-in directories are read too (rglob does not enter them), each real directory once
    for dirpath, dirnames, filenames in os.walk(path, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        visible.extend(pathlib.Path(dirpath, f) for f in filenames if not f.startswith("."))
    visible = sorted(p for p in visible if p.is_file())
    files = [p for p in visible if suffixes is None or p.name.endswith(suffixes)]
    if not files:
        wanted = f" matching {', '.join(suffixes)}" if suffixes else ""
        others = f" ({len(visible)} other files, e.g. {str(visible[0])!r})" if visible else ""
        raise EmptyCorpusError(f"data path {str(path)!r} contains no files{wanted}{others}")
    return files, [str(p) for p in visible if suffixes is not None and not p.name.endswith(suffixes)]


def _token_ids(value, where: str, name: str) -> np.ndarray:
    """A record's token ids: a flat list of integers (JSON ints; numpy/Arrow integer arrays).
    Floats, booleans and strings are refused, not converted: ``1.7`` or ``"12"`` in a token
    field is a data bug, and converting it would train on something else than what is there."""
    if value is None:
        return np.zeros(0, np.int64)
    if isinstance(value, np.ndarray):
        items = value
        if not (np.issubdtype(value.dtype, np.integer) or value.size == 0):
            raise MissingFieldError(f"{where}: field {name!r} must hold integer token ids, got dtype {value.dtype}")
    elif isinstance(value, (list, tuple)):
        items = value
        for i, v in enumerate(items):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise MissingFieldError(
                    f"{where}: field {name!r} must be a flat list of integer token ids; item {i} is "
                    f"{v!r} ({type(v).__name__})"
                )
    else:
        raise MissingFieldError(
            f"{where}: field {name!r} must be a list of integer token ids, got {type(value).__name__}"
        )
    try:
        ids = np.asarray(items, dtype=np.int64)
    except OverflowError as error:
        raise TokenIdError(f"{where}: field {name!r} holds a token id that does not fit 64 bits: {error}") from None
    if ids.ndim != 1:
        raise MissingFieldError(f"{where}: field {name!r} must be a flat list of token ids, got shape {ids.shape}")
    if ids.size and ids.min() < 0:
        raise TokenIdError(f"{where}: field {name!r} holds a negative token id {int(ids.min())}")
    return ids


def looks_binary(data: bytes) -> bool:
    """A file that is not text: a NUL byte in its first 8 KiB, or no valid UTF-8 there (the test
    git and grep use; a source file or prose never holds NUL)."""
    head = data[:8192]
    if b"\x00" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        return error.start < len(head) - 3  # a multi-byte character cut at the 8 KiB boundary is fine
    return False


@dataclasses.dataclass
class Source:
    """One configured document source (see ``DataConfig.source``)."""

    kind: str  # "stdlib" | "jsonl" | "text_dir" | "parquet"
    files: list[pathlib.Path]
    text_field: str = "text"
    tokens_field: Optional[str] = None
    skipped_binary: list[str] = dataclasses.field(default_factory=list)  # text_dir files that are not text
    not_utf8: list[str] = dataclasses.field(default_factory=list)  # read whole, but not valid UTF-8
    skipped_other: list[str] = dataclasses.field(default_factory=list)  # in the directory, of another suffix

    @classmethod
    def create(
        cls, kind: str, path: Optional[str] = None, text_field: str = "text", tokens_field: Optional[str] = None
    ) -> "Source":
        skipped: list[str] = []
        if kind == "stdlib":
            files = stdlib_files()
        elif kind in SUFFIXES:
            if path is None:
                raise UnreadableFileError(f"data.path is required for data.source={kind!r}")
            files, skipped = _files_under(pathlib.Path(os.path.expanduser(path)), SUFFIXES[kind])
        else:
            raise ValueError(f"unknown data.source {kind!r}; use stdlib, jsonl, text_dir or parquet")
        return cls(kind, files, text_field, tokens_field, skipped_other=skipped)

    def fingerprint(self) -> dict:
        """JSON-able description that changes when any file is added, removed, modified or replaced."""
        entries = []
        for f in self.files:
            try:
                st = f.stat()
            except OSError as error:
                raise UnreadableFileError(f"cannot stat data file {str(f)!r}: {error}") from error
            # ctime and inode too: a replacement that keeps size and mtime (cp -p, rsync -t, tar x) changes them
            entries.append([str(f), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
        fields = None if self.kind in ("stdlib", "text_dir") else [self.text_field, self.tokens_field]
        return {"kind": self.kind, "fields": fields, "files": entries}

    def documents(self) -> Iterator[RawDocument]:
        reader = {
            "stdlib": self._whole_files,
            "text_dir": self._whole_files,
            "jsonl": self._jsonl,
            "parquet": self._parquet,
        }[self.kind]
        for index, path in enumerate(self.files):
            yield from reader(index, path)

    # -- readers ---------------------------------------------------------------------------

    def _whole_files(self, index: int, path: pathlib.Path) -> Iterator[RawDocument]:
        try:
            data = path.read_bytes()
        except OSError as error:
            raise UnreadableFileError(f"cannot read data file {str(path)!r}: {error}") from error
        if self.kind == "text_dir" and looks_binary(data):
            self.skipped_binary.append(str(path))
            return
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:  # kept (the byte tokenizer reads bytes), but counted: a text tokenizer sees U+FFFD
            self.not_utf8.append(str(path))
        yield RawDocument(index, 0, data, None)

    def _field(self, record: dict, where: str) -> tuple[Optional[str | bytes], Optional[np.ndarray]]:
        name = self.tokens_field or self.text_field
        if not isinstance(record, dict) or name not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            option = "tokens_field" if self.tokens_field else "text_field"
            raise MissingFieldError(f"{where}: record has no field {name!r} (has: {keys}); set data.{option}")
        value = record[name]
        if self.tokens_field:
            return (None, _token_ids(value, where, name))
        if value is None:
            value = ""
        if not isinstance(value, (str, bytes)):
            raise MissingFieldError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
        return (value, None)

    def _jsonl(self, index: int, path: pathlib.Path) -> Iterator[RawDocument]:
        line_no = 0
        try:
            with open_data_file(path) as f:
                for line_no, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    where = f"{path}:{line_no}"
                    try:
                        record = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError) as error:
                        raise UnreadableFileError(f"{where}: corrupt JSONL line (invalid JSON: {error})") from error
                    text, ids = self._field(record, where)
                    if isinstance(text, str) and b"\\u" in line:  # JSON may escape a lone surrogate: not text
                        try:
                            text.encode("utf-8")
                        except UnicodeEncodeError as error:
                            raise UnreadableFileError(
                                f"{where}: corrupt JSONL line (field {self.text_field!r} escapes a lone UTF-16 "
                                f"surrogate, which is not Unicode text: {error})"
                            ) from error
                    yield RawDocument(index, line_no, text, ids)
        except (OSError, *DAMAGED) as error:  # unreadable, or a damaged/truncated archive
            after = f" after line {line_no}" if line_no else ""
            raise UnreadableFileError(f"cannot read data file {str(path)!r}{after}: {error}") from error

    def _parquet(self, index: int, path: pathlib.Path) -> Iterator[RawDocument]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        name = self.tokens_field or self.text_field
        try:
            parquet = pq.ParquetFile(path)
            columns = parquet.schema_arrow.names
        except (OSError, pa.ArrowException) as error:
            raise UnreadableFileError(f"cannot read Parquet file {str(path)!r}: {error}") from error
        if name not in columns:
            raise MissingFieldError(f"{path}: Parquet file has no column {name!r} (has: {columns})")
        row = 0
        try:
            for batch in parquet.iter_batches(columns=[name], batch_size=1024):
                for value in batch.column(0).to_pylist():
                    text, ids = self._field({name: value}, f"{path}: row {row}")
                    yield RawDocument(index, row, text, ids)
                    row += 1
        except (OSError, pa.ArrowException) as error:
            raise UnreadableFileError(f"cannot read Parquet file {str(path)!r} (row {row}): {error}") from error
