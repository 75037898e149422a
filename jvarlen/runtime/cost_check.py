"""Predicted vs measured step time, every iteration, with a periodic refit of the cost model.

The data-parallel step runs each replica's rows as one batched chunk ``{0, S}``
(InfiniPipe §3.1.1) on a pp = 1 layout; the prediction is the simulator's iteration time
for the slowest replica under the current coefficients, made *before* this step's
measurement is used (so the logged error is held out). Every ``every`` observed steps
:class:`jvarlen.plan.online_refit.OnlineRefit` rescales the coefficients to the measured steps.
Steps that compiled are not observed: compile time is not step time.

The elastic pipeline path (:meth:`StepTimeCheck.observe_plans`) predicts each step from its plans
instead: every replica's chunks, schedule and recomputation table through the executor's
execution model (the simulator's ``"paired"`` lock-step ticks, with the profile's tick overheads); the slowest replica is the step. The refitted
coefficients serve these predictions only; the planner keeps the coefficients it started with,
so plans stay a function of the data (a resumed run plans as the run before).
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from jvarlen.config import Config, ConfigError
from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, ModelShape, profile_filename
from jvarlen.plan.online_refit import OnlineRefit

PACKAGE_PROFILES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiles", "measured")
USER_PROFILES = os.path.join(os.path.expanduser("~"), ".cache", "jvarlen", "profiles")


def find_profile(config: Config) -> Optional[str]:
    """The profile for this model on this backend: ``train.cost_profile``, else the user
    cache of ``python -m jvarlen.profile``, else one shipped with jvarlen; None if none."""
    if config.train.cost_profile not in (None, "auto", "none"):
        path = os.path.expanduser(config.train.cost_profile)
        if not os.path.exists(path):
            raise ConfigError(
                f"train.cost_profile {config.train.cost_profile!r} does not exist (a profile JSON file, "
                "'auto' to look one up, or 'none')"
            )
        return path
    if config.train.cost_profile == "none":
        return None
    name = profile_filename(ModelShape.from_config(config.model), jax.default_backend(), jax.devices()[0].device_kind)
    for folder in (USER_PROFILES, PACKAGE_PROFILES):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    return None


def load_profile(path: str, config: Config, say: Callable[[str], None], what: str = "cost model") -> CostCoefficients:
    """The coefficients of the profile at ``path``: a file that cannot be read as one is a
    :class:`ConfigError` naming it; a profile measured for another model shape or backend is used
    (its plans are valid) with a line saying that its predicted times are approximate, and so is
    one whose layers kept other residuals than this run's (``parallel.residual_policy``)."""
    try:
        coeffs = CostCoefficients.load(path)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ConfigError(f"cost profile {path!r} cannot be read as a jvarlen profile ({error!r:.200})") from None
    meta = coeffs.meta
    run = (ModelShape.from_config(config.model).key(), jax.default_backend())
    if meta.model_key and (meta.model_key, meta.backend) != run:
        say(
            f"[jvarlen] {what}: {path} was made for {meta.model_key} on {meta.backend}, this run is {run[0]} on "
            f"{run[1]}: its predicted times are approximate"
        )
    profiled, running = meta.profiled_residual_policy, config.parallel.residual_policy or "all"
    if not meta.analytic and profiled != running:
        say(
            f"[jvarlen] {what}: {path} timed layers keeping residual_policy {profiled!r}, this run's keep "
            f"{running!r}: its predicted times are approximate"
        )
    return coeffs


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
        coeffs = load_profile(path, config, say)
        say(f"[jvarlen] cost model: {path} (refit every {config.train.cost_refit_every} steps)")
        return cls(OnlineRefit(shape, coeffs, every=config.train.cost_refit_every), path, say)

    def observe(self, segment_ids: np.ndarray, layout: Layout, measured_s: float) -> dict:
        """Predicts the step from its packed layout, records the measurement, refits when due."""
        pp1 = Layout(dp=layout.dp, pp=1, sp=layout.sp)
        chunks = replica_chunks(segment_ids, layout.dp)
        slowest = max(chunks, key=lambda c: self.refit.predict([c], pp1, mode="async"))
        return self._record(self.refit.observe([slowest], pp1, measured_s, mode="async"), measured_s)

    def observe_plans(self, plans: Sequence, measured_s: float, group: bool = False, sharded: bool = False) -> dict:
        """Elastic pipeline step: predicts the slowest of the replicas' :class:`jvarlen.plan.Plan`
        (the executor's paired ticks, current coefficients; ``group``: device groups' plans;
        ``sharded``: their stage weights sharded, as the planner's cost model charges them),
        records it against ``measured_s``, refits when due."""
        views = [(p.chunk_shapes(), p.layout, p.schedule, np.asarray(p.ckpt_layers)) for p in plans]
        predicted = [
            self.refit.predict(*view, mode="paired", parts=p.parts, group=group, sharded=sharded)
            for view, p in zip(views, plans)
        ]
        i = int(np.argmax(predicted))
        shapes, layout, schedule, ckpt = views[i]
        self.refit.observe(
            shapes,
            layout,
            measured_s,
            schedule=schedule,
            ckpt_layers=ckpt,
            predicted_s=predicted[i],
            mode="paired",
            parts=plans[i].parts,
            group=group,
            sharded=sharded,
        )
        return self._record(predicted[i], measured_s)

    def state(self) -> dict:
        """The refit's state, for a checkpoint (:meth:`jvarlen.plan.online_refit.OnlineRefit.state`)."""
        return self.refit.state()

    def restore(self, state: Optional[dict]) -> None:
        """Takes up a resumed run's refit (its coefficients, not its window of observations); says
        when the saved one was of another profile and is dropped."""
        if not state:
            return
        if self.refit.restore(state):
            self.say(f"[jvarlen] cost model: the refit of the resumed run taken up ({self.refit.refits} refits)")
        else:
            self.say("[jvarlen] cost model: the resumed run's refit was of another profile; starting from the profile")

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
