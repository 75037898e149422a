"""A tokenized corpus: one memory-mapped token array plus int64 document offsets.

Built once per (source files, their sizes, mtimes, ctimes and inodes, tokenizer) and cached on disk
under ``<cache_dir>/<kind>-<key>/``::

    tokens.bin      raw uint16 (vocab <= 65535) or uint32 token ids, all documents back to back
    offsets.npy     int64 [num_documents + 1]; document i = tokens[offsets[i]:offsets[i+1]]
    doc_source.npy  int64 [num_documents, 2]; (file index, line/row) each document came from
    meta.json       dtype, counts, tokenizer identity, file list, skipped empty documents,
                    a SHA-256 of the tokens and document lengths (``digest``)

Each stored document is ``[BOS] + tokens + [EOS]``; documents with no tokens are
skipped and counted. The directory is written under a temporary name and renamed
into place, so a reader never sees a half-written cache; the temporary directory of a build
that was killed is removed by the next load (its name holds the builder's host and pid).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import re
import shutil
import socket
import time
import uuid
from typing import Callable, Optional

import numpy as np

from jvarlen.data.errors import CacheWriteError, EmptyCorpusError, TokenIdError, UnreadableFileError
from jvarlen.data.sources import Source
from jvarlen.data.tokenizer import Tokenizer

# 2: meta records binary files skipped under text_dir; 3: pre-tokenized ids within the tokenizer;
# 4: meta records the digest of the tokens, and all four files must be present
FORMAT_VERSION = 4
CACHE_FILES = ("tokens.bin", "offsets.npy", "doc_source.npy", "meta.json")
DEFAULT_CACHE_DIR = "~/.cache/jvarlen"
_ENCODE_BATCH = 256


def cache_key(fingerprint: dict, tokenizer: Tokenizer) -> str:
    """Hex digest over a source's fingerprint (:meth:`Source.fingerprint`: paths, sizes, mtimes,
    ctimes, inodes) and the tokenizer identity."""
    blob = json.dumps(
        {
            "version": FORMAT_VERSION,
            "source": fingerprint,
            "tokenizer": tokenizer.identity,
            "specials": [tokenizer.bos_id, tokenizer.eos_id],
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


class Corpus:
    """Read-only view of a cached corpus, optionally restricted to its first ``limit`` documents.

    ``tokens`` is a ``np.memmap``; ``document(i)`` returns a view into it (no copy).
    """

    def __init__(self, directory: str | os.PathLike, limit: Optional[int] = None, cache_hit: bool = True):
        self.directory = pathlib.Path(directory)
        self.cache_hit = cache_hit  # False when this process just tokenized the source
        with open(self.directory / "meta.json") as f:
            self.meta = json.load(f)
        offsets = np.load(self.directory / "offsets.npy")
        total = len(offsets) - 1
        self._limit = total if limit is None else min(int(limit), total)
        self.offsets = offsets[: self._limit + 1]
        self.doc_source = np.load(self.directory / "doc_source.npy")[: self._limit]
        dtype, size = np.dtype(self.meta["dtype"]), (self.meta["num_tokens"],)
        tokens = np.memmap(self.directory / "tokens.bin", dtype=dtype, mode="r", shape=size)
        self.tokens = tokens[: int(self.offsets[-1])]
        self.lengths = np.diff(self.offsets)  # int64 [num_documents]
        # the recorded digest covers every document; a prefix's is computed on first use
        self._digest: Optional[str] = self.meta.get("digest") if self._limit == total else None

    @property
    def digest(self) -> str:
        """SHA-256 (hex) of the documents' tokens, then their offsets as little-endian int64: the
        cache's recorded digest, or, for the first ``limit`` documents, computed on first use."""
        if self._digest is None:
            h = hashlib.sha256(memoryview(np.ascontiguousarray(self.tokens)))  # the memory map, not a copy
            h.update(self.offsets.astype("<i8").tobytes())
            self._digest = h.hexdigest()
        return self._digest

    @property
    def num_documents(self) -> int:
        return self._limit

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def vocab_size(self) -> int:
        """Tokenizer vocabulary, or one past the largest stored id if that is larger."""
        return max(int(self.meta["tokenizer_vocab_size"]), int(self.meta["max_token_id"]) + 1)

    @property
    def skipped_empty(self) -> int:
        return int(self.meta["skipped_empty"])

    @property
    def skipped_binary(self) -> list[str]:
        """``text_dir`` files skipped because they are not text (binary)."""
        return list(self.meta.get("skipped_binary", []))

    @property
    def not_utf8(self) -> list[str]:
        """Files read whole (text_dir, stdlib) that are not valid UTF-8: a text tokenizer reads their
        undecodable bytes as U+FFFD; the byte tokenizer reads bytes."""
        return list(self.meta.get("not_utf8", []))

    @property
    def files(self) -> list[str]:
        return self.meta["files"]

    def document(self, i: int) -> np.ndarray:
        """Token ids of document ``i`` (``[BOS] + text tokens + [EOS]``), a memmap view."""
        if not 0 <= i < self._limit:
            raise IndexError(f"document {i} out of range [0, {self._limit})")
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def describe(self, i: int) -> str:
        """Where document ``i`` came from: ``file`` or ``file:line`` / ``file: row N``."""
        file_index, record = (int(x) for x in self.doc_source[i])
        path = self.files[file_index]
        if self.meta["kind"] == "jsonl":
            return f"{path}:{record}"
        if self.meta["kind"] == "parquet":
            return f"{path}: row {record}"
        return path

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raises :class:`TokenIdError` naming the first document holding an id >= ``model_vocab_size``."""
        if int(self.meta["max_token_id"]) < model_vocab_size:
            return
        bad = np.flatnonzero(self.tokens >= model_vocab_size)
        if bad.size == 0:  # the offending documents lie past the max_documents limit
            return
        doc = int(np.searchsorted(self.offsets, bad[0], side="right")) - 1
        largest = int(self.tokens.max())
        raise TokenIdError(
            f"token id {int(self.tokens[bad[0]])} in document {doc} ({self.describe(doc)}) is >= the model "
            f"vocabulary size {model_vocab_size} (largest id in the corpus: {largest}); set model.vocab_size "
            f">= {largest + 1} or use the tokenizer the token ids were made with"
        )

    def __repr__(self) -> str:
        return f"Corpus({self.meta['kind']}, documents={self.num_documents}, tokens={self.num_tokens})"


_PROGRESS_EVERY_S = 30.0


class _BuildProgress:
    """What a tokenization has done so far, one line every ``_PROGRESS_EVERY_S`` seconds: a large
    corpus takes hours, which a run would otherwise spend without a word."""

    def __init__(self, say: Optional[Callable[[str], None]], fingerprint: dict, directory: pathlib.Path):
        self.say, self.files = say, len(fingerprint["files"])
        self.start = self.last = time.monotonic()
        if say is not None:
            size = sum(entry[1] for entry in fingerprint["files"]) / 2**20  # sizes as the cache key saw them
            say(
                f"[jvarlen] tokenizing {self.files} file{'s' * (self.files != 1)} ({size:,.1f} MiB) into {directory} "
                "(once: later runs with the same data and tokenizer reuse it)"
            )

    def update(self, file_index: int, documents: int, tokens: int) -> None:
        now = time.monotonic()
        if self.say is None or now - self.last < _PROGRESS_EVERY_S:
            return
        self.last, seconds = now, now - self.start
        self.say(
            f"[jvarlen] tokenizing: file {file_index + 1} of {self.files}, {documents:,} documents, "
            f"{tokens:,} tokens, {tokens / seconds:,.0f} tokens/s, {seconds:,.0f} s"
        )


def _build_cache(
    source: Source,
    tokenizer: Tokenizer,
    directory: pathlib.Path,
    fingerprint: dict,
    say: Optional[Callable[[str], None]] = None,
) -> None:
    """Tokenizes ``source`` (of this ``fingerprint``) into ``directory`` (written under a temporary
    name, then renamed); ``say``: where progress lines go (none without it)."""
    progress = _BuildProgress(say, fingerprint, directory)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32)
    limit = np.iinfo(dtype).max
    tmp = _temporary(directory)
    tmp.mkdir(parents=True)
    lengths: list[int] = []
    origins: list[tuple[int, int]] = []
    skipped = written = 0
    max_id = -1
    digest = hashlib.sha256()  # of the stored tokens as written, then the document offsets
    try:
        with open(tmp / "tokens.bin", "wb") as out:

            def flush(batch):
                nonlocal skipped, max_id, written
                texts = [d.text for d in batch if d.token_ids is None]
                encoded = iter(tokenizer.encode_batch(texts) if texts else [])
                for doc in batch:
                    ids = doc.token_ids if doc.token_ids is not None else next(encoded)
                    if ids.size == 0:
                        skipped += 1
                        continue
                    top = int(ids.max())
                    if doc.token_ids is not None and top >= tokenizer.vocab_size:
                        where = source.files[doc.file_index]
                        raise TokenIdError(
                            f"{where} (record {doc.record}): token id {top} is outside the vocabulary of "
                            f"data.tokenizer ({tokenizer.vocab_size} ids). Pre-tokenized ids "
                            "must come from the tokenizer named by data.tokenizer: its BOS/EOS ids are added "
                            "around every document"
                        )
                    if top > limit:
                        where = source.files[doc.file_index]
                        raise TokenIdError(
                            f"{where} (record {doc.record}): token id {top} does not fit the {dtype.name} token "
                            f"store chosen for tokenizer vocab size {tokenizer.vocab_size}; use a tokenizer "
                            "whose vocabulary covers these ids"
                        )
                    max_id = max(max_id, top)
                    row = np.empty(ids.size + 2, dtype=dtype)
                    row[0], row[-1] = tokenizer.bos_id, tokenizer.eos_id
                    row[1:-1] = ids
                    data = row.tobytes()
                    out.write(data)
                    digest.update(data)
                    lengths.append(row.size)
                    origins.append((doc.file_index, doc.record))
                    written += row.size
                if batch:
                    progress.update(batch[-1].file_index, len(lengths), written)

            batch = []
            for doc in source.documents():
                batch.append(doc)
                if len(batch) == _ENCODE_BATCH:
                    flush(batch)
                    batch = []
            flush(batch)
        if not lengths:
            files = ", ".join(repr(str(f)) for f in source.files[:3]) + (" ..." if len(source.files) > 3 else "")
            binary = f", {len(source.skipped_binary)} binary files skipped" if source.skipped_binary else ""
            raise EmptyCorpusError(
                f"data source {source.kind!r} has no non-empty documents in {files or '(no files)'} "
                f"({len(source.files)} files read, {skipped} empty documents skipped{binary})"
            )
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        digest.update(offsets.astype("<i8").tobytes())
        np.save(tmp / "offsets.npy", offsets)
        np.save(tmp / "doc_source.npy", np.asarray(origins, dtype=np.int64).reshape(-1, 2))
        meta = {
            "version": FORMAT_VERSION,
            "kind": source.kind,
            "dtype": dtype.name,
            "num_tokens": int(offsets[-1]),
            "num_documents": len(lengths),
            "skipped_empty": skipped,
            "skipped_binary": list(source.skipped_binary),
            "not_utf8": list(source.not_utf8),
            "max_token_id": max(max_id, tokenizer.bos_id, tokenizer.eos_id),
            "tokenizer": tokenizer.identity,
            "tokenizer_vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
            "files": [str(f) for f in source.files],
            "digest": digest.hexdigest(),
            "created": time.time(),
        }
        with open(tmp / "meta.json", "w") as f:
            json.dump(meta, f)
        _sync(tmp)  # on disk before the rename makes the cache valid: a power loss must not leave zeros
        try:
            os.rename(tmp, directory)
        except OSError:
            if not (directory / "meta.json").exists():  # not a concurrent writer winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_TEMPORARY = re.compile(r"\.tmp-.+\+(\d+)@(.+)\+[0-9a-f]{8}")  # what _temporary names: (pid, host)


def _temporary(directory: pathlib.Path) -> pathlib.Path:
    """Where a build of ``directory`` writes before its rename: named by its pid and host, so that
    :func:`_remove_killed_builds` knows a killed one."""
    return directory.parent / f".tmp-{directory.name}+{os.getpid()}@{socket.gethostname()}+{uuid.uuid4().hex[:8]}"


def _remove_killed_builds(root: pathlib.Path) -> None:
    """Removes the temporary directories that builds on this host left when they were killed
    (SIGKILL, out of memory, a lost node: no ``finally`` ran), each as large as its corpus.
    Another host's are left alone (its pids are not this host's), and so is one written to in the
    last ``_KILLED_AFTER_S`` (a container of the same host name in another pid namespace)."""
    if not root.is_dir():
        return
    host = socket.gethostname()
    for entry in root.iterdir():
        found = _TEMPORARY.fullmatch(entry.name)
        if found and found.group(2) == host and not _alive(int(found.group(1))) and _idle_s(entry) > _KILLED_AFTER_S:
            shutil.rmtree(entry, ignore_errors=True)  # garbage: another load may be removing it too


_KILLED_AFTER_S = 600


def _idle_s(directory: pathlib.Path) -> float:
    """Seconds since anything in ``directory`` (flat: the cache files) was last written."""
    try:
        newest = max([directory.stat().st_mtime] + [f.stat().st_mtime for f in directory.iterdir()])
    except OSError:  # removed meanwhile
        return 0.0
    return time.time() - newest


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


# what a write into the cache directory fails with, never a read of the data
_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS)


def _sync(directory: pathlib.Path) -> None:
    """fsync of the cache files in ``directory`` and of the directory itself."""
    for name in CACHE_FILES:
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _valid_cache(directory: pathlib.Path) -> bool:
    """Every file of a complete cache, of the sizes its meta.json gives (a damaged one is rebuilt:
    before, a truncated offsets.npy was a bare numpy error at every start)."""
    try:
        with open(directory / "meta.json") as f:
            meta = json.load(f)
        size = (directory / "tokens.bin").stat().st_size
        expected = meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
        documents = meta["num_documents"]
        offsets = np.load(directory / "offsets.npy", mmap_mode="r")
        origins = np.load(directory / "doc_source.npy", mmap_mode="r")
        return (
            meta.get("version") == FORMAT_VERSION
            and size == expected
            and offsets.shape == (documents + 1,)
            and int(offsets[0]) == 0
            and int(offsets[-1]) == meta["num_tokens"]
            and origins.shape == (documents, 2)
        )
    except (OSError, EOFError, ValueError, KeyError, TypeError):
        return False


def load_corpus(
    source: Source,
    tokenizer: Tokenizer,
    cache_dir: Optional[str] = None,
    max_documents: Optional[int] = None,
    say: Optional[Callable[[str], None]] = None,
) -> Corpus:
    """Returns the cached corpus for ``source`` + ``tokenizer``, tokenizing it first if needed
    (``say``: where that tokenization's progress lines go)."""
    root = pathlib.Path(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR))
    fingerprint = source.fingerprint()  # one stat per file, for the key and the progress line
    directory = root / f"{source.kind}-{cache_key(fingerprint, tokenizer)}"
    _remove_killed_builds(root)
    hit = _valid_cache(directory)
    if not hit:
        if directory.exists():  # damaged (e.g. partially deleted): rebuild
            shutil.rmtree(directory)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a file where the directory should be, no permission, ...
            why = "it is a file" if root.is_file() else error.strerror or error
            raise UnreadableFileError(
                f"data.cache_dir {str(root)!r} cannot be created ({why}); choose another directory"
            ) from None
        try:
            _build_cache(source, tokenizer, directory, fingerprint, say)
        except OSError as error:
            if error.errno not in _FULL:  # reading a data file: its own errors
                raise
            raise CacheWriteError(
                f"the corpus cache cannot be written in data.cache_dir {str(root)!r} ({error.strerror or error}); "
                "free space there or choose another directory"
            ) from None
    return Corpus(directory, limit=max_documents, cache_hit=hit)
