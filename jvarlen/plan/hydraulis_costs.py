"""Hydraulis' per-scheme cost tables (App. B): ``T(l, P) = a·l² + b·l + c``, ``MaxLen(P)``, ``UtilLen(P)``.

Every Hydraulis solver (packing Eq. 1, dispatch Eq. 2-3, proposal Eq. 4) prices documents with
the same few numbers per scheme, evaluated on whole arrays of lengths at once; this module
derives them once per run from :class:`~jvarlen.plan.strategy.SchemeCosts` (the fitted cost
model) and caches them per ``SchemeCosts`` object.

* **Latency (App. B.2).** Hydraulis fits ``T(l, P_k) = a_k l² + b_k l + c_k`` to profiled
  points; we fit the same form by least squares (relative error) to ``SchemeCosts.T`` on a
  geometric grid of lengths. For an analytic profile the fit is exact (quadratic attention
  pairs, linear tokens, a per-chunk constant); for a measured profile with token buckets it is
  an approximation whose largest relative error is kept in ``fit_error``. A packed micro-batch
  of documents ``l_i`` costs ``a Σ l_i² + b Σ l_i + c`` (varlen attention, one GEMM, one
  constant per micro-batch), so the per-document work is ``w(l) = a l² + b l`` and ``c`` is
  charged once per micro-batch — Hydraulis' "sum of the latencies of the original sequences"
  (§6.1) without counting the launch constant once per packed document.
* **Recomputation.** One recomputed layer costs ``ra l² + rb l + rc`` (fitted the same way from
  ``CostModel.recompute_time``); a micro-batch of ``t`` tokens recomputes the least number of
  layers ``r(t)`` with which ``t ≤ caps[r]``.
* **Memory (App. B.1).** Activation memory is linear in the tokens, so ``caps[r]`` (tokens of
  one micro-batch with ``r`` recomputed layers per stage) is exact: stage ``p`` of a 1F1B
  pipeline holds ``pp - p`` micro-batches, each may take ``1 / (pp - p)`` of the stage's free
  memory (budget minus model states, the canonical fp32 state sharded over all devices) after
  the transients of the one backward in flight (``CostModel.backward_memory``: its working
  memory per token, and the layer gradients the executor's backward returns).
  ``MaxLen(P)`` is ``caps[L/pp]`` (full recomputation) or ``caps[0]`` (``recompute="none"``).
  Where the group plans are fitted to the executor's account (``"ticks"``, ``"paired"``), a
  micro-batch also needs its executor bucket within that account at the same recomputation (for
  ``pp > 1`` with the ``pp`` micro-batches 1F1B keeps in flight): ``MaxLen(P)`` is the longest that
  fits both at some ``r`` (:func:`~jvarlen.plan.executor_caps.admitted_caps`), and ``caps`` stop there.
* **Executor (κ).** Eq. 1 prices a pipeline as ``(PP - 1 + V)`` slowest micro-batches: the
  asynchronous 1F1B of the paper (``simulation="async"``, κ = 1). jvarlen's executor runs the
  stages in lock-step ticks; in the steady state a tick pairs one stage's forward with another
  stage's backward and lasts the backward, so a micro-batch costs about ``κ T`` with
  ``κ = 2 B / (F + B)`` (4/3 when the backward is twice the forward) and the pipeline
  ``(PP - 1 + κ V)`` slowest micro-batches (``simulation="ticks"``, pp > 1; measured on uniform
  micro-batches: 1.27-1.29 per micro-batch). Every solver charges a pipeline's micro-batches κ times
  (:mod:`jvarlen.plan.hydraulis_pack`, :mod:`jvarlen.plan.hydraulis_dispatch`, the proposal).
  The executor's own model (``simulation="paired"``, the default) runs a backward and a forward
  per stage and tick, κ = 1, but pads every micro-batch of a group's step to one bucket, which
  ``T(l, P)`` leaves out: only the simulation of the finalists charges it.
* **UtilLen (App. C).** The shortest micro-batch whose GEMM part runs at ``util_threshold`` of
  its asymptotic efficiency: ``b l / (b l + c) ≥ θ``, i.e. ``l ≥ θ c / ((1 - θ) b)``. (Our
  throughput curve ``l / T(l)`` peaks and then falls because of the quadratic term, so the
  attention-free part is the curve App. C's Fig. 16a measures.)

Pure numpy: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Sequence

import numpy as np

from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.executor_caps import admitted_caps
from jvarlen.plan.strategy import Scheme, SchemeCosts

_FIT_MIN = 16  # shortest length of the fitting grid (tokens)


@dataclasses.dataclass(frozen=True)
class SchemeTable:
    """Cost numbers of one scheme ``P`` (seconds, tokens). ``caps [L/pp + 1]`` increasing."""

    scheme: Scheme
    a: float
    b: float
    c: float
    ra: float
    rb: float
    rc: float
    caps: np.ndarray
    max_len: int
    util_len: int
    overhead_s: float  # the group's step overhead (CostModel.step_overhead: optimizer update + its stage's sync)
    fit_error: float  # largest relative error of the T(l, P) fit on its grid
    steady: float = 1.0  # κ: time per micro-batch in the pipeline's steady state, in units of T

    @property
    def pp(self) -> int:
        return self.scheme.pp

    @property
    def cap0(self) -> int:
        """Tokens of one micro-batch without recomputation (the packing capacity of Eq. 1)."""
        return int(self.caps[0])

    # ---- vectorised prices (``lengths`` any int/float array)
    def work(self, lengths) -> np.ndarray:
        """``w(l) = a l² + b l``: a document's share of a micro-batch's time (no constant)."""
        x = np.asarray(lengths, dtype=np.float64)
        return (self.a * x + self.b) * x

    def T(self, lengths) -> np.ndarray:
        """App. B.2 ``T(l, P)``: one stage's forward + backward of a micro-batch holding one document."""
        return self.work(lengths) + self.c

    def recompute_layers(self, tokens) -> np.ndarray:
        """Least recomputed layers per stage for a micro-batch of ``tokens`` (``len(caps)`` = does not fit)."""
        return np.searchsorted(self.caps, np.asarray(tokens), side="left")

    def recompute_s(self, sum_sq, tokens, layers) -> np.ndarray:
        """Seconds of recomputing ``layers`` layers of a micro-batch with Σl² = ``sum_sq``, Σl = ``tokens``."""
        sum_sq, tokens = np.asarray(sum_sq, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
        return np.asarray(layers) * (self.ra * sum_sq + self.rb * tokens + self.rc)

    def micro_batch_time(self, sum_sq, tokens) -> np.ndarray:
        """One stage's time of a packed micro-batch (with the recomputation its tokens need; inf when
        it does not fit at all)."""
        sum_sq, tokens = np.asarray(sum_sq, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
        layers = self.recompute_layers(tokens)
        t = self.a * sum_sq + self.b * tokens + self.c + self.recompute_s(sum_sq, tokens, layers)
        return np.where(layers < len(self.caps), t, np.inf)

    def doc_work(self, lengths) -> np.ndarray:
        """``w(l)`` plus the recomputation a document needs on its own (inf above ``max_len``)."""
        x = np.asarray(lengths, dtype=np.float64)
        return self.micro_batch_time(x * x, x) - self.c

    def doc_time(self, lengths) -> np.ndarray:
        """``T(l, P)`` with the recomputation the document needs alone (inf above ``max_len``)."""
        return self.doc_work(lengths) + self.c


def _fit_quadratic(xs: np.ndarray, ys: np.ndarray) -> tuple[float, float, float, float]:
    """Least squares of ``a x² + b x + c`` in relative error, coefficients clipped at 0; returns
    ``(a, b, c, max relative error)``."""
    if not np.any(ys > 0):
        return 0.0, 0.0, 0.0, 0.0
    scale = 1.0 / np.maximum(ys, 1e-30)
    design = np.stack([xs * xs, xs, np.ones_like(xs)], axis=1) * scale[:, None]
    coef, *_ = np.linalg.lstsq(design, ys * scale, rcond=None)
    coef = np.maximum(coef, 0.0)
    pred = (coef[0] * xs + coef[1]) * xs + coef[2]
    err = float(np.max(np.abs(pred - ys) * scale))
    return float(coef[0]), float(coef[1]), float(coef[2]), err


def build_table(
    costs: SchemeCosts,
    scheme: Scheme,
    recompute: bool = True,
    util_threshold: float = 0.85,
    simulation: str = "async",
):
    """The :class:`SchemeTable` of ``scheme`` under ``costs`` (see the module docstring)."""
    cost = costs.cost(scheme)
    pp, lps = scheme.pp, cost.layers_per_stage
    # Memory: bytes per token with r recomputed layers, per stage; 1F1B keeps pp - p micro-batches on stage p.
    caps = np.zeros(lps + 1, dtype=np.int64)
    for r in range(lps + 1):
        best = None
        for p in range(pp):
            lines = cost.chunk_memory_lines(p, r, in_flight=pp - p, tail=True)
            n = cost.fitting_tokens(cost.memory_budget - cost.memory_floor(p), lines)
            best = n if best is None else min(best, n)
        caps[r] = best
    caps = np.maximum.accumulate(caps)  # more recomputation never holds fewer tokens
    top = int(caps[-1] if recompute else caps[0])
    grid = np.unique(np.geomspace(_FIT_MIN, max(4 * _FIT_MIN, top if top > 0 else 65536), 24).astype(np.int64))
    ys = np.array([costs.T(int(x), scheme) for x in grid])
    a, b, c, err = _fit_quadratic(grid.astype(np.float64), ys)
    if lps > 0:
        rys = np.array([cost.recompute_time(ChunkShape(0, (int(x),)), 1) for x in grid])
        ra, rb, rc, _ = _fit_quadratic(grid.astype(np.float64), rys)
    else:
        ra = rb = rc = 0.0
    theta = float(util_threshold)
    util = int(np.ceil(theta * c / ((1.0 - theta) * b))) if b > 0 and 0 < theta < 1 else 1
    if not recompute:
        caps = caps[:1]
    max_len = top
    if simulation in ("ticks", "paired"):
        # the executor pads a step's micro-batches to a bucket, and its account of the step must
        # hold that bucket at the recomputation the time line's cap assumes
        max_len = int(admitted_caps(costs, scheme, caps).max())
        caps = np.minimum(caps, max_len)
    steady = 1.0
    if simulation == "ticks" and pp > 1:
        # lock-step 1F1B: a steady-state tick pairs one stage's forward with another's backward and
        # lasts the backward, so each micro-batch costs two backward ticks: κ = 2 B / (F + B)
        probe_chunk = ChunkShape(0, (int(max(1, min(top, 4096))),))
        fwd, bwd = cost.fwd_time(probe_chunk, pp - 1), cost.bwd_time(probe_chunk, pp - 1)
        steady = float(np.clip(2 * bwd / (fwd + bwd), 1.0, 2.0)) if fwd + bwd > 0 else 1.0
    return SchemeTable(
        scheme=scheme,
        a=a,
        b=b,
        c=c,
        ra=ra,
        rb=rb,
        rc=rc,
        caps=caps,
        max_len=int(max_len),
        util_len=max(1, util),
        overhead_s=float(cost.step_overhead()),
        fit_error=err,
        steady=steady,
    )


_CACHE: "weakref.WeakKeyDictionary[SchemeCosts, dict]" = weakref.WeakKeyDictionary()


def scheme_tables(
    costs: SchemeCosts,
    schemes: Sequence[Scheme],
    recompute: bool = True,
    util_threshold: float = 0.85,
    simulation: str = "async",
) -> dict[Scheme, SchemeTable]:
    """``{scheme: SchemeTable}``, cached per ``costs`` object (built once per run)."""
    cache = _CACHE.setdefault(costs, {})
    out = {}
    for s in schemes:
        key = (s, bool(recompute), float(util_threshold), simulation)
        if key not in cache:
            cache[key] = build_table(costs, s, recompute, util_threshold, simulation)
        out[s] = cache[key]
    return out


__all__ = ["SchemeTable", "build_table", "scheme_tables"]
