"""Workload library: the published GitHub statistics, stdlib lengths, seeded batches."""

import os
import sys
import sysconfig

import numpy as np

from jvarlen.plan.workloads import (
    COMMONCRAWL,
    GITHUB,
    measure_stdlib_lengths,
    sample_batch,
    statistics,
    stdlib_lengths,
)


def test_github_matches_infinipipe_statistics():
    # §1 / Fig. 2: 91.5 % of documents <= 8K tokens; 0.6 % > 64K holding 21.6 % of the tokens.
    x = GITHUB.sample(400_000, np.random.default_rng(0))
    s = statistics(x)
    assert abs(s["frac_le_8k"] - 0.915) < 0.003
    assert abs(s["frac_gt_64k"] - 0.006) < 0.0006
    assert abs(s["token_share_gt_64k"] - 0.216) < 0.015


def test_commoncrawl_is_shorter_than_github():
    a = statistics(COMMONCRAWL.sample(100_000, np.random.default_rng(1)))
    b = statistics(GITHUB.sample(100_000, np.random.default_rng(1)))
    assert a["mean"] < b["mean"] and a["frac_le_8k"] > b["frac_le_8k"]


def test_stdlib_lengths_are_file_sizes_plus_bos_eos():
    lengths = measure_stdlib_lengths()
    root = sysconfig.get_paths()["stdlib"]
    size = os.path.getsize(os.path.join(root, "os.py"))
    assert size + 2 in lengths
    assert len(lengths) > 500 and min(lengths) >= 3


def test_the_stdlib_workload_is_python_3_11_7s_library_on_every_python():
    """Benchmarks and tests draw batches from the snapshot, so another Python's library (3.12's
    differs) changes none of them; on 3.11.7 the snapshot is what the library measures."""
    snapshot = stdlib_lengths()
    assert len(snapshot) == 1762 and sum(snapshot) == 31_528_748
    if sys.version_info[:3] == (3, 11, 7):
        assert measure_stdlib_lengths() == snapshot


def test_batches_are_seeded_and_truncated():
    a = sample_batch("github", 512, 48 * 1024, seed=4)
    assert a == sample_batch("github", 512, 48 * 1024, seed=4)
    assert a != sample_batch("github", 512, 48 * 1024, seed=5)
    assert len(a) == 512 and max(a) <= 48 * 1024
    assert max(sample_batch("stdlib", 64, 1000, seed=0)) <= 1000
