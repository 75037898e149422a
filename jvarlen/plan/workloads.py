"""Document-length workloads for planning benchmarks.

* ``github``: matches the statistics InfiniPipe reports for GitHub (§1, Fig. 2):
  91.5 % of documents have ≤ 8K tokens, 0.6 % have > 64K and hold 21.6 % of all
  tokens. Shape between those anchors is our assumption: a truncated log-normal
  body on [32, 8K], log-uniform on (8K, 64K] and on (64K, 256K]; the body's
  median is solved so that the > 64K token share is 21.6 %.
* ``commoncrawl``: an assumed web-text shape (the papers give no numbers): 97 %
  ≤ 8K with a short body (median ≈ 600), 2.9 % in (8K, 64K], 0.1 % in (64K, 256K].
* ``stdlib``: the standard-library ``*.py`` files of Python 3.11.7, a snapshot shipped in
  ``stdlib_lengths.json`` (another Python's library differs, and with it every batch and result
  drawn from it); the byte tokenizer gives tokens = bytes + 2 (BOS, EOS).
  :func:`measure_stdlib_lengths` measures the running Python's.

Batches are sampled with a ``numpy.random.Generator`` (deterministic given the
seed) and truncated to the context length, as in InfiniPipe §5.1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import sysconfig
from functools import lru_cache

import numpy as np

_K = 1024


@dataclasses.dataclass(frozen=True)
class LengthMixture:
    """Three-band length distribution: truncated log-normal body, two log-uniform bands."""

    name: str
    body_weight: float
    body_median: float
    body_sigma: float
    body_range: tuple[int, int]
    mid_weight: float
    mid_range: tuple[int, int]
    tail_weight: float
    tail_range: tuple[int, int]

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``[n]`` int64 document lengths."""
        band = rng.choice(3, size=n, p=[self.body_weight, self.mid_weight, self.tail_weight])
        out = np.empty(n, dtype=np.float64)
        nb = int(np.sum(band == 0))
        out[band == 0] = _truncated_lognormal(nb, self.body_median, self.body_sigma, self.body_range, rng)
        for b, (lo, hi) in ((1, self.mid_range), (2, self.tail_range)):
            m = band == b
            out[m] = np.exp(rng.uniform(math.log(lo), math.log(hi), size=int(m.sum())))
        return np.clip(np.round(out), 1, None).astype(np.int64)


def _truncated_lognormal(n: int, median: float, sigma: float, rng_range: tuple[int, int], rng) -> np.ndarray:
    lo, hi = (math.log(x) for x in rng_range)
    out = np.empty(0)
    while out.size < n:  # rejection; the truncation keeps most of the mass
        x = rng.normal(math.log(median), sigma, size=2 * (n - out.size) + 16)
        out = np.concatenate([out, x[(x >= lo) & (x <= hi)]])
    return np.exp(out[:n])


GITHUB = LengthMixture(
    name="github",
    body_weight=0.915,
    body_median=570.0,
    body_sigma=1.2,
    body_range=(32, 8 * _K),
    mid_weight=0.079,
    mid_range=(8 * _K, 64 * _K),
    tail_weight=0.006,
    tail_range=(64 * _K, 256 * _K),
)
COMMONCRAWL = LengthMixture(
    name="commoncrawl",
    body_weight=0.970,
    body_median=600.0,
    body_sigma=1.0,
    body_range=(32, 8 * _K),
    mid_weight=0.029,
    mid_range=(8 * _K, 64 * _K),
    tail_weight=0.001,
    tail_range=(64 * _K, 256 * _K),
)
MIXTURES = {m.name: m for m in (GITHUB, COMMONCRAWL)}


SNAPSHOT = pathlib.Path(__file__).with_name("stdlib_lengths.json")


@lru_cache(maxsize=1)
def stdlib_lengths() -> tuple[int, ...]:
    """Token counts of the ``stdlib`` workload: the shipped snapshot of Python 3.11.7's library
    (:func:`measure_stdlib_lengths` there), the same on every machine."""
    with open(SNAPSHOT, encoding="utf-8") as f:
        return tuple(int(x) for x in json.load(f)["lengths"])


def measure_stdlib_lengths() -> tuple[int, ...]:
    """Token counts of the running Python's stdlib: bytes + 2 per ``*.py`` file (sorted paths, no
    site-packages)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for f in sorted(filenames):
            if f.endswith(".py"):
                size = os.path.getsize(os.path.join(dirpath, f))
                if size > 0:
                    out.append(size + 2)
    return tuple(out)


def sample_batch(workload: str, batch_size: int, context: int, seed: int = 0) -> list[int]:
    """``batch_size`` document lengths from ``workload``, truncated to ``context`` tokens."""
    rng = np.random.default_rng(seed)
    if workload == "stdlib":
        pool = np.asarray(stdlib_lengths())
        lengths = pool[rng.integers(0, pool.size, size=batch_size)]
    elif workload in MIXTURES:
        lengths = MIXTURES[workload].sample(batch_size, rng)
    else:
        raise ValueError(f"unknown workload {workload!r}; use one of {sorted(MIXTURES) + ['stdlib']}")
    return [int(x) for x in np.minimum(lengths, context)]


def statistics(lengths: np.ndarray) -> dict[str, float]:
    """The statistics InfiniPipe quotes: fraction ≤ 8K, fraction > 64K, token share of > 64K."""
    x = np.asarray(lengths, dtype=np.float64)
    return {
        "frac_le_8k": float(np.mean(x <= 8 * _K)),
        "frac_gt_64k": float(np.mean(x > 64 * _K)),
        "token_share_gt_64k": float(x[x > 64 * _K].sum() / x.sum()),
        "mean": float(x.mean()),
    }
