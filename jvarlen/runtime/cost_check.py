"""Predicted vs measured step time, every iteration, with a periodic refit of the cost model.

The data-parallel step runs each replica's rows as one batched chunk ``{0, S}``
(InfiniPipe §3.1.1) on a pp = 1 layout; the prediction is the simulator's iteration time
for the slowest replica under the current coefficients, made *before* this step's
measurement is used (so the logged error is held out). Every ``every`` observed steps
:class:`jvarlen.plan.cost_fit.OnlineRefit` rescales the coefficients to the measured steps.
Steps that compiled are not observed: compile time is not step time.

The elastic pipeline path (:meth:`StepTimeCheck.observe_plans`) predicts each step from its plans
instead: every replica's chunks, schedule and recomputation table through the lock-step
("ticks") simulator, the executor's execution model; the slowest replica is the step. The refitted
coefficients serve these predictions only; the planner keeps the coefficients it started with,
so plans stay a function of the data (resume and multi-process runs need the same plans).

The memory side (:func:`memory_check`): the activation memory the cost model predicts for a
chunk (Eq. 5/9/10 plus the working memory of the backward in flight) against XLA's
``compile().memory_analysis()`` of the real decoder's forward+backward programs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from jvarlen.config import Config
from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, ModelShape, profile_filename
from jvarlen.plan.cost_fit import OnlineRefit

PACKAGE_PROFILES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiles", "measured")
USER_PROFILES = os.path.join(os.path.expanduser("~"), ".cache", "jvarlen", "profiles")


def find_profile(config: Config) -> Optional[str]:
    """The profile for this model on this backend: ``train.cost_profile``, else the user
    cache of ``python -m jvarlen.profile``, else one shipped with jvarlen; None if none."""
    if config.train.cost_profile not in (None, "auto", "none"):
        if not os.path.exists(config.train.cost_profile):
            raise FileNotFoundError(f"train.cost_profile {config.train.cost_profile!r} does not exist")
        return config.train.cost_profile
    if config.train.cost_profile == "none":
        return None
    name = profile_filename(ModelShape.from_config(config.model), jax.default_backend(), jax.devices()[0].device_kind)
    for folder in (USER_PROFILES, PACKAGE_PROFILES):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    return None


def replica_chunks(segment_ids: np.ndarray, dp: int) -> list[ChunkShape]:
    """One batched chunk per data-parallel replica from packed ``segment_ids [R, T]``."""
    chunks = []
    for rows in np.array_split(np.asarray(segment_ids), dp):
        pieces = [int(n) for row in rows for n in np.bincount(row)[1:] if n > 0]
        chunks.append(ChunkShape(0, tuple(pieces) if pieces else (1,)))
    return chunks


class StepTimeCheck:
    """Logs ``predicted_step_s`` and ``cost_error`` per step; refits every ``every`` steps."""

    def __init__(self, refit: OnlineRefit, source: str, say: Callable[[str], None]):
        self.refit = refit
        self.source = source
        self.say = say

    @classmethod
    def from_config(cls, config: Config, say: Callable[[str], None]) -> Optional["StepTimeCheck"]:
        path = find_profile(config)
        shape = ModelShape.from_config(config.model)
        if path is None:
            if config.train.cost_profile != "none":
                say(
                    f"[jvarlen] no cost profile for {shape.key()} on {jax.default_backend()}: predicted step "
                    "times are off (run `python -m jvarlen.profile` to measure one)"
                )
            return None
        coeffs = CostCoefficients.load(path)
        say(f"[jvarlen] cost model: {path} (refit every {config.train.cost_refit_every} steps)")
        return cls(OnlineRefit(shape, coeffs, every=config.train.cost_refit_every), path, say)

    def observe(self, segment_ids: np.ndarray, layout: Layout, measured_s: float) -> dict:
        """Predicts the step from its packed layout, records the measurement, refits when due."""
        pp1 = Layout(dp=layout.dp, pp=1, sp=layout.sp)
        chunks = replica_chunks(segment_ids, layout.dp)
        slowest = max(chunks, key=lambda c: self.refit.predict([c], pp1))
        return self._record(self.refit.observe([slowest], pp1, measured_s), measured_s)

    def observe_plans(self, plans: Sequence, measured_s: float) -> dict:
        """Elastic pipeline step: predicts the slowest of the replicas' :class:`jvarlen.plan.Plan`
        (lock-step ticks, current coefficients), records it against ``measured_s``, refits when due."""
        views = [(p.chunk_shapes(), p.layout, p.schedule, np.asarray(p.ckpt_layers)) for p in plans]
        predicted = [self.refit.predict(*view) for view in views]
        i = int(np.argmax(predicted))
        shapes, layout, schedule, ckpt = views[i]
        self.refit.observe(shapes, layout, measured_s, schedule=schedule, ckpt_layers=ckpt, predicted_s=predicted[i])
        return self._record(predicted[i], measured_s)

    def _record(self, predicted_s: float, measured_s: float) -> dict:
        record = {"predicted_step_s": predicted_s, "cost_error": abs(predicted_s - measured_s) / measured_s}
        if self.refit.due():
            errors = self.refit.relative_errors()
            self.refit.refit()
            self.say(
                f"[jvarlen] cost model refit #{self.refit.refits}: median |pred-meas|/meas over the last "
                f"{errors.size} steps was {np.median(errors):.1%}"
            )
        return record


# --------------------------------------------------------------------------- memory check


@dataclasses.dataclass(frozen=True)
class MemoryCase:
    """One compiled program whose XLA memory is compared with the cost model: ``layers`` decoder
    layers of the profiler's harness (the first ``remat`` recomputed), forward + backward of
    ``chunk``; ``head=True``: the whole model's chunk step (embedding, all layers, head, loss,
    gradient accumulation) instead of a layer slice."""

    chunk: ChunkShape
    layers: int
    remat: int = 0
    head: bool = False


def predict_memory(shape: ModelShape, coeffs: CostCoefficients, case: MemoryCase) -> dict:
    """Cost-model prediction for ``case`` (bytes): Eq. 10 stored activations, the working memory
    of the backward in flight, and their sum, the predicted peak (``CostModel.peak_memory``).

    The harness keeps no K/V for later slices and receives no dK/dV from them (those buffers
    belong to the pipeline executor), so the chunk is charged as a tail chunk (I = 1 in Eq. 5/9).
    """
    from jvarlen.plan.cost import CostModel

    model = shape if case.head else dataclasses.replace(shape, num_layers=case.layers)
    cost = CostModel(model, Layout(1, 1, 1), coeffs)
    chunk = dataclasses.replace(case.chunk, tail=True)
    stage = 0 if case.head else None
    eq10 = cost.activation_memory(chunk, case.remat, stage)
    work = cost.working_memory(chunk, case.remat)
    return {"eq10": eq10, "work": work, "peak": eq10 + work}


def measure_memory_case(harness, case: MemoryCase) -> Optional[dict]:
    """XLA's ``memory_analysis()`` of the case's program on this backend (compiled, not run)."""
    from jvarlen.runtime.profiler import program_memory

    if case.head:
        batch = harness.chunk_inputs(case.chunk)
        return program_memory(
            harness.chunk_step_program(case.remat), harness.params, harness.zeros_like_params(), batch
        )
    batch = harness.layer_inputs(case.chunk)
    return program_memory(harness.layers_program(case.layers, "fwdbwd", case.remat), harness.params, batch)


def layer_residual_bytes(harness, chunk: ChunkShape) -> int:
    """Bytes autodiff saves for the backward of one decoder layer on ``chunk`` (``jax.vjp``'s
    residual leaves minus the layer's parameters, by ``jax.eval_shape``: nothing is compiled).
    Independent of XLA's buffer assignment: what Eq. 5's ``M_token`` should count."""
    from flax import nnx

    from jvarlen.model import AttentionInputs

    batch = harness.layer_inputs(chunk)
    model = nnx.merge(harness.graphdef, harness.params)
    gdef, stacked = nnx.split(model.layers)
    state0 = jax.tree.map(lambda a: a[0], stacked)
    inputs = AttentionInputs(batch["seg"], batch["pos"], batch["kv_seg"], batch["kv_pos"])
    attn = harness._attention_fn(batch["ctx_k"], batch["ctx_v"])

    def residuals(state, x):
        layer_fn = lambda s, y: nnx.merge(gdef, s)(y, inputs, attn, harness.dtype)  # noqa: E731
        _, vjp = jax.vjp(layer_fn, state, x)
        params = {id(p) for p in jax.tree.leaves(state)}
        return [r for r in jax.tree.leaves(vjp) if id(r) not in params]

    shapes = jax.eval_shape(residuals, state0, batch["x"])
    return int(sum(np.prod(s.shape) * s.dtype.itemsize for s in shapes))


def memory_check(harness, coeffs: CostCoefficients, cases: Sequence[MemoryCase]) -> list[dict]:
    """Measured (XLA) vs predicted (cost model) memory of each case; ``rel_err`` of the predicted
    peak against ``temp_size_in_bytes``. Empty when the backend reports no memory analysis."""
    rows = []
    for case in cases:
        measured = measure_memory_case(harness, case)
        if measured is None:
            return []
        pred = predict_memory(harness.shape, coeffs, case)
        rows.append(
            {
                "context": case.chunk.context,
                "slices": list(case.chunk.slices),
                "layers": case.layers,
                "remat": case.remat,
                "head": case.head,
                **{f"measured_{k}": v for k, v in measured.items()},
                **{f"predicted_{k}": v for k, v in pred.items()},
                "rel_err": (pred["peak"] - measured["temp"]) / measured["temp"],
            }
        )
    return rows
