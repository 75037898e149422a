"""Least-squares fitting of cost coefficients from the profiler's measurements.

* :func:`fit_layer_time`: Eq. 1 coefficients of one layer from timed chunks (non-negative,
  relative-error weighted least squares).
* :func:`fit_link`: Eq. 2 bandwidth and latency from timed transfers.
* :func:`fit_linear`: slope and intercept (memory per token, constant memory).
* The training loop's online refit is :class:`jvarlen.plan.online_refit.OnlineRefit`.
* Profiler reports (``jvarlen.profile``): :func:`fit_layer_programs` (dual-layer
  program times), :func:`fit_time_terms` (all time coefficients of one Ulysses degree); the
  memory grid's fit is :func:`jvarlen.profile.measure.fit_memory`.

Pure numpy/scipy.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np
from scipy.optimize import nnls

from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, CostModel, LayerTime, Link, ModelShape


def _nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min Σ ((x θ - y) / y)² subject to θ ≥ 0."""
    y = np.asarray(y, float)
    if np.any(y <= 0):
        raise ValueError("measured values must be positive")
    w = 1.0 / y
    scale = np.abs(x * w[:, None]).max(axis=0)
    scale[scale == 0] = 1.0
    theta, _ = nnls(x * w[:, None] / scale, np.ones_like(y))
    return theta / scale


def fit_layer_time(pairs: Sequence[float], tokens: Sequence[float], times: Sequence[float], sp: int = 1) -> LayerTime:
    """Fits ``time ≈ (alpha1·pairs + alpha2·tokens)/sp + beta1`` (Eq. 1, one layer) with θ ≥ 0.

    ``pairs`` is ``ChunkShape.attention_pairs`` (the quadratic term (C+s0)² − C² + Σ s²).
    """
    pairs, tokens = np.asarray(pairs, float), np.asarray(tokens, float)
    x = np.stack([pairs / sp, tokens / sp, np.ones_like(pairs)], axis=1)
    a1, a2, b1 = _nnls_relative(x, np.asarray(times, float))
    return LayerTime(float(a1), float(a2), float(b1))


def fit_link(nbytes: Sequence[float], times: Sequence[float]) -> Link:
    """Fits Eq. 2 ``time ≈ bytes / bandwidth + latency`` with both terms ≥ 0."""
    nbytes = np.asarray(nbytes, float)
    x = np.stack([nbytes, np.ones_like(nbytes)], axis=1)
    inv_bw, lat = _nnls_relative(x, np.asarray(times, float))
    return Link(float("inf") if inv_bw <= 0 else 1.0 / inv_bw, float(lat))


def fit_linear(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Ordinary least squares ``y ≈ slope·x + intercept`` (memory per token + constant)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    a = np.stack([x, np.ones_like(x)], axis=1)
    (slope, intercept), *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(slope), float(intercept)


# the executor's own costs in the lock-step simulation, fitted on executor steps
EXECUTOR_TERMS = ("tick_overhead", "tick_token_overhead", "tick_context_overhead", "tick_recompute_factor")


def tick_overhead_terms(schedule, chunk_shapes, ckpt_layers, cost: CostModel, mode: str = "paired"):
    """(simulated s without the executor terms, then the simulator's derivative in each of
    :data:`EXECUTOR_TERMS`: ticks on the critical path, the same ticks x the step's token bucket,
    x its context bucket, and the forward seconds of the layers it recomputes) of one plan. Finite
    differences of the simulator itself, so they count exactly what the simulator charges (buckets
    included, none in the single-op ``"ticks"`` model)."""
    from jvarlen.plan.simulator import simulate

    def time(**overhead) -> float:
        coeffs = cost.coeffs.replace(**{**dict.fromkeys(EXECUTOR_TERMS, 0.0), **overhead})
        model = cost.replace(coeffs=coeffs)
        return simulate(
            schedule, chunk_shapes, ckpt_layers, model, mode, validate=False, timeline=False, memory=False
        ).iteration_time

    base, h = time(), 1e-6
    return (base, *((time(**{name: h}) - base) / h for name in EXECUTOR_TERMS))


def fit_tick_overhead(
    terms: Sequence[tuple[float, ...]], measured: Sequence[float], fit: Sequence[str] = EXECUTOR_TERMS
) -> tuple[float, float, float, float]:
    """The executor's own costs, :data:`EXECUTOR_TERMS` (s per tick, s per tick and bucket token,
    s per tick and context token, forwards per recomputed layer), from timed executor steps: the
    non-negative least squares fit, relative to each measured step, of ``measured − simulated`` on
    the critical path's ticks, ticks x bucket, ticks x context bucket and recomputed layers' forward
    seconds (``terms``: :func:`tick_overhead_terms` of each step's plan). It is the executor's own
    work that the layer coefficients do not see: the ``ppermute`` pair, slot gathers and scatters
    and the branch dispatch of every tick, the data-moving part of which grows with the buffers,
    and a recomputed layer's forward rerun in a backward of its own. A term no step has (such as
    recomputation in plans that recompute nothing) stays 0, and where steps vary two terms together
    (the only recomputing steps also have the longest contexts) NNLS may give one the other's cost:
    steps that differ in one term only separate them (``bench_pipeline.py --recompute-variants``).
    ``fit``: the terms fitted, the others 0. (A per-op overhead is not fitted: critical-path ops
    grow with its ticks, and a layer call's fixed cost is the layer coefficients' intercept.)"""
    if not fit or set(fit) - set(EXECUTOR_TERMS):
        raise ValueError(f"fit must name some of {EXECUTOR_TERMS}, got {tuple(fit)}")
    width = 1 + len(EXECUTOR_TERMS)
    t = np.asarray(terms, float).reshape(-1, width)
    y = np.asarray(measured, float)
    if len(y) != len(t) or len(y) < 2:
        raise ValueError(f"need at least two steps with one terms row each, got {len(y)} and {len(t)}")
    if np.any(y <= 0):
        raise ValueError("measured step times must be positive")
    w = 1.0 / y
    cols = [i for i, name in enumerate(EXECUTOR_TERMS) if name in fit]
    coef, _ = nnls(t[:, 1:][:, cols] * w[:, None], (y - t[:, 0]) * w)
    out = np.zeros(len(EXECUTOR_TERMS))
    out[cols] = coef
    return tuple(float(c) for c in out)


# --------------------------------------------------------------------------- online refit


# Scale groups of the time coefficients refitted online. Scaling every group by λ scales the
# simulated makespan by λ (it is positively homogeneous), so T = Σ_g s_g ∂T/∂s_g at s = 1.
def fit_layer_programs(
    rows: Sequence[tuple[int, float, float, float]], sp: int = 1
) -> tuple[LayerTime, tuple[float, float]]:
    """Joint NNLS fit of whole layer-program times ``t = n·(α1·P/sp + α2·T/sp + β1) + c1·T + c0``
    (InfiniPipe Eq. 1 per layer, with the ``1/N`` of Eq. 1 being the Ulysses degree ``sp``).

    ``rows``: ``(n_layers, pairs, tokens, seconds per device)``. Fitting the raw times of both
    layer counts at once (relative error weights) instead of fitting their per-chunk differences
    averages the timing noise over all samples rather than amplifying it. Returns the per-layer
    :class:`LayerTime` and the per-call ``(c1, c0)``.
    """
    n, p, t, y = (np.asarray(c, float) for c in zip(*rows))
    p, t = p / sp, t / sp
    theta = _nnls_relative(np.stack([n * p, n * t, n, t, np.ones_like(n)], axis=1), y)
    return LayerTime(float(theta[0]), float(theta[1]), float(theta[2])), (float(theta[3]), float(theta[4]))


def _difference(a: LayerTime, b: LayerTime) -> LayerTime:
    """``a − b`` term by term, clipped at 0."""
    return LayerTime(max(0.0, a.alpha1 - b.alpha1), max(0.0, a.alpha2 - b.alpha2), max(0.0, a.beta1 - b.beta1))


def fit_time_terms(report: dict, shape: ModelShape, c0: CostCoefficients, sp: int) -> dict:
    """Time coefficients of one Ulysses degree from its report (per-device seconds = raw clock
    readings / ``report["clock_divisor"]``): per-layer fwd, bwd, recompute (Eq. 1 and 11), head
    fwd/bwd, then corrected in situ on the whole-model calibration steps
    (:func:`fit_in_situ_scales`), and the optimizer update. The layer and head terms are InfiniPipe
    Eq. 1 with ``N = sp``."""
    div = float(report.get("clock_divisor", 1))
    shape_cost = CostModel(shape, Layout(1, 1, 1), c0)
    rows: dict[str, list] = {"fwd": [], "fb": [], "fbr": []}
    for key, times in report["raw"].items():
        chunk = parse_chunk(key)
        p, t = shape_cost.pairs(chunk), shape_cost.linear_tokens(chunk)
        for name, sec in times.items():
            rows[name[:-1]].append((int(name[-1]), p, t, sec / div))
    fwd, _ = fit_layer_programs(rows["fwd"], sp)
    fb, _ = fit_layer_programs(rows["fb"], sp)
    bwd = _difference(fb, fwd)
    recompute = None
    if rows["fbr"]:
        fbr, _ = fit_layer_programs(rows["fbr"], sp)
        recompute = _difference(fbr, fb)
    tokens = [h[0] for h in report["head"]]
    zero = np.zeros(len(tokens))
    head_fwd = fit_layer_time(zero, tokens, [h[1] / div for h in report["head"]], sp)
    head_bwd = fit_layer_time(zero, tokens, [max(h[2] - h[1], 1e-9) / div for h in report["head"]], sp)
    terms = dict(
        fwd=fwd,
        bwd=bwd,
        recompute=recompute,
        head_fwd=head_fwd,
        head_bwd=head_bwd,
        step_overhead=report["optimizer_s"] / div,
    )
    chunks = [ChunkShape(ctx, tuple(slices), tail) for (ctx, slices, tail), _ in report["calibration"]]
    measured = [sec / div for _, sec in report["calibration"]]
    s_pairs, bucket_scale, constant = fit_in_situ_scales(shape, c0, sp, terms, chunks, measured)
    report["in_situ"] = {
        "pairs_scale": s_pairs,
        "bucket_token_scale": {str(k): v for k, v in bucket_scale.items()},
        "chunk_constant_s": constant,
    }
    for name in ("fwd", "bwd", "recompute"):
        if terms[name] is not None:
            terms[name] = dataclasses.replace(terms[name], alpha1=terms[name].alpha1 * s_pairs)
    terms["head_bwd"] = dataclasses.replace(terms["head_bwd"], beta1=max(0.0, terms["head_bwd"].beta1 + constant))
    terms["bucket_token_scale"] = bucket_scale
    return terms


def _stage_cost(shape: ModelShape, c0: CostCoefficients, sp: int, terms: dict) -> CostModel:
    """pp = 1 cost model of one Ulysses degree with the given time terms (the stage has the head)."""
    if sp == 1:
        trial = c0.replace(**terms)
    else:
        trial = c0.replace(
            per_sp={sp: (terms["fwd"], terms["bwd"])}, head_per_sp={sp: (terms["head_fwd"], terms["head_bwd"])}
        )
    return CostModel(shape, Layout(1, 1, sp), trial.replace(bucket_token_scale={}))


def fit_in_situ_scales(
    shape: ModelShape,
    c0: CostCoefficients,
    sp: int,
    terms: dict,
    chunks: Sequence[ChunkShape],
    measured: Sequence[float],
) -> tuple[float, dict[int, float], float]:
    """Corrects isolated-program coefficients with whole-model chunk steps ``(chunks, measured)``.

    Layers timed alone in 2- and 3-layer programs do not run at the speed they run inside the
    whole model (embedding, head, loss and gradient accumulation around them; at sp > 1 the
    gradient all-reduce over the group), and the difference depends on the matmul size: on CPU
    at sp = 2 whole-model steps of packed 1024- and 2048-token chunks take 11-21 % longer than the
    layer and head fit says, 512-token ones 4 % less, while long-context split chunks match. A
    chunk's predicted step splits into an attention part (α1 · pairs), a token part (α2 · tokens of
    the layers and the head) and a constant part; ``measured ≈ s_pairs · attention + s_b · tokens +
    constant`` with one token factor ``s_b`` per token bucket ``b`` (the chunk's
    :meth:`CostModel.linear_tokens`) is fitted with relative residuals and a soft-L1 loss (one
    disturbed timing must not move the fit). All chunks of a bucket have the same token part, so
    ``s_b`` also absorbs any per-chunk constant of that bucket (a separate constant is not
    identifiable). Returns ``(s_pairs, {b: s_b}, c)`` with factors ≥ 0 and ``c = 0``. With fewer
    than 2 calibration chunks per bucket only a per-chunk constant ``c`` is fitted (the median
    residual) and the factors are 1.
    """
    from scipy.optimize import least_squares

    cost = _stage_cost(shape, c0, sp, terms)
    zero_pairs = {k: (dataclasses.replace(v, alpha1=0.0) if isinstance(v, LayerTime) else v) for k, v in terms.items()}
    zero_tokens = {k: (dataclasses.replace(v, alpha2=0.0) if isinstance(v, LayerTime) else v) for k, v in terms.items()}
    no_pairs, no_tokens = _stage_cost(shape, c0, sp, zero_pairs), _stage_cost(shape, c0, sp, zero_tokens)

    def step(m: CostModel, chunk: ChunkShape) -> float:
        return m.fwd_time(chunk, 0) + m.bwd_time(chunk, 0)

    total = np.array([step(cost, c) for c in chunks])
    attention = total - np.array([step(no_pairs, c) for c in chunks])
    token = total - np.array([step(no_tokens, c) for c in chunks])
    rest = total - attention - token
    y = np.asarray(measured, float)
    buckets = sorted({cost.linear_tokens(c) for c in chunks})
    which = np.array([buckets.index(cost.linear_tokens(c)) for c in chunks], int)
    if min(np.bincount(which, minlength=len(buckets)), default=0) < 2 or len(chunks) < len(buckets) + 2:
        return 1.0, {}, float(np.median(y - total)) if len(chunks) else 0.0

    def residual(theta):
        return (theta[0] * attention + theta[1:][which] * token + rest - y) / y

    fit = least_squares(residual, x0=np.ones(1 + len(buckets)), bounds=(0.0, np.inf), loss="soft_l1", f_scale=0.05)
    return float(fit.x[0]), {b: float(v) for b, v in zip(buckets, fit.x[1:])}, 0.0


def parse_chunk(key: str) -> ChunkShape:
    """Inverse of ``str(ChunkShape)`` as stored in reports."""

    m = re.fullmatch(r"ChunkShape\(context=(\d+), slices=\(([\d, ]*)\), tail=(True|False)\)", key)
    if m is None:
        raise ValueError(f"not a ChunkShape: {key!r}")
    slices = tuple(int(x) for x in m.group(2).replace(" ", "").split(",") if x)
    return ChunkShape(int(m.group(1)), slices, m.group(3) == "True")
