"""Opening a possibly compressed data file by what it holds, not by its name.

The codec is read from the file's first bytes: a ``.jsonl`` that is really gzip is read, and a
file compressed with a codec jvarlen does not read (lz4, zip, 7z) is refused by name instead of
being parsed as text and reported as a corrupt JSON line. zstd (``.jsonl.zst``, the format of many
public corpora) is read through :class:`_ZstdFile`, which raises on a stream that ends inside a
frame: ``zstandard``'s own stream reader returns the lines before the cut without an error.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import zlib
from typing import BinaryIO

import zstandard

from jvarlen.data.errors import UnreadableFileError

# a file's first bytes -> its codec; the ones without an opener are refused by name
_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\x04\x22\x4d\x18", "lz4"),
    (b"PK\x03\x04", "zip"),
    (b"7z\xbc\xaf\x27\x1c", "7z"),
)
_CHUNK = 1 << 16  # compressed bytes per read: bounds the decompressed output held at once

# what reading a damaged or truncated archive raises (besides OSError)
DAMAGED = (EOFError, lzma.LZMAError, zlib.error, zstandard.ZstdError)


def codec_of(head: bytes) -> str | None:
    """The compression codec whose magic number ``head`` starts with; None for plain bytes."""
    if len(head) >= 4 and 0x50 <= head[0] <= 0x5F and head[1:4] == b"\x2a\x4d\x18":
        return "zstd"  # a skippable frame first (pzstd writes one before each of its frames)
    return next((codec for magic, codec in _MAGIC if head.startswith(magic)), None)


def open_data_file(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened for reading its decompressed bytes (gzip, bzip2, xz, zstd or plain);
    :class:`UnreadableFileError` for another codec."""
    with open(path, "rb") as f:
        codec = codec_of(f.read(8))
    if codec is None:
        return open(path, "rb")
    if codec == "zstd":
        return io.BufferedReader(_ZstdFile(path))
    opener = {"gzip": gzip.open, "bzip2": bz2.open, "xz": lzma.open}.get(codec)
    if opener is None:
        raise UnreadableFileError(
            f"data file {os.fspath(path)!r} is compressed with {codec}, which jvarlen does not read; "
            "decompress it, or recompress it with gzip, bzip2, xz or zstd"
        )
    return opener(path, "rb")


class _ZstdFile(io.RawIOBase):
    """The decompressed bytes of a zstd file of one or more frames; :class:`EOFError` where the
    file ends inside a frame (truncated: a copy cut short, a disk that filled)."""

    def __init__(self, path: str | os.PathLike):
        self._file = open(path, "rb")
        self._decompressor = zstandard.ZstdDecompressor(max_window_size=2**31)  # `zstd --long=31` files too
        self._frame = None
        self._out, self._at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._at == len(self._out):
            chunk = self._file.read(_CHUNK)
            if not chunk:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("the zstd stream ends inside a frame: the file is truncated")
                return 0
            out = []
            while chunk:  # a chunk may end one frame and start the next
                if self._frame is None or self._frame.eof:
                    self._frame = self._decompressor.decompressobj()
                out.append(self._frame.decompress(chunk))
                chunk = self._frame.unused_data if self._frame.eof else b""
            self._out, self._at = b"".join(out), 0
        n = min(len(buffer), len(self._out) - self._at)
        buffer[:n] = self._out[self._at : self._at + n]
        self._at += n
        return n

    def close(self) -> None:
        self._file.close()
        super().close()
