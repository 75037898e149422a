"""FlexSP's memory-balanced chunking (App. A, Eq. 23-24) against brute force and a plain O(M·K²) DP."""

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jvarlen.plan.chunking import balanced_split, chunk_group, min_parts, split_max


def brute_min_max(tokens, m):
    k = len(tokens)
    return min(split_max(tokens, list(cuts) + [k]) for cuts in itertools.combinations(range(1, k), m - 1))


def plain_dp(tokens, m):
    """Eq. 24 literally: DP[k][i] = min_j max(DP[j][i-1], Σ_{j<l<=k} s_l)."""
    k_all = len(tokens)
    prefix = [0, *np.cumsum(tokens).tolist()]
    inf = float("inf")
    dp = [[inf] * (m + 1) for _ in range(k_all + 1)]
    dp[0][0] = 0
    for i in range(1, m + 1):
        for k in range(i, k_all + 1):
            dp[k][i] = min(max(dp[j][i - 1], prefix[k] - prefix[j]) for j in range(i - 1, k))
    return dp[k_all][m]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=9), st.data())
def test_balanced_split_is_optimal_against_brute_force(tokens, data):
    m = data.draw(st.integers(1, len(tokens)))
    ends = balanced_split(tokens, m)
    assert len(ends) == m and ends[-1] == len(tokens)
    assert all(a < b for a, b in zip([0, *ends[:-1]], ends)), "parts must be non-empty and consecutive"
    assert split_max(tokens, ends) == brute_min_max(tokens, m)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=9), st.integers(1, 200))
def test_min_parts_is_the_least_m_that_fits(tokens, cap):
    found = min_parts(tokens, cap)
    fitting = [m for m in range(1, len(tokens) + 1) if brute_min_max(tokens, m) <= cap]
    assert found == (min(fitting) if fitting else None)


def test_balanced_split_matches_the_plain_dp_on_long_inputs():
    rng = np.random.default_rng(0)
    for _ in range(20):
        tokens = rng.integers(1, 5000, size=int(rng.integers(20, 60))).tolist()
        for m in (1, 2, 5, 13, len(tokens)):
            assert split_max(tokens, balanced_split(tokens, m)) == plain_dp(tokens, m)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=12), st.integers(500, 4000), st.integers(1, 4))
def test_chunk_group_covers_every_document_once_within_the_cap(lengths, cap, min_batches):
    mbs = chunk_group(lengths, cap, min_batches)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    long = [i for i, n in enumerate(lengths) if n > cap]
    for mb in mbs:
        assert mb, "no empty micro-batch"
        tokens = sum(lengths[i] for i in mb)
        assert tokens <= cap or (len(mb) == 1 and mb[0] in long)
    rest = sorted((n for n in lengths if n <= cap), reverse=True)
    if rest:  # the fewest micro-batches that fit, unless min_batches asks for more
        fewest = min_parts(rest, cap) + len(long)
        assert len(mbs) == max(fewest, min(min_batches, len(lengths)))
    order = [i for mb in mbs for i in mb]
    assert [lengths[i] for i in order] == sorted(lengths, reverse=True), "length-sorted, longest first"
