"""Corpus sources, the on-disk cache, tokenizers and bad-input errors."""

import bz2
import dataclasses
import gzip
import json
import lzma
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jvarlen.data.corpus as corpus_module
from jvarlen.config import DataConfig
from jvarlen.data import (
    ByteTokenizer,
    CacheWriteError,
    Corpus,
    DataError,
    DataPipeline,
    EmptyCorpusError,
    MissingFieldError,
    Source,
    TokenIdError,
    TokenizerError,
    UnreadableFileError,
    load_corpus,
    load_tokenizer,
    stdlib_files,
)

BOS, EOS = 256, 257


def _load(tmp_path, kind, path, tokenizer="byte", **fields):
    source = Source.create(kind, str(path), **fields)
    return load_corpus(source, load_tokenizer(tokenizer), cache_dir=str(tmp_path / "cache"))


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def build_counter(monkeypatch):
    """Counts real tokenization runs (cache misses)."""
    calls = []
    real = corpus_module._build_cache

    def counting(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(corpus_module, "_build_cache", counting)
    return calls


# -- sources -------------------------------------------------------------------------------


def test_jsonl_text_documents_are_wrapped_in_bos_eos_and_empty_ones_skipped(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"text": "ab"}, {"text": ""}, {"text": "é"}])
    corpus = _load(tmp_path, "jsonl", path)
    assert corpus.num_documents == 2 and corpus.skipped_empty == 1
    assert corpus.document(0).tolist() == [BOS, 97, 98, EOS]
    assert corpus.document(1).tolist() == [BOS, 0xC3, 0xA9, EOS]
    assert corpus.lengths.tolist() == [4, 4] and corpus.lengths.dtype == np.int64
    assert corpus.num_tokens == 8 and corpus.vocab_size == 259 and corpus.tokens.dtype == np.uint16
    assert corpus.describe(1) == f"{path}:3"


def test_jsonl_token_id_field(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"ids": [5, 6, 7]}, {"ids": []}, {"ids": [258]}])
    corpus = _load(tmp_path, "jsonl", path, tokens_field="ids")
    assert corpus.num_documents == 2 and corpus.skipped_empty == 1
    assert corpus.document(0).tolist() == [BOS, 5, 6, 7, EOS]
    assert corpus.vocab_size == 259  # ids past the tokenizer's vocabulary are refused (test_reliability.py)


def test_text_directory_sorted_recursive_skipping_hidden(tmp_path):
    root = tmp_path / "texts"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_bytes(b"B")
    (root / "sub" / "a.md").write_bytes(b"A")
    (root / ".hidden").write_bytes(b"H")
    corpus = _load(tmp_path, "text_dir", root)
    assert [corpus.document(i).tolist() for i in range(corpus.num_documents)] == [[BOS, 66, EOS], [BOS, 65, EOS]]
    assert corpus.describe(1).endswith("sub/a.md")


def test_compressed_jsonl_is_read_and_other_files_are_named_as_skipped(tmp_path):
    root = tmp_path / "shards"
    root.mkdir()
    line = lambda text: (json.dumps({"text": text}) + "\n").encode()  # noqa: E731
    (root / "a.jsonl").write_bytes(line("a"))
    (root / "b.jsonl.gz").write_bytes(gzip.compress(line("b")))
    (root / "c.jsonl.bz2").write_bytes(bz2.compress(line("c")))
    (root / "d.jsonl.xz").write_bytes(lzma.compress(line("d")))
    (root / "e.json").write_bytes(line("e"))  # another suffix: not read, but said
    corpus = _load(tmp_path, "jsonl", root)
    assert [corpus.document(i).tolist()[1] for i in range(corpus.num_documents)] == [97, 98, 99, 100]
    assert Source.create("jsonl", str(root)).skipped_other == [str(root / "e.json")]
    config = DataConfig(source="jsonl", path=str(root), cache_dir=str(tmp_path / "cache"), seq_len=8)
    assert "1 file of another suffix skipped (first: " in DataPipeline(config).summary()
    (root / "f.jsonl.gz").write_bytes(gzip.compress(line("f"))[:-6])  # truncated download
    with pytest.raises(UnreadableFileError, match=r"f\.jsonl\.gz' after line 1: Compressed file ended"):
        _load(tmp_path, "jsonl", root)
    with pytest.raises(EmptyCorpusError, match=r"no files matching .jsonl.*\(1 other files, e.g. .*e\.json'\)"):
        _load(tmp_path, "jsonl", _directory_holding(tmp_path / "other", "e.json"))


def test_zstd_shards_are_read_and_a_codec_not_read_is_named(tmp_path):
    """``.jsonl.zst`` (many public corpora) is read, of several frames and a skippable one; a truncated one is an error
    (zstandard's stream reader returned the lines before the cut without one). The codec comes from
    the file's first bytes: a file given as data.path in a codec jvarlen does not read was reported
    as a corrupt JSON line."""
    import zstandard

    lines = b"".join((json.dumps({"text": chr(97 + i)}) + "\n").encode() for i in range(6))
    skippable = b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + bytes(4)  # as pzstd writes before each frame
    frames = (
        skippable + zstandard.ZstdCompressor().compress(lines[:40]) + zstandard.ZstdCompressor().compress(lines[40:])
    )
    root = tmp_path / "shards"
    root.mkdir()
    (root / "a.jsonl.zst").write_bytes(frames)
    (root / "b.jsonl").write_bytes(gzip.compress(lines[:14]))  # gzip under a plain name
    corpus = _load(tmp_path, "jsonl", root)
    assert [corpus.document(i).tolist()[1] for i in range(corpus.num_documents)] == [97, 98, 99, 100, 101, 102, 97]
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(frames[:-9])
    with pytest.raises(
        UnreadableFileError, match=r"cut\.jsonl\.zst' after line \d: the zstd stream ends inside a frame"
    ):
        _load(tmp_path, "jsonl", cut)
    lz4 = tmp_path / "d.jsonl.lz4"
    lz4.write_bytes(b"\x04\x22\x4d\x18" + bytes(20))
    with pytest.raises(
        UnreadableFileError, match=r"d\.jsonl\.lz4' is compressed with lz4, which jvarlen does not read"
    ):
        _load(tmp_path, "jsonl", lz4)


def _directory_holding(directory, name):
    directory.mkdir()
    (directory / name).write_text("{}")
    return directory


def test_parquet_text_and_token_columns(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["hi", None, "yo"], "ids": [[1, 2], [3], []]}), path)
    text = _load(tmp_path, "parquet", path)
    assert [text.document(i).tolist() for i in range(2)] == [[BOS, 104, 105, EOS], [BOS, 121, 111, EOS]]
    assert text.skipped_empty == 1 and text.describe(1) == f"{path}: row 2"
    ids = _load(tmp_path, "parquet", path, tokens_field="ids")
    assert [ids.document(i).tolist() for i in range(2)] == [[BOS, 1, 2, EOS], [BOS, 3, EOS]]


def test_hf_tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<s>": 3, "</s>": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    hf = load_tokenizer(str(tmp_path / "tok.json"))
    assert (hf.bos_id, hf.eos_id, hf.pad_id, hf.vocab_size) == (3, 4, 5, 6)  # no <pad>: appended
    assert hf.encode("hello world nope").tolist() == [1, 2, 0]
    path = _jsonl(tmp_path / "a.jsonl", [{"text": "world hello"}])
    corpus = _load(tmp_path, "jsonl", path, tokenizer=str(tmp_path / "tok.json"))
    assert corpus.document(0).tolist() == [3, 2, 1, 4]


def test_hf_tokenizer_encodes_whole_documents_as_text(tmp_path):
    """A tokenizer.json saved with truncation and padding on, and documents quoting its special
    tokens: every stored document is BOS, the whole text's ids, EOS (it decodes back to the text;
    no pad id, no boundary id inside), not cut to the file's max_length nor padded to the batch's
    longest, and ``</s>`` in the text is text."""
    tokenizers = pytest.importorskip("tokenizers")
    texts = ["a cat", "the cat sat on the mat " * 6 + "</s> <s> end", "<pad>"]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.enable_truncation(max_length=4)
    tok.enable_padding(pad_id=2, pad_token="<pad>")
    tok.save(str(tmp_path / "tok.json"))
    saved = json.loads((tmp_path / "tok.json").read_text())
    assert saved["truncation"]["max_length"] == 4 and saved["padding"] is not None  # as the file says

    hf = load_tokenizer(str(tmp_path / "tok.json"))
    assert (hf.bos_id, hf.eos_id, hf.pad_id) == (0, 1, 2)
    corpus = _load(
        tmp_path,
        "jsonl",
        _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts]),
        tokenizer=str(tmp_path / "tok.json"),
    )
    for i, text in enumerate(texts):
        doc = corpus.document(i).tolist()
        assert doc[0] == hf.bos_id and doc[-1] == hf.eos_id
        assert not {hf.bos_id, hf.eos_id, hf.pad_id} & set(doc[1:-1]), doc
        assert hf.decode(doc[1:-1]) == text
    assert len(corpus.document(1)) > 40  # the long one whole


def test_hf_tokenizer_gives_missing_specials_ids_past_its_largest(tmp_path):
    """A vocabulary with a gap in its ids: the appended BOS/EOS/PAD take none of its ids."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hello": 7}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tok.json"))
    hf = load_tokenizer(str(tmp_path / "tok.json"))
    assert (hf.bos_id, hf.eos_id, hf.pad_id, hf.vocab_size) == (8, 9, 10, 11)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert ids.max() < 256 and tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id]])) == "héllo ✓"


# -- cache -----------------------------------------------------------------------------------


def test_cache_is_reused_without_retokenizing(tmp_path, build_counter):
    path = _jsonl(tmp_path / "a.jsonl", [{"text": "abc"}, {"text": "de"}])
    first = _load(tmp_path, "jsonl", path)
    assert len(build_counter) == 1 and not first.cache_hit
    second = _load(tmp_path, "jsonl", path)
    assert len(build_counter) == 1 and second.cache_hit
    assert second.directory == first.directory
    assert isinstance(second.tokens, np.memmap)
    np.testing.assert_array_equal(second.tokens, first.tokens)
    # Nothing but the finished cache directory is left behind (written via temp + rename).
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.directory.name]


def test_a_tokenization_says_what_it_does_and_how_far_it_is(tmp_path, monkeypatch):
    """Tokenizing a large corpus takes hours, which a run spent without a word: it says where the
    cache goes and, every 30 s (here every batch), how far it is; a cached corpus says nothing."""
    monkeypatch.setattr(corpus_module, "_PROGRESS_EVERY_S", 0.0)
    path = _jsonl(tmp_path / "a.jsonl", [{"text": "abc"}, {"text": ""}, {"text": "de"}])
    source, said = Source.create("jsonl", str(path)), []
    corpus = load_corpus(source, load_tokenizer("byte"), cache_dir=str(tmp_path / "cache"), say=said.append)
    assert said[0].startswith(f"[jvarlen] tokenizing 1 file (0.0 MiB) into {corpus.directory} (once: ")
    assert said[1].startswith("[jvarlen] tokenizing: file 1 of 1, 2 documents, 9 tokens, ") and len(said) == 2
    said.clear()
    load_corpus(source, load_tokenizer("byte"), cache_dir=str(tmp_path / "cache"), say=said.append)
    assert said == []


def test_cache_is_invalidated_when_the_source_or_tokenizer_changes(tmp_path, build_counter):
    path = _jsonl(tmp_path / "a.jsonl", [{"text": "abc"}])
    first = _load(tmp_path, "jsonl", path)
    _jsonl(path, [{"text": "abc"}, {"text": "xyz"}])  # new content, new size
    second = _load(tmp_path, "jsonl", path)
    assert len(build_counter) == 2 and second.num_documents == 2 and second.directory != first.directory
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same size, newer mtime
    third = _load(tmp_path, "jsonl", path)
    assert len(build_counter) == 3 and third.directory != second.directory
    # Another tokenizer is another cache entry.
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "abc": 1}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tok.json"))
    fourth = _load(tmp_path, "jsonl", path, tokenizer=str(tmp_path / "tok.json"))
    assert len(build_counter) == 4 and fourth.directory != third.directory


@pytest.mark.parametrize(
    "damage", ["truncated tokens", "offsets.npy", "doc_source.npy", "cut offsets.npy", "cut doc_source.npy", "empty"]
)
def test_damaged_cache_is_rebuilt(tmp_path, build_counter, damage):
    path = _jsonl(tmp_path / "a.jsonl", [{"text": "abc"}])
    first = _load(tmp_path, "jsonl", path)
    if damage == "truncated tokens":
        with open(first.directory / "tokens.bin", "r+b") as f:
            f.truncate(2)
    elif damage.startswith("cut"):  # before: a bare numpy ValueError at every start, never rebuilt
        with open(first.directory / damage.split()[1], "r+b") as f:
            f.truncate(f.seek(0, os.SEEK_END) - 8)
    elif damage == "empty":
        (first.directory / "offsets.npy").write_bytes(b"")
    else:  # a file deleted (before: the load failed with a bare FileNotFoundError)
        (first.directory / damage).unlink()
    again = _load(tmp_path, "jsonl", path)
    assert len(build_counter) == 2 and again.document(0).tolist() == [BOS, 97, 98, 99, EOS]


def test_a_replacement_with_the_same_size_and_mtime_is_not_served_from_the_cache(tmp_path):
    """``cp -p``, ``rsync -t`` or ``tar x`` of a corrected file keeps its size and mtime: the cache key
    also holds the ctime and inode, which no copy can keep (before: the old tokens were served)."""
    path = _jsonl(tmp_path / "a.jsonl", [{"text": "the cat sat"}])
    stat = path.stat()
    assert _load(tmp_path, "jsonl", path).document(0).tolist()[1:4] == list(b"the")
    _jsonl(tmp_path / "new.jsonl", [{"text": "one dog ran"}])
    os.replace(tmp_path / "new.jsonl", path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert _load(tmp_path, "jsonl", path).document(0).tolist()[1:-1] == list(b"one dog ran")


def test_the_digest_of_the_first_documents_is_that_of_a_corpus_of_them(tmp_path):
    """``Corpus.digest``: recorded when the cache is built, computed for a ``data.max_documents``
    prefix; the two agree, and documents of the same lengths with other tokens differ."""
    records = [{"text": "abc"}, {"text": "de"}, {"text": "fgh"}]
    whole = _load(tmp_path, "jsonl", _jsonl(tmp_path / "a.jsonl", records))
    first_two = _load(tmp_path, "jsonl", _jsonl(tmp_path / "b.jsonl", records[:2]))
    assert Corpus(whole.directory, limit=2).digest == first_two.digest == first_two.meta["digest"]
    assert Corpus(whole.directory, limit=3).digest == whole.digest != first_two.digest
    same_lengths = _load(tmp_path, "jsonl", _jsonl(tmp_path / "c.jsonl", [{"text": "abd"}, *records[1:]]))
    assert same_lengths.digest != whole.digest


# -- bad input -------------------------------------------------------------------------------


def test_errors_are_value_errors():
    for error in (EmptyCorpusError, UnreadableFileError, MissingFieldError, TokenIdError, TokenizerError):
        assert issubclass(error, DataError) and issubclass(error, ValueError)


def test_empty_corpus(tmp_path):
    path = _jsonl(tmp_path / "empty.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(EmptyCorpusError, match="no non-empty documents.*2 empty documents skipped"):
        _load(tmp_path, "jsonl", path)
    (tmp_path / "none").mkdir()
    with pytest.raises(EmptyCorpusError, match="contains no files"):
        _load(tmp_path, "text_dir", tmp_path / "none")
    assert not any((tmp_path / "cache").iterdir())  # no half-written cache left behind


def test_corrupt_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "fine"}\n{"text": "broken\n')
    with pytest.raises(UnreadableFileError, match=r"bad\.jsonl:4: corrupt JSONL line"):
        _load(tmp_path, "jsonl", path)
    # valid JSON, but the text escapes a lone surrogate (no tokenizer can encode it); an escaped
    # pair is one character and reads as it
    path.write_text('{"text": "pair \\ud83d\\ude00"}\n{"text": "lone \\ud800 x"}\n')
    with pytest.raises(UnreadableFileError, match=r"bad\.jsonl:2: corrupt JSONL line \(field 'text' escapes a lone"):
        _load(tmp_path, "jsonl", path)
    path.write_text('{"text": "pair \\ud83d\\ude00"}\n')
    assert bytes(_load(tmp_path, "jsonl", path).document(0)[1:-1].astype(np.uint8)).decode() == "pair \U0001f600"


def test_missing_field_names_field_and_line(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"text": "ok"}, {"content": "x"}])
    with pytest.raises(MissingFieldError, match=r"a\.jsonl:2: record has no field 'text' \(has: \['content'\]\)"):
        _load(tmp_path, "jsonl", path)
    with pytest.raises(MissingFieldError, match="must be a string"):
        _load(tmp_path, "jsonl", _jsonl(tmp_path / "b.jsonl", [{"text": 5}]))
    with pytest.raises(MissingFieldError, match="no column 'body'"):
        pq.write_table(pa.table({"text": ["a"]}), tmp_path / "c.parquet")
        _load(tmp_path, "parquet", tmp_path / "c.parquet", text_field="body")


class _LowSpecials(ByteTokenizer):
    """A 1,000-id tokenizer whose special ids are small (as most are): a model vocabulary below its
    size but above its specials."""

    vocab_size, bos_id, eos_id, pad_id, identity = 1_000, 1, 2, 0, "low-specials-test"


def test_token_id_beyond_model_vocab(tmp_path):
    path = _jsonl(tmp_path / "ids.jsonl", [{"ids": [1, 2]}, {"ids": [3, 300, 4]}])
    corpus = load_corpus(Source.create("jsonl", str(path), tokens_field="ids"), _LowSpecials(), str(tmp_path / "c"))
    expected = r"token id 300 in document 1 \(.*ids\.jsonl:2\) is >= the model vocabulary size 290"
    with pytest.raises(TokenIdError, match=expected):
        corpus.check_vocab(290)
    corpus.check_vocab(301)  # large enough: fine
    with pytest.raises(TokenIdError, match="negative token id"):
        _load(tmp_path, "jsonl", _jsonl(tmp_path / "neg.jsonl", [{"ids": [1, -2]}]), tokens_field="ids")


def test_missing_or_corrupt_tokenizer_file(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer file '.*nope\.json' does not exist"):
        load_tokenizer(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    with pytest.raises(TokenizerError, match="could not be read as a Hugging Face tokenizer"):
        load_tokenizer(str(tmp_path / "bad.json"))
    config = DataConfig(tokenizer=str(tmp_path / "nope.json"), cache_dir=str(tmp_path / "c"))
    with pytest.raises(TokenizerError, match="nope.json"):
        DataPipeline(config)


def test_unreadable_parquet_and_missing_path(tmp_path):
    (tmp_path / "junk.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(UnreadableFileError, match=r"cannot read Parquet file '.*junk\.parquet'"):
        _load(tmp_path, "parquet", tmp_path / "junk.parquet")
    with pytest.raises(UnreadableFileError, match="does not exist"):
        _load(tmp_path, "jsonl", tmp_path / "missing.jsonl")


# -- the embedded default corpus ------------------------------------------------------------


def test_stdlib_corpus_realistic_and_fast(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("stdlib-cache"))
    config = DataConfig(cache_dir=cache)
    start = time.perf_counter()
    cold = DataPipeline(config, vocab_size=320)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    warm = DataPipeline(config, vocab_size=320)
    warm_s = time.perf_counter() - start
    assert not cold.corpus.cache_hit and warm.corpus.cache_hit
    corpus = warm.corpus
    files = stdlib_files()
    assert not any("site-packages" in str(f) for f in files)
    assert corpus.num_documents + corpus.skipped_empty == len(files) >= 1000
    lengths = corpus.lengths
    median, p99 = np.percentile(lengths, [50, 99])
    assert 2_000 < median < 20_000 and p99 > 10 * median and lengths.max() > 200_000  # long-tailed
    assert (corpus.tokens[corpus.offsets[:-1]] == BOS).all()
    assert (corpus.tokens[corpus.offsets[1:] - 1] == EOS).all()
    assert cold_s < 20 and warm_s < 2, (cold_s, warm_s)
    summary = warm.summary()
    assert f"{corpus.num_documents:,} documents" in summary and "split" in summary
    batch = warm.next_batch()
    assert batch.shape == (config.rows_per_batch, config.seq_len) and batch.padding_ratio < 0.5


class _BigVocab(ByteTokenizer):
    """A tokenizer with more than 65,535 ids: tokens must be stored as uint32."""

    vocab_size, bos_id, eos_id, pad_id, identity = 70_000, 69_997, 69_998, 69_999, "big-vocab-test"


def test_token_store_dtype_follows_vocab_size(tmp_path):
    path = _jsonl(tmp_path / "ids.jsonl", [{"ids": [1, 66_000]}])
    source = Source.create("jsonl", str(path), tokens_field="ids")
    big = load_corpus(source, _BigVocab(), cache_dir=str(tmp_path / "cache"))
    assert big.tokens.dtype == np.uint32 and big.document(0).tolist() == [69_997, 1, 66_000, 69_998]
    with pytest.raises(TokenIdError, match=r"ids\.jsonl \(record 1\): token id 66000 is outside the vocabulary"):
        load_corpus(source, ByteTokenizer(), cache_dir=str(tmp_path / "cache"))


def test_a_cache_the_disk_refuses_is_a_data_error_naming_the_directory(tmp_path):
    """A corpus cache write that fails (here each file limited to 4 KiB, as a full disk refuses it)
    is a :class:`CacheWriteError` naming data.cache_dir and the OS's reason, with nothing left
    behind (before: the OSError's traceback from the middle of the build)."""
    import resource

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": "word " * 400 + str(i)}) + "\n" for i in range(20)))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # Python ignores SIGXFSZ: writes fail EFBIG
    try:
        with pytest.raises(CacheWriteError, match=r"cannot be written in data.cache_dir .*cache.* \(File too large\)"):
            _load(tmp_path, "jsonl", path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert os.listdir(tmp_path / "cache") == []  # the partial build removed
    assert _load(tmp_path, "jsonl", path).num_documents == 20  # and built once the disk allows it


def test_the_summary_says_how_many_batches_an_epoch_is(tmp_path):
    _jsonl(tmp_path / "big.jsonl", [{"text": "x" * 98}] * 5)  # 5 documents of 100 tokens
    config = DataConfig(source="jsonl", path=str(tmp_path / "big.jsonl"), cache_dir=str(tmp_path / "c"), seq_len=64)
    pipeline = DataPipeline(dataclasses.replace(config, tokens_per_batch=128))
    assert "an epoch is at least 4 batches" in pipeline.summary()  # 500 piece tokens, 128 a batch
    epochs = [pipeline.next_batch() and pipeline.epoch for _ in range(4)]
    assert epochs[:3] == [0, 0, 0]  # the first three batches cannot hold the epoch
    # a corpus smaller than a batch: every step holds all of it, and only it
    small = DataPipeline(dataclasses.replace(config, tokens_per_batch=1024))
    assert "the corpus' 500 tokens are 48.8% of a batch's 1,024: an epoch is one step" in small.summary()
    for epoch in range(1, 3):
        batch = small.next_batch()
        assert small.epoch == epoch and int((batch.segment_ids > 0).sum()) == 500


def test_a_linked_in_directory_is_read_once_and_hidden_files_are_not(tmp_path):
    """A data directory that links its shards in (``more -> ../shards``) reads them (before: left
    out without a word), a link back to a directory already read adds nothing, and hidden files
    and directories stay unread."""
    from jvarlen.data.sources import Source

    shards, data = tmp_path / "shards", tmp_path / "data"
    shards.mkdir()
    data.mkdir()
    (shards / "b.jsonl").write_text(json.dumps({"text": "linked"}) + "\n")
    (data / "a.jsonl").write_text(json.dumps({"text": "local"}) + "\n")
    (data / ".hidden.jsonl").write_text(json.dumps({"text": "hidden"}) + "\n")
    os.symlink(shards, data / "more")
    os.symlink(data, shards / "loop")  # data/more/loop -> data: a cycle, walked once
    source = Source.create("jsonl", str(data))
    assert [p.relative_to(data).as_posix() for p in source.files] == ["a.jsonl", "more/b.jsonl"]
    assert source.skipped_other == []


def test_the_temporary_directory_of_a_killed_build_is_removed_by_the_next_load(tmp_path):
    """A build killed without a ``finally`` (SIGKILL, out of memory) left its ``.tmp-*`` directory,
    as large as the corpus, for ever. The next load removes one whose process on this host is gone
    and that nobody wrote to for 10 minutes; a live builder's, a fresh one's and another host's stay."""
    import socket
    import subprocess

    cache = tmp_path / "cache"
    cache.mkdir()
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid names no process
    host = socket.gethostname()
    names = {
        "killed": f".tmp-jsonl-k1+{child.pid}@{host}+0123abcd",
        "recent": f".tmp-jsonl-k2+{child.pid}@{host}+0123abce",
        "live": f".tmp-jsonl-k3+{os.getpid()}@{host}+0123abcf",
        "elsewhere": f".tmp-jsonl-k4+{child.pid}@another-{host}+0123abc0",
    }
    hour_ago = time.time() - 3600
    for key, name in names.items():
        (cache / name).mkdir()
        (cache / name / "tokens.bin").write_bytes(b"\0" * 64)
        if key != "recent":
            for path in (cache / name / "tokens.bin", cache / name):
                os.utime(path, (hour_ago, hour_ago))
    corpus = _load(tmp_path, "jsonl", _jsonl(tmp_path / "a.jsonl", [{"text": "abc"}]))
    left = {p.name for p in cache.iterdir()}
    assert left == {corpus.directory.name, names["recent"], names["live"], names["elsewhere"]}
