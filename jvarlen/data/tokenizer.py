"""Tokenizers: a byte-level default and a Hugging Face ``tokenizers`` JSON file wrapper.

Both expose the same small interface (:class:`Tokenizer`): ``encode`` to a numpy id
array, ``decode``, the special ids ``bos_id``/``eos_id``/``pad_id``, ``vocab_size``
and an ``identity`` string that changes whenever the mapping text -> ids could
change (it is part of the corpus cache key).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Protocol, Sequence

import numpy as np

from jvarlen.data.errors import TokenizerError


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    identity: str

    def encode(self, text: str | bytes) -> np.ndarray: ...

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """Ids 0-255 are the raw UTF-8 bytes; BOS=256, EOS=257, PAD=258; ``vocab_size`` 259."""

    vocab_size = 259
    bos_id = 256
    eos_id = 257
    pad_id = 258
    identity = "byte-v1"

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids)
        return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


_BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "[CLS]", "<|endoftext|>")
_EOS_NAMES = ("</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>", "[SEP]")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file.

    Special tokens are the ones a ``tokenizer_config.json`` beside the file declares
    (``bos_token``, ``eos_token``, ``pad_token``), else looked up by their usual names (``<s>``,
    ``</s>``, ``<|endoftext|>``, ``<pad>``, ...); any that the file lacks get fresh ids just past
    its vocabulary (past its largest id), so ``vocab_size`` may exceed the file's own size
    by up to 3. A document is encoded whole, as text: the corpus adds BOS/EOS itself, so
    the file's post-processing specials are not added, a truncation or padding saved in
    the file is switched off (it would cut documents, or store pad ids as their tokens),
    and a special token's string inside a document (a web page quoting ``</s>``) is
    tokenized as the text it is, not as that token's id.
    """

    def __init__(self, path: str | os.PathLike):
        import tokenizers

        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            inside = os.path.join(self.path, "tokenizer.json")
            hint = f" (it holds a tokenizer.json: set data.tokenizer={inside})" if os.path.isfile(inside) else ""
            raise TokenizerError(
                f"tokenizer path {self.path!r} is a directory, not a tokenizer JSON file{hint}; set data.tokenizer "
                "to 'byte' or to the path of a Hugging Face tokenizer.json"
            )
        if not os.path.isfile(self.path):
            raise TokenizerError(
                f"tokenizer file {self.path!r} does not exist; set data.tokenizer to 'byte' "
                "or to the path of a Hugging Face tokenizer.json"
            )
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as error:  # tokenizers raises its own Exception subclass
            raise TokenizerError(
                f"tokenizer file {self.path!r} could not be read as a Hugging Face tokenizer: {error}"
            ) from error
        self._tok.no_truncation()
        self._tok.no_padding()
        self._tok.encode_special_tokens = True
        declared = _declared_specials(os.path.dirname(self.path))
        digest = hashlib.sha256(raw + (json.dumps(declared, sort_keys=True).encode() if declared else b""))
        # v2: the file's truncation and padding off, special tokens' strings as text (caches
        # built before may hold cut or padded documents, or boundary ids inside one)
        self.identity = "hf-v2-" + digest.hexdigest()[:32]
        vocab = self._tok.get_vocab(with_added_tokens=True)
        base = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        next_id = base
        self.appended: list[str] = []  # the special tokens the file lacks, given ids past its vocabulary

        def special(kind: str, names: tuple[str, ...]) -> int:
            nonlocal next_id
            for name in (declared.get(kind), *names):
                if name in vocab:
                    return int(vocab[name])
            self.appended.append(kind)
            next_id += 1
            return next_id - 1

        self.bos_id = special("bos", _BOS_NAMES)
        self.eos_id = special("eos", _EOS_NAMES)
        self.pad_id = special("pad", _PAD_NAMES)
        self.vocab_size = max(next_id, base)

    def _text(self, text: str | bytes) -> str:
        return text.decode("utf-8", errors="replace") if isinstance(text, (bytes, bytearray)) else text

    def encode(self, text: str | bytes) -> np.ndarray:
        return np.asarray(self._tok.encode(self._text(text), add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch([self._text(t) for t in texts], add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _declared_specials(directory: str) -> dict:
    """``{"bos": name, "eos": name, "pad": name}`` (those given) from the ``tokenizer_config.json``
    that Hugging Face saves beside a ``tokenizer.json`` (a name, or ``{"content": name}``); {} if none."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return {}
    out = {}
    for kind in ("bos", "eos", "pad"):
        value = saved.get(f"{kind}_token") if isinstance(saved, dict) else None
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[kind] = value
    return out


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` -> :class:`ByteTokenizer`; anything else is a path to a tokenizer JSON file.

    Raises :class:`TokenizerError` naming the path when it is missing or unreadable.
    """
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(os.path.expanduser(spec))
