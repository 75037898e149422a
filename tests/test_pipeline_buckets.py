"""Chunk buckets of the pipeline path: quarter steps of the next power of two (less padding than
power-of-two buckets), falling back to the power of two when sp does not divide the step."""

import types

import pytest

from jvarlen.parallel.pipeline.prepare import chunk_buckets


def _plans(*chunk_tokens):
    return [types.SimpleNamespace(chunks=[[(0, 0, t)] for t in chunk_tokens])]


@pytest.mark.parametrize(
    "longest, sp, expected",
    [
        (700, 1, [768, 1024]),
        (520, 2, [768, 1024]),
        (513, 1, [768, 1024]),
        (512, 1, [512]),
        (1024, 4, [1024]),
        (1100, 1, [1536, 2048]),
        (1600, 2, [2048]),
        (1400, 2, [1536, 2048]),
        (20, 1, [32]),
        (700, 3, [1024]),  # 256-token steps are not divisible by sp = 3: power of two only
    ],
)
def test_bucket_candidates(longest, sp, expected):
    assert chunk_buckets(_plans(longest // 2, longest, longest // 3), sp) == expected
    # padding with the smallest candidate stays under a quarter of the power of two
    if sp in (1, 2, 4):
        assert expected[0] - longest < max(16, expected[-1] // 4)


def test_a_fixed_bucket_is_the_only_candidate():
    assert chunk_buckets(_plans(10), 1, fixed=32) == [32]
