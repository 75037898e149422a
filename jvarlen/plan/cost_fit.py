"""Least-squares fitting of cost coefficients: offline (profiler) and online (training loop).

* :func:`fit_layer_time`: Eq. 1 coefficients of one layer from timed chunks (non-negative,
  relative-error weighted least squares).
* :func:`fit_link`: Eq. 2 bandwidth and latency from timed transfers.
* :func:`fit_linear`: slope and intercept (memory per token, constant memory).
* :class:`OnlineRefit`: logs predicted vs measured step time and refits per-term scale factors
  of the coefficients from measured steps (Gauss-Newton on the simulator's makespan).

Pure numpy/scipy.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence

import numpy as np
from scipy.optimize import nnls

from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, CostModel, LayerTime, Link, ModelShape
from jvarlen.plan.schedule import Schedule, one_f_one_b


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


def fit_layer_time(
    pairs: Sequence[float], tokens: Sequence[float], times: Sequence[float], sp: int = 1
) -> LayerTime:
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


# --------------------------------------------------------------------------- online refit

# Scale groups of the time coefficients refitted online. Scaling every group by λ scales the
# simulated makespan by λ (it is positively homogeneous), so T = Σ_g s_g ∂T/∂s_g at s = 1.
GROUPS = ("alpha1", "alpha2", "beta1", "head", "comm", "overhead")


def scale_coefficients(c: CostCoefficients, s: dict[str, float]) -> CostCoefficients:
    """Multiplies each group of time coefficients by its factor in ``s`` (missing = 1)."""

    def lt(x: Optional[LayerTime]) -> Optional[LayerTime]:
        if x is None:
            return None
        return LayerTime(x.alpha1 * s.get("alpha1", 1.0), x.alpha2 * s.get("alpha2", 1.0), x.beta1 * s.get("beta1", 1.0))

    def hd(x: Optional[LayerTime]) -> Optional[LayerTime]:
        return None if x is None else x.scaled(s.get("head", 1.0))

    k = s.get("comm", 1.0)

    def ln(x: Link) -> Link:
        return Link(x.bandwidth / k if k > 0 else float("inf"), x.latency * k)

    return c.replace(
        fwd=lt(c.fwd),
        bwd=lt(c.bwd),
        recompute=lt(c.recompute),
        per_sp={d: (lt(f), lt(b)) for d, (f, b) in c.per_sp.items()},
        recompute_per_sp={d: lt(r) for d, r in c.recompute_per_sp.items()},
        head_fwd=hd(c.head_fwd),
        head_bwd=hd(c.head_bwd),
        head_per_sp={d: (hd(f), hd(b)) for d, (f, b) in c.head_per_sp.items()},
        alltoall_intra={d: ln(v) for d, v in c.alltoall_intra.items()},
        alltoall_inter={d: ln(v) for d, v in c.alltoall_inter.items()},
        alltoall_default=ln(c.alltoall_default),
        p2p_intra=ln(c.p2p_intra),
        p2p_inter=ln(c.p2p_inter),
        sync_link=ln(c.sync_link),
        step_overhead=c.step_overhead * s.get("overhead", 1.0),
        step_overhead_per_sp={d: v * s.get("overhead", 1.0) for d, v in c.step_overhead_per_sp.items()},
    )


@dataclasses.dataclass
class Observation:
    chunk_shapes: tuple[ChunkShape, ...]
    layout: Layout
    measured_s: float
    schedule: Schedule
    ckpt_layers: Optional[np.ndarray]
    predicted_s: float


class OnlineRefit:
    """Predicted-vs-measured bookkeeping and periodic refit, for the training loop.

    Usage in the loop (one call per iteration, after the step has been timed)::

        refit = OnlineRefit(model_shape, coeffs, every=50)
        ...
        pred = refit.observe(plan_chunk_shapes, layout, measured_s, schedule=sched, ckpt_layers=ckpt)
        log(predicted_s=pred, measured_s=measured_s)
        if refit.due():
            coeffs = refit.refit()  # new CostCoefficients for the planner

    ``observe`` returns the prediction made with the current coefficients *before* this
    observation is used (an honest, held-out number). Without ``schedule``, 1F1B over the chunks
    in order is assumed. ``refit`` fits one non-negative scale factor per group in
    :data:`GROUPS` over the last ``window`` observations (Gauss-Newton on the simulated
    makespan, ``iterations`` steps, ridge ``prior`` towards the current coefficients) and
    returns the rescaled coefficients, which later predictions use.
    """

    def __init__(
        self,
        model: ModelShape,
        coeffs: CostCoefficients,
        every: int = 50,
        window: int = 64,
        mode: str = "ticks",
        prior: float = 1e-3,
        iterations: int = 3,
    ):
        self.model = model
        self.coeffs = coeffs
        self.every = every
        self.mode = mode
        self.prior = prior
        self.iterations = iterations
        self.history: collections.deque[Observation] = collections.deque(maxlen=window)
        self._since_refit = 0
        self.refits = 0

    def predict(
        self,
        chunk_shapes: Sequence[ChunkShape],
        layout: Layout,
        schedule: Optional[Schedule] = None,
        ckpt_layers: Optional[np.ndarray] = None,
        coeffs: Optional[CostCoefficients] = None,
    ) -> float:
        from jvarlen.plan.simulator import simulate

        cost = CostModel(self.model, layout, coeffs or self.coeffs)
        sched = schedule or one_f_one_b(len(chunk_shapes), layout.pp)
        return simulate(sched, list(chunk_shapes), ckpt_layers, cost, self.mode, validate=schedule is None).iteration_time

    def observe(
        self,
        chunk_shapes: Sequence[ChunkShape],
        layout: Layout,
        measured_s: float,
        schedule: Optional[Schedule] = None,
        ckpt_layers: Optional[np.ndarray] = None,
    ) -> float:
        sched = schedule or one_f_one_b(len(chunk_shapes), layout.pp)
        sched.validate()
        pred = self.predict(chunk_shapes, layout, sched, ckpt_layers)
        self.history.append(Observation(tuple(chunk_shapes), layout, float(measured_s), sched, ckpt_layers, pred))
        self._since_refit += 1
        return pred

    def due(self) -> bool:
        return self._since_refit >= self.every and len(self.history) > 0

    def relative_errors(self) -> np.ndarray:
        """|predicted − measured| / measured of the logged observations (predictions made before refit)."""
        return np.array([abs(o.predicted_s - o.measured_s) / o.measured_s for o in self.history])

    def refit(self) -> CostCoefficients:
        obs = list(self.history)
        if not obs:
            return self.coeffs
        base = self.coeffs
        s = {g: 1.0 for g in GROUPS}
        for _ in range(self.iterations):
            cur = scale_coefficients(base, s)
            rows, ys = [], []
            for o in obs:
                t0 = self.predict(o.chunk_shapes, o.layout, o.schedule, o.ckpt_layers, cur)
                row = []
                for g in GROUPS:  # ∂T/∂s_g by a forward difference of 1 %
                    s2 = dict(s)
                    s2[g] = s[g] * 1.01 if s[g] > 0 else 0.01
                    t1 = self.predict(o.chunk_shapes, o.layout, o.schedule, o.ckpt_layers, scale_coefficients(base, s2))
                    row.append((t1 - t0) / (s2[g] - s[g]))
                rows.append(row)
                ys.append(o.measured_s - t0 + sum(r * s[g] for r, g in zip(row, GROUPS)))
            x, y = np.asarray(rows), np.asarray(ys)
            w = 1.0 / np.array([o.measured_s for o in obs])
            xw, yw = x * w[:, None], y * w
            # ridge towards the current factors: sqrt(prior)·(s − s_current)
            active = np.abs(xw).sum(axis=0) > 0
            reg = np.sqrt(self.prior) * np.eye(len(GROUPS))
            cur_s = np.array([s[g] for g in GROUPS])
            a = np.concatenate([xw, reg])
            b = np.concatenate([yw, reg @ cur_s])
            theta, _ = nnls(a, b)
            s = {g: (float(theta[i]) if active[i] else s[g]) for i, g in enumerate(GROUPS)}
        self.coeffs = scale_coefficients(base, s)
        self._since_refit = 0
        self.refits += 1
        self.last_scales = s
        return self.coeffs
