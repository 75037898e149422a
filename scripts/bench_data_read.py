"""How fast a JSONL shard is read, plain and in each codec jvarlen reads (docs/benchmarks.md, "Reading
compressed JSONL"): a synthetic shard of ``--documents`` records, written once per codec, then read
line by line through :func:`jvarlen.data.compression.open_data_file` ``--repeats`` times.

    python scripts/bench_data_read.py [--documents 40000] [--repeats 5]

Prints per codec the file size, the best and median read time and the decompressed MB/s (best).
Tokenization, not reading, bounds a corpus build; this shows that the zstd reader (frame by frame,
:class:`jvarlen.data.compression._ZstdFile`) is not the slow part.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import json
import lzma
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np
import zstandard

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from jvarlen.data.compression import open_data_file  # noqa: E402

CODECS = {
    "plain": lambda data: data,
    "gzip": lambda data: gzip.compress(data, 6),
    "bzip2": lambda data: bz2.compress(data, 9),
    "xz": lambda data: lzma.compress(data),
    "zstd": lambda data: zstandard.ZstdCompressor(level=3).compress(data),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--documents", type=int, default=40_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    # words drawn from a random vocabulary: text that compresses about as well as prose (repeated
    # text would compress a hundredfold and time nothing but the container)
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(20_000)]
    zipf = np.minimum(rng.zipf(1.2, size=args.documents * 300), len(vocab)) - 1
    words, at = [vocab[i] for i in zipf], 0
    records = []
    for i in range(args.documents):
        n = 50 + (i * 37) % 500
        records.append((json.dumps({"text": " ".join(words[at : at + n])}) + "\n").encode())
        at += n
    data = b"".join(records)
    print(f"{args.documents} records, {len(data) / 1e6:.1f} MB decompressed")
    print("| codec | file MB | read s, best / median | MB/s (best) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, compress in CODECS.items():
            path = pathlib.Path(tmp) / f"shard.jsonl.{name}"
            path.write_bytes(compress(data))
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                with open_data_file(path) as f:
                    lines = sum(1 for _ in f)
                times.append(time.perf_counter() - t0)
            assert lines == args.documents, (name, lines)
            best = min(times)
            size = path.stat().st_size / 1e6
            print(
                f"| {name} | {size:.1f} | {best:.3f} / {statistics.median(times):.3f} | {len(data) / 1e6 / best:.0f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
