"""The training loop's online refit of the cost coefficients: it logs predicted against measured
step times and refits one scale factor per group of time terms (:data:`GROUPS`) from the measured
steps, by Gauss-Newton on the simulator's makespan. Pure numpy/scipy."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
from typing import Optional, Sequence

import numpy as np
from scipy.optimize import nnls

from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, CostModel, LayerTime, Link, ModelShape
from jvarlen.plan.schedule import Schedule, one_f_one_b

GROUPS = ("alpha1", "alpha2", "beta1", "head", "comm", "overhead")


def scale_coefficients(c: CostCoefficients, s: dict[str, float]) -> CostCoefficients:
    """Multiplies each group of time coefficients by its factor in ``s`` (missing = 1)."""

    def lt(x: Optional[LayerTime]) -> Optional[LayerTime]:
        if x is None:
            return None
        return LayerTime(
            x.alpha1 * s.get("alpha1", 1.0), x.alpha2 * s.get("alpha2", 1.0), x.beta1 * s.get("beta1", 1.0)
        )

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
        tick_overhead=c.tick_overhead * s.get("overhead", 1.0),
        tick_token_overhead=c.tick_token_overhead * s.get("overhead", 1.0),
        tick_context_overhead=c.tick_context_overhead * s.get("overhead", 1.0),
        op_overhead=c.op_overhead * s.get("overhead", 1.0),
    )


@dataclasses.dataclass
class Observation:
    chunk_shapes: tuple[ChunkShape, ...]
    layout: Layout
    measured_s: float
    schedule: Schedule
    ckpt_layers: Optional[np.ndarray]
    predicted_s: float
    mode: str = "paired"
    parts: tuple[int, ...] = ()
    group: bool = False  # a device group's plan (CostModel(group=True))
    sharded: bool = False  # its stage weights sharded (CostModel(stage_weights_sharded=True))


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
    in order is assumed. ``mode``: the simulator's execution model (default the pipeline executor's
    paired ticks; ``"async"``, without tick overheads, for the data-parallel step, which is not the
    tick executor); ``group``: the plan is a device group's. ``refit`` fits one non-negative scale factor per group in
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
        mode: str = "paired",
        prior: float = 1e-3,
        iterations: int = 3,
    ):
        self.model = model
        self.coeffs = self.base = coeffs
        self.scales = {g: 1.0 for g in GROUPS}  # of :attr:`base`, every refit so far together
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
        mode: Optional[str] = None,
        parts: Sequence[int] = (),
        group: bool = False,
        sharded: bool = False,
    ) -> float:
        """Predicted seconds of one step; ``parts``: its :attr:`jvarlen.plan.plan.Plan.parts` (each
        part its own step, one step overhead); ``sharded``: stage weights sharded, their exposed
        gathers and reduce-scatters charged as the planner charges them."""
        from jvarlen.plan.simulator import simulate, simulate_in_parts

        cost = CostModel(self.model, layout, coeffs or self.coeffs, group=group, stage_weights_sharded=sharded)
        sched = schedule or one_f_one_b(len(chunk_shapes), layout.pp)
        shapes, mode = list(chunk_shapes), mode or self.mode
        if parts:
            return simulate_in_parts(
                sched, shapes, ckpt_layers, cost, parts, mode, validate=False, timeline=False, memory=False
            ).iteration_time
        return simulate(
            sched, shapes, ckpt_layers, cost, mode, validate=schedule is None, timeline=False, memory=False
        ).iteration_time

    def observe(
        self,
        chunk_shapes: Sequence[ChunkShape],
        layout: Layout,
        measured_s: float,
        schedule: Optional[Schedule] = None,
        ckpt_layers: Optional[np.ndarray] = None,
        predicted_s: Optional[float] = None,
        mode: Optional[str] = None,
        parts: Sequence[int] = (),
        group: bool = False,
        sharded: bool = False,
    ) -> float:
        """Records a measured step; returns its prediction with the current coefficients
        (``predicted_s`` when the caller already has it, from :meth:`predict` on a valid schedule)."""
        sched = schedule or one_f_one_b(len(chunk_shapes), layout.pp)
        mode = mode or self.mode
        if predicted_s is None:
            sched.validate()
            pred = self.predict(
                chunk_shapes, layout, sched, ckpt_layers, mode=mode, parts=parts, group=group, sharded=sharded
            )
        else:
            pred = float(predicted_s)
        shapes, measured = tuple(chunk_shapes), float(measured_s)
        self.history.append(
            Observation(shapes, layout, measured, sched, ckpt_layers, pred, mode, tuple(parts), group, sharded)
        )
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
                view = (o.chunk_shapes, o.layout, o.schedule, o.ckpt_layers)
                t0 = self.predict(*view, cur, o.mode, o.parts, o.group, o.sharded)
                row = []
                for g in GROUPS:  # ∂T/∂s_g by a forward difference of 1 %
                    s2 = dict(s)
                    s2[g] = s[g] * 1.01 if s[g] > 0 else 0.01
                    t1 = self.predict(*view, scale_coefficients(base, s2), o.mode, o.parts, o.group, o.sharded)
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
        self.scales = {g: self.scales[g] * s[g] for g in GROUPS}
        return self.coeffs

    def state(self) -> dict:
        """What a checkpoint keeps of the refit: the scales of :attr:`base` and the refit count (the
        window of observations starts again after a resume)."""
        return {"scales": dict(self.scales), "refits": self.refits, "base": _fingerprint(self.base)}

    def restore(self, state: dict) -> bool:
        """Takes up :meth:`state` of a refit from the same base coefficients; False (nothing changed)
        for another base (the profile changed between the runs)."""
        if state.get("base") != _fingerprint(self.base) or set(state.get("scales", ())) != set(GROUPS):
            return False
        self.scales = {g: float(state["scales"][g]) for g in GROUPS}
        self.coeffs = scale_coefficients(self.base, self.scales)
        self.refits = int(state.get("refits", 0))
        return True


def _fingerprint(coeffs: CostCoefficients) -> str:
    return hashlib.sha256(json.dumps(coeffs.to_json(), sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- profiler reports
