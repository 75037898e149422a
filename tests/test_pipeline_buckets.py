"""Chunk buckets of the pipeline path: eighth steps of the next power of two (less padding than
power-of-two buckets), coarser steps where sp does not divide an eighth, the power of two when sp
divides no step."""

import types

import pytest

from jvarlen.parallel.pipeline.prepare import chunk_buckets
from jvarlen.plan.chunk import executor_bucket, executor_bucket_below


def _plans(*chunk_tokens):
    return [types.SimpleNamespace(chunks=[[(0, 0, t)] for t in chunk_tokens])]


@pytest.mark.parametrize(
    "longest, sp, expected",
    [
        (700, 1, [768, 896, 1024]),
        (520, 2, [640, 768, 896, 1024]),
        (513, 1, [640, 768, 896, 1024]),
        (512, 1, [512]),
        (1024, 4, [1024]),
        (1100, 1, [1280, 1536, 1792, 2048]),
        (1600, 2, [1792, 2048]),
        (1400, 2, [1536, 1792, 2048]),
        (20, 1, [32]),
        (90, 32, [96, 128]),  # an eighth of 128 (16) is not divisible by sp = 32: quarters
        (700, 3, [1024]),  # no step of 1024 is divisible by sp = 3: power of two only
    ],
)
def test_bucket_candidates(longest, sp, expected):
    assert chunk_buckets(_plans(longest // 2, longest, longest // 3), sp) == expected
    # padding with the smallest candidate stays under an eighth of the power of two
    if sp in (1, 2, 4):
        assert expected[0] - longest < max(16, expected[-1] // 8)


def test_a_fixed_bucket_is_the_only_candidate():
    assert chunk_buckets(_plans(10), 1, fixed=32) == [32]


@pytest.mark.parametrize("sp", [1, 2, 3, 4, 8, 32])
def test_the_bucket_below_is_the_largest_bucket_at_most_the_tokens(sp):
    """``executor_bucket_below`` against every bucket the executor pads to (brute force)."""
    grid = sorted({executor_bucket(x, sp) for x in range(1, 1 << 14)})
    for tokens in range(1, 1 << 13):
        want = max((b for b in grid if b <= tokens), default=None)
        assert executor_bucket_below(tokens, sp) == want, tokens
