"""Tokenizes a corpus into the on-disk cache ahead of training, then prints its summary.

    python scripts/prepare_corpus.py                                   # the stdlib default
    python scripts/prepare_corpus.py --data.source=jsonl --data.path=docs.jsonl --data.tokenizer=tok.json

Takes the same config file and dotted overrides as ``python -m jvarlen.train``; a
later training run with the same data settings finds the cache and skips tokenization.
"""

import sys

from jvarlen.config import parse_config
from jvarlen.data import DataPipeline


def main(argv: list[str] | None = None) -> None:
    config = parse_config(sys.argv[1:] if argv is None else argv)
    pipeline = DataPipeline(config.data, vocab_size=config.model.vocab_size, say=print)
    print(pipeline.summary())
    print(f"cache: {pipeline.corpus.directory}")


if __name__ == "__main__":
    main()
