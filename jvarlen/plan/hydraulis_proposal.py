"""Data distribution-aware strategy proposal (Hydraulis §7, Eq. 4), run once per corpus and cached.

Problem 1: for every length ``L ≤ L_max``, the strategy ``S[N][L]`` that processes all corpus
documents of length ≤ L fastest on N devices, under the DP's simplification that each group
of ``d`` pipelines of one scheme ``P_k`` takes a contiguous length interval ``(l - l', l]`` and
needs ``(1/d) Σ_x T(x, P_k)`` for it (Eq. 4)::

    t[n][l] = min( t[n-1][l],  min_{k, d, l'} max( t[n - d·N(P_k)][l - l'],  (1/d) Σ_{x ∈ (l-l', l]} T(x, P_k) ) )
    subject to MaxLen(P_k) ≥ l.

**How we solve it.** ``t[n][l] ≤ τ`` iff some choice ``(k, d, l')`` has ``S/d ≤ τ`` and
``t[n - d N_k][l - l'] ≤ τ``; so with ``g_τ[l]`` = the fewest devices that process ``(0, l]``
within τ, ``g_τ[l] = min_{k, l'} g_τ[l - l'] + N_k · ⌈S_k(l - l', l] / τ⌉_δ`` (``d`` rounded
up to the step δ) and ``t[N][L] = min{τ : g_τ[L] ≤ N}``. ``g_τ`` is a shortest path over the
length grid (``O(K · bins²)``), vectorised over a batch of τ values, and τ is found by
bisection for every L at once (``rounds``, default 20: each ``S[N][L]`` is feasible and within
~1e-5 of its optimum). This is Eq. 4 exactly (on the same grid), with ``O(K·bins²·rounds)``
work instead of ``O(K·N²·L²)`` (``tests/test_hydraulis_proposal.py`` checks it against an
enumeration of every split of the bins into intervals and every (scheme, d) of each interval).

**Per-iteration terms** (``pipeline_term``, default on): an interval's latency becomes
``max(scale · κ S / d, κ T(u)) + T(u) · (PP − 1)`` with ``u`` its longest document, ``scale``
the iteration's share of the corpus ≤ L (tokens per iteration / corpus tokens) and κ the
executor's steady-state factor (:mod:`jvarlen.plan.hydraulis_costs`): Eq. 2's pipeline term
and the fact that one document runs on one pipeline. Plain Eq. 4 (corpus totals only) proposed
strategies whose few pipelines for the long documents were dominated by one document's
``T · (PP − 1)``. The same threshold form applies (``d ≥ scale · κ S / (τ − extra)``).

* **Integer DP** (δ = 1): the strategies ``S[N][L]`` are integer. **Continuous relaxation**
  (δ = ``relax_step``, the paper's 0.1): a pipeline may serve several intervals; the resulting
  real ``d_k`` are rounded down/up per scheme (every combination within N devices, at least
  one pipeline that holds the longest document) and the devices left over are filled with
  more pipelines of the solution's schemes, largest rounding deficit first (§7 "round and
  adjust"). Both sets are proposed.
* **Length grid.** Geometric, ``bins_per_octave`` (6) bins per doubling from 128 tokens, edges
  rounded up to multiples of 128 (the paper's step 128 at the short end; 12 %-wide bins at the
  long end, where a step of 128 would give hundreds of bins whose neighbours differ by < 1 % in
  T: 38 bins for a 32K context, 50 for 128K). Empty bins are dropped; a bin's upper end is its
  longest document.
* ``T`` here is ``w(x, P) + c · x / caps[0]``: a document's work plus its share of a packed
  micro-batch's constant (the corpus is packed; charging ``c`` per document would favour
  schemes with a small constant on short documents).
* **Step overhead.** Eq. 4 ignores the per-iteration pull/push of the parameters and gradients,
  which each group pays in its step overhead and which grows with its stage (the smallest ``pp``). With ``by_min_pp`` the DP runs once per
  ``q`` on the schemes with ``pp ≥ q`` and the union is proposed; the per-iteration selection
  then prices every group's overhead exactly.
* **How many.** Candidates are kept by the probability that an iteration's longest document
  falls in the length bin that produced them (``P(max ≤ u) = F(u)^B``, B documents per
  iteration), best first, at most ``max_candidates``.
* **Cost.** On 100K documents, 64 devices, 21 schemes: 1.1-1.2 s of one core (bench timing).

Pure numpy: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
from typing import Optional, Sequence

import numpy as np

from jvarlen.plan.hydraulis_costs import SchemeTable, scheme_tables
from jvarlen.plan.hydraulis_options import AssignmentOptions, scheme_space
from jvarlen.plan.json_file import write_json
from jvarlen.plan.strategy import Scheme, SchemeCosts

Strategy = tuple[Scheme, ...]
_ROUNDS = 40


@dataclasses.dataclass(frozen=True)
class ProposalOptions:
    """Knobs of :func:`propose_strategies`."""

    bins_per_octave: int = 6
    min_bin: int = 128
    relax_step: float = 0.1  # δ of the continuous relaxation (§7 footnote 4: 0.1)
    integer: bool = True  # also propose the integer DP's strategies
    relaxed: bool = True  # also propose the rounded relaxed strategies
    by_min_pp: bool = True  # one DP per smallest pp (transition-aware)
    max_candidates: int = 24
    tokens_per_iteration: int = 200_000  # for the batch-maximum weights
    fill: bool = True  # fill left-over devices after rounding
    pipeline_term: bool = True  # an interval's latency + T(longest)·(PP - 1) (Eq. 2's term); False: Eq. 4 as is
    rounds: int = 20  # bisection rounds on τ (relative precision ~ln(hi/lo)/2^rounds, ~1e-5)


# ---------------------------------------------------------------- grid and data


def length_edges(max_len: int, bins_per_octave: int = 6, min_bin: int = 128) -> np.ndarray:
    """Upper bin edges (tokens), increasing, the last one ``max_len``."""
    n = max(1, math.ceil(bins_per_octave * math.log2(max(max_len, min_bin) / min_bin)))
    raw = min_bin * 2.0 ** (np.arange(n + 1) / bins_per_octave)
    edges = np.unique(np.minimum(np.ceil(raw / 128.0) * 128, max_len).astype(np.int64))
    return edges if edges[-1] == max_len else np.append(edges, max_len)


@dataclasses.dataclass(frozen=True)
class BinnedData:
    """Nonempty length bins: ``upper [nb]`` longest document per bin, ``count [nb]``, ``tokens [nb]``;
    ``cost [K, nb]`` Σ T(x, P_k) over the bin's documents and ``top [K, nb]`` T(upper, P_k) (both inf
    where the bin's longest document exceeds MaxLen(P_k))."""

    upper: np.ndarray
    count: np.ndarray
    tokens: np.ndarray
    cost: np.ndarray
    top: np.ndarray


def bin_corpus(lengths: np.ndarray, tables: Sequence[SchemeTable], edges: np.ndarray) -> BinnedData:
    lengths = np.asarray(lengths, dtype=np.int64)
    which = np.searchsorted(edges, lengths, side="left")
    nonempty = np.unique(which)
    pos = np.searchsorted(nonempty, which)
    upper = np.zeros(nonempty.size, dtype=np.int64)
    np.maximum.at(upper, pos, lengths)
    count = np.bincount(pos, minlength=nonempty.size)
    tokens = np.bincount(pos, weights=lengths, minlength=nonempty.size)
    cost = np.zeros((len(tables), nonempty.size))
    top = np.zeros((len(tables), nonempty.size))
    for k, t in enumerate(tables):
        per_doc = t.doc_work(lengths) + t.c * lengths / max(1, t.cap0)
        cost[k] = np.bincount(pos, weights=np.where(np.isfinite(per_doc), per_doc, 0.0), minlength=nonempty.size)
        cost[k, upper > t.max_len] = np.inf
        top[k] = t.doc_time(upper)
    return BinnedData(upper, count, tokens, cost, top)


# ---------------------------------------------------------------- Eq. 4 in threshold form


@dataclasses.dataclass(frozen=True)
class DPProblem:
    """Eq. 4 on a grid of ``nb`` bins and ``K`` schemes.

    ``intervals [K, nb + 1, nb + 1]``: Σ T over bins (a, b] (inf unless a < b and P_k holds bin b);
    ``devices [K]``: N(P_k); ``scale [nb + 1]``: factor on the interval sums of the problem whose
    longest bin is b (1 for the paper's corpus-level Eq. 4); ``extra [K, nb + 1]``: latency added to
    an interval ending at bin b (0 in Eq. 4; ``T(u_b)·(PP − 1)``, Eq. 2's pipeline term, with
    ``pipeline_term``); ``floor [K, nb + 1]``: the least latency of that interval's pipeline
    (``T(u_b)``: its longest document runs on one pipeline).

    Latency of bins (a, b] on d pipelines of P_k: ``max(scale·S/d, floor) + extra``.
    """

    intervals: np.ndarray
    devices: np.ndarray
    scale: np.ndarray
    extra: np.ndarray
    floor: np.ndarray

    @classmethod
    def build(
        cls,
        data: BinnedData,
        devices: Sequence[int],
        scale=None,
        pipelines: Optional[Sequence[int]] = None,
        steady: Optional[Sequence[float]] = None,
    ):
        """``scale``: per-bin factors (None: 1). ``pipelines``: the PP of each scheme to charge Eq. 2's
        pipeline term (None: plain Eq. 4). ``steady``: the executor's κ per scheme (None: 1), a
        factor on the interval sums and on the floor."""
        K, nb = data.cost.shape
        kappa = np.ones(K) if steady is None else np.asarray(steady, np.float64)
        finite = np.where(np.isfinite(data.cost), data.cost, 0.0) * kappa[:, None]
        prefix = np.concatenate([np.zeros((K, 1)), np.cumsum(finite, axis=1)], axis=1)
        s = prefix[:, None, :] - prefix[:, :, None]  # [K, a, b]
        ok = np.concatenate([np.zeros((K, 1), bool), np.isfinite(data.cost)], axis=1)[:, None, :]
        a_idx, b_idx = np.arange(nb + 1)[:, None], np.arange(nb + 1)[None, :]
        intervals = np.where(ok & (a_idx < b_idx)[None], s, np.inf)
        top = np.concatenate([np.zeros((K, 1)), np.where(np.isfinite(data.top), data.top, np.inf)], axis=1)
        if pipelines is None:
            extra, floor = np.zeros((K, nb + 1)), np.zeros((K, nb + 1))
        else:
            single = np.where(np.isfinite(top), top, 0.0)
            floor = single * kappa[:, None]
            extra = single * (np.asarray(pipelines, np.float64)[:, None] - 1)
        scale = np.ones(nb + 1) if scale is None else np.concatenate([[1.0], np.asarray(scale, np.float64)])
        return cls(intervals, np.asarray(devices, np.float64), scale, extra, floor)

    @property
    def nb(self) -> int:
        return self.intervals.shape[1] - 1

    def pipelines(self, k, a, b, tau, rows, step: float) -> np.ndarray:
        """``d = ⌈scale·S / (τ − extra)⌉_δ`` for intervals (a, b] of schemes k at thresholds ``tau``
        (rows of the problem's scale); inf where the latency cannot get below τ."""
        room = tau - self.extra[k, b]
        need = self.scale[rows] * self.intervals[k, a, b]
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.ceil(need / (room * step) * (1 - 1e-12)) * step
        d = np.maximum(d, step)
        return np.where((room >= self.floor[k, b] * (1 - 1e-12)) & (room > 0) & np.isfinite(need), d, np.inf)


def min_devices(problem: DPProblem, tau: np.ndarray, rows: np.ndarray, step: float, upto: Optional[int] = None):
    """``g [T, nb + 1]``: fewest devices processing bins (0, b] within ``tau [T]`` (Eq. 4's threshold
    form; row t uses the scale of ``rows[t]``), plus the argmin ``(k, a) [T, nb + 1, 2]``."""
    nb = problem.nb if upto is None else upto
    K = problem.devices.size
    T = tau.shape[0]
    g = np.full((T, nb + 1), np.inf)
    g[:, 0] = 0.0
    arg = np.zeros((T, nb + 1, 2), dtype=np.int64)
    kk = np.arange(K)[None, :, None]
    for b in range(1, nb + 1):
        aa = np.arange(b)[None, None, :]
        d = problem.pipelines(kk, aa, b, tau[:, None, None], rows[:, None, None], step)  # [T, K, b]
        total = g[:, None, :b] + problem.devices[None, :, None] * d
        flat = total.reshape(T, -1)
        j = flat.argmin(axis=1)
        g[:, b] = flat[np.arange(T), j]
        arg[:, b, 0], arg[:, b, 1] = np.divmod(j, b)
    return g, arg


def solve_thresholds(problem: DPProblem, n: float, step: float, rounds: int = _ROUNDS) -> np.ndarray:
    """``τ [nb + 1]``: ``t[N][b]`` of Eq. 4 for every prefix of bins (inf when nothing fits), by
    bisection on τ (in log space, ``rounds`` halvings of the bracket) for all prefixes at once; each
    value is feasible and within ``ln(hi / lo) / 2^rounds`` (relative) of the optimum."""
    nb = problem.nb
    b_all = np.arange(nb + 1)
    devices = problem.devices
    most = np.floor(n / devices / step + 1e-9) * step  # pipelines of scheme k alone
    # hi: everything up to b on the pipelines of one scheme; lo: τ ≥ cheapest device-seconds / n
    with np.errstate(divide="ignore", invalid="ignore"):
        lat = np.maximum(problem.scale[None, :] * problem.intervals[:, 0, :] / most[:, None], problem.floor)
        hi = np.min(np.where(most[:, None] > 0, lat + problem.extra, np.inf), axis=0)
    per_bin = np.array([np.min(devices * problem.intervals[:, b - 1, b]) for b in range(1, nb + 1)])
    lo = np.concatenate([[0.0], np.cumsum(per_bin)]) * problem.scale / n * (1 - 1e-9)
    ok = np.isfinite(hi) & (b_all > 0)
    tau = np.where(ok, hi, np.inf)
    tau[0] = 0.0
    idx = np.flatnonzero(ok)
    if idx.size == 0:
        return tau
    lo_i, hi_i = np.maximum(lo[idx], hi[idx] * 1e-12), hi[idx].copy()
    for _ in range(rounds):
        mid = np.sqrt(lo_i * hi_i)
        g, _ = min_devices(problem, mid, idx, step, upto=int(idx.max()))
        feasible = g[np.arange(idx.size), idx] <= n + 1e-9
        hi_i = np.where(feasible, mid, hi_i)
        lo_i = np.where(feasible, lo_i, mid)
    tau[idx] = hi_i
    return tau


def extract_strategy(problem: DPProblem, tau: float, b: int, step: float) -> list[tuple[int, int, int, float]]:
    """The intervals of ``S[N][b]`` at threshold ``tau``: ``[(k, a, b, d)]`` (bins (a, b] on d pipelines of P_k)."""
    rows = np.array([b])
    g, arg = min_devices(problem, np.array([float(tau)]), rows, step, upto=b)
    out = []
    top = b
    while b > 0:
        k, a = (int(x) for x in arg[0, b])
        out.append((k, a, b, float(problem.pipelines(k, a, b, float(tau), top, step))))
        b = a
    return out[::-1]


# ---------------------------------------------------------------- rounding (§7) and assembly


def round_counts(
    real: dict[int, float], devices: np.ndarray, n: int, must: int, fill: bool = True
) -> list[dict[int, int]]:
    """Integer neighbours of the relaxed counts ``{k: d_k}`` within ``n`` devices, each with at least
    one pipeline of scheme ``must``; left-over devices filled (largest deficit first) when ``fill``."""
    keys = sorted(real)
    options = [sorted({math.floor(real[k] + 1e-9), math.ceil(real[k] - 1e-9)}) for k in keys]
    out = []
    for combo in itertools.product(*options):
        counts = {k: int(c) for k, c in zip(keys, combo) if c > 0}
        if counts.get(must, 0) < 1:
            counts[must] = 1
        used = sum(devices[k] * c for k, c in counts.items())
        if used > n:
            continue
        if fill:
            while True:
                fits = [k for k in keys if devices[k] <= n - used]
                if not fits:
                    break
                k = max(fits, key=lambda k: (real[k] - counts.get(k, 0), -devices[k], -k))
                counts[k] = counts.get(k, 0) + 1
                used += devices[k]
        if counts not in out:
            out.append(counts)
    return out


def _strategy(counts: dict[int, int], schemes: Sequence[Scheme], tables: Sequence[SchemeTable]) -> Strategy:
    pipes = [schemes[k] for k, c in counts.items() for _ in range(int(c))]
    by = {s: t for s, t in zip(schemes, tables)}
    return tuple(sorted(pipes, key=lambda s: (-by[s].max_len, -s.num_devices, s.pp, s.sp)))


def canonical(strategy: Sequence[Scheme], tables: dict) -> Strategy:
    """A strategy as a tuple of schemes, largest MaxLen first (ties: more devices, then pp, sp)."""
    return tuple(sorted(strategy, key=lambda s: (-tables[s].max_len, -s.num_devices, s.pp, s.sp)))


def propose_strategies(
    corpus_lengths: Sequence[int],
    costs: SchemeCosts,
    max_len: int,
    options=None,
    schemes: Optional[Sequence[Scheme]] = None,
) -> tuple[Strategy, ...]:
    """Hydraulis' candidate set Ŝ (§7) for the corpus ``corpus_lengths`` (truncated to ``max_len``)
    on ``costs.num_devices`` devices. ``options``: :class:`ProposalOptions`, or a
    :class:`~jvarlen.plan.hydraulis.HydraulisOptions` (its ``proposal``, schemes and recomputation)."""
    hopts = options if isinstance(options, AssignmentOptions) else AssignmentOptions()
    popts = options if isinstance(options, ProposalOptions) else getattr(hopts, "proposal", ProposalOptions())
    schemes = list(schemes if schemes is not None else scheme_space(costs, hopts))
    table_of = scheme_tables(costs, schemes, hopts.recompute == "auto", hopts.util_threshold, hopts.simulation)
    schemes = [s for s in schemes if table_of[s].max_len > 0]
    n = costs.num_devices
    lengths = np.minimum(np.asarray(corpus_lengths, dtype=np.int64), int(max_len))
    lengths = lengths[lengths > 0]
    if lengths.size == 0 or not schemes:
        return ()
    edges = length_edges(int(max_len), popts.bins_per_octave, popts.min_bin)
    pps = sorted({s.pp for s in schemes}) if popts.by_min_pp else [min(s.pp for s in schemes)]
    # weight of each bin: probability that an iteration's longest document falls in it
    full = bin_corpus(lengths, [table_of[s] for s in schemes], edges)
    docs_per_iter = max(1.0, popts.tokens_per_iteration / float(lengths.mean()))
    cdf = np.cumsum(full.count) / full.count.sum()
    weight = np.diff(np.concatenate([[0.0], cdf**docs_per_iter]))
    scored: dict[Strategy, tuple[float, int, float]] = {}
    for q in pps:
        sub = [s for s in schemes if s.pp >= q]
        tables = [table_of[s] for s in sub]
        data = bin_corpus(lengths, tables, edges)
        devices = np.array([s.num_devices for s in sub], dtype=np.float64)
        trans = costs.cost(min(sub, key=lambda s: s.pp)).step_overhead()  # the largest stage's sync
        # one iteration's worth of the documents ≤ L (Eq. 4 itself works on the whole corpus: scale 1)
        scale = popts.tokens_per_iteration / np.maximum(np.cumsum(data.tokens), 1.0)
        if popts.pipeline_term:
            problem = DPProblem.build(data, devices, scale, [s.pp for s in sub], [t.steady for t in tables])
        else:
            problem = DPProblem.build(data, devices, scale)
        steps = ([1.0] if popts.integer else []) + ([popts.relax_step] if popts.relaxed else [])
        for step in steps:
            taus = solve_thresholds(problem, float(n), step, popts.rounds)
            for b in range(1, data.upper.size + 1):
                if not np.isfinite(taus[b]):
                    continue
                parts = extract_strategy(problem, float(taus[b]), b, step)
                real: dict[int, float] = {}
                for k, _, _, d in parts:
                    real[k] = real.get(k, 0.0) + d
                top = parts[-1][0]
                if step == 1.0:
                    variants = [{k: int(round(d)) for k, d in real.items()}]
                else:
                    variants = round_counts(real, devices.astype(np.int64), n, top, popts.fill)
                score = float(taus[b] + trans)
                w = float(weight[b - 1])
                for rank, counts in enumerate(variants):
                    strat = _strategy(counts, sub, tables)
                    old = scored.get(strat)
                    new = (old[0] if old else 0.0) + w, rank, min(score, old[2] if old else math.inf)
                    scored[strat] = (new[0], min(rank, old[1]) if old else rank, new[2])
    ranked = sorted(scored.items(), key=lambda kv: (-kv[1][0], kv[1][1], kv[1][2], _key(kv[0])))
    return tuple(s for s, _ in ranked[: popts.max_candidates])


def _key(strategy: Strategy) -> tuple:
    return tuple((s.pp, s.sp) for s in strategy)


# ---------------------------------------------------------------- cache


PROPOSAL_VERSION = 6  # raise when propose_strategies would propose differently for the same inputs


def proposal_key(corpus_lengths: Sequence[int], costs: SchemeCosts, max_len: int, options) -> str:
    """Hash of (lengths, model + coefficients, the memory model's stage weights and padding, device
    count, max_len, options): sharded stage weights change every scheme's MaxLen(P), so a run with
    the other setting must not reuse the candidates."""
    h = hashlib.sha256(f"proposal v{PROPOSAL_VERSION}|".encode())  # a new version of the search misses old files
    h.update(np.asarray(corpus_lengths, dtype=np.int64).tobytes())
    h.update(costs.base.fingerprint().encode())
    h.update(f"{costs.num_devices}|{int(max_len)}|{options!r}".encode())
    return h.hexdigest()[:24]


def cached_proposal(
    cache_dir: str | os.PathLike,
    corpus_lengths: Sequence[int],
    costs: SchemeCosts,
    max_len: int,
    options=None,
) -> tuple[Strategy, ...]:
    """:func:`propose_strategies`, stored as JSON under ``cache_dir`` by :func:`proposal_key`."""
    key = proposal_key(corpus_lengths, costs, max_len, options)
    path = os.path.join(cache_dir, f"hydraulis-proposal-{key}.json")
    try:
        with open(path) as f:
            data = json.load(f)
        return tuple(tuple(Scheme(int(pp), int(sp)) for pp, sp in s) for s in data["strategies"])
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: propose again
        pass
    out = propose_strategies(corpus_lengths, costs, max_len, options)
    write_json(path, {"key": key, "strategies": [[[s.pp, s.sp] for s in st] for st in out]}, indent=None)
    return out


__all__ = [
    "BinnedData",
    "DPProblem",
    "ProposalOptions",
    "bin_corpus",
    "cached_proposal",
    "canonical",
    "extract_strategy",
    "length_edges",
    "min_devices",
    "propose_strategies",
    "proposal_key",
    "round_counts",
    "solve_thresholds",
]
