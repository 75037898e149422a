"""The elastic pipeline strategy (``parallel.pp > 1``): per iteration, the sampled pieces are split
into ``dp`` groups by row, each group is planned by :func:`jvarlen.plan.plan_iteration` (chunks
that split long documents, 1F1B tables, recomputation tables) — ahead of time, in a background
planning process — and the ``dp`` plans run through the pipeline executor
(:mod:`jvarlen.parallel.pipeline`) as one optimizer update.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jvarlen.config import Config, ConfigError
from jvarlen.layout import Layout
from jvarlen.parallel.pipeline import PipelineSignature, make_pipeline_grads, prepare_plans, split_documents
from jvarlen.parallel.pipeline.executor import DATA
from jvarlen.parallel.pipeline.stage import stored_token_bytes
from jvarlen.plan import chunk, cpsat
from jvarlen.plan.api import PlannerOptions, make_cost, plan_iteration
from jvarlen.plan.checkpointing import SolverOptions
from jvarlen.plan.cost import CostCoefficients, CostModel, ModelShape
from jvarlen.plan.service import PlanningService
from jvarlen.runtime.cost_check import PACKAGE_PROFILES, find_profile, load_profile
from jvarlen.runtime.feed import split_by_rows
from jvarlen.runtime.step import CompiledStep
from jvarlen.runtime.strategy import ExecutionStrategy, Planner, Prepared, StepContext, checked_residual


def planner_options(config: Config) -> PlannerOptions:
    """The planner settings of ``config.plan``; candidates are simulated in the executor's own
    execution model (``"paired"`` lock-step ticks)."""
    plan = config.plan
    solver = SolverOptions(
        time_limit_s=plan.solver_time_limit_s,
        deterministic_time=plan.solver_deterministic_time,
        workers=plan.solver_workers,
        seed=plan.solver_seed,
    )
    return PlannerOptions(
        min_slice_tokens=plan.min_slice_tokens, solver=solver, simulation="paired", gpipe_units=plan.gpipe_units
    )


def cost_model(config: Config, layout: Layout, say) -> CostModel:
    """The measured profile for this backend (``train.cost_profile``, see ``find_profile``) with this
    model's shape, else the analytic a800 model (plans are still valid); its memory model holds
    1/(dp·sp) of a stage's weights per device under ``parallel.stage_weights="sharded"``, and what
    a stored layer keeps under ``parallel.residual_policy`` (``m_stored_token``, where the profile
    has none)."""
    shape = ModelShape.from_config(config.model)
    sharded = config.parallel.stage_weights == "sharded"
    path, stand_in = find_profile(config), False
    if path is None and config.train.cost_profile != "none":
        backend = jax.default_backend()
        shipped = [f for f in sorted(os.listdir(PACKAGE_PROFILES)) if f"__{backend}__" in f and f.endswith(".json")]
        shipped = [f for f in shipped if not f.endswith(".report.json")]
        if shipped:  # another shape's coefficients: plans are valid, predicted times are approximate
            path, stand_in = os.path.join(PACKAGE_PROFILES, shipped[0]), True
            say(f"[jvarlen] planner: no profile for {shape.key()}; using the shipped {shipped[0]}")
    if path is None:
        say("[jvarlen] planner: analytic a800 cost model (no measured profile for this backend)")
        coeffs = make_cost(shape, "a800", layout).coeffs
    else:
        say(f"[jvarlen] planner cost model: {path}")
        coeffs = CostCoefficients.load(path) if stand_in else load_profile(path, config, say, "planner")
    return CostModel(shape, layout, with_stored_bytes(coeffs, config), stage_weights_sharded=sharded)


def with_stored_bytes(coeffs: CostCoefficients, config: Config) -> CostCoefficients:
    """``coeffs`` whose ``m_stored_token`` is what a layer keeps under ``config``'s
    ``parallel.residual_policy`` (``stage.stored_token_bytes``), where the profile has none."""
    if coeffs.m_stored_token:
        return coeffs
    try:
        stored = stored_token_bytes(config.model, config.parallel.residual_policy)
    except ValueError as error:
        raise ConfigError(f"parallel.residual_policy: {error}") from None
    return coeffs.replace(m_stored_token=stored)


class PipelineStrategy(ExecutionStrategy):
    """``dp`` pipelines of ``pp`` stages of ``sp`` devices; one EPP plan per pipeline and iteration."""

    name = "pipeline"

    def __init__(
        self,
        ctx: StepContext,
        layout: Layout,
        cost: CostModel,
        policy: str,
        options: PlannerOptions,
        rows_per_batch: int,
        *,
        ahead: int = 2,
        workers: int = 1,
        wait: bool = False,
        residual: Optional[str] = "dots_and_attention",
        stage_weights: str = "replicated",
        chunk_multiple: int = 4,
        bucket: Optional[int] = None,
        paired: bool = True,
        vocab_max_sp: Optional[int] = None,
    ):
        """``paired``: run the executor's paired tick tables (False: one op per stage and tick, for
        comparisons; the planner's simulation stays as ``options`` says). ``stage_weights`` and
        ``vocab_max_sp``: see ``make_pipeline_grads`` (the latter by default the cost model's
        ``gpus_per_node``, as its account assumes; without a cost model, any sp)."""
        self.ctx, self.layout, self.cost, self.policy, self.options = ctx, layout, cost, policy, options
        self.rows_per_batch, self.ahead, self.workers, self.wait = rows_per_batch, ahead, workers, wait
        self.residual = checked_residual(residual)
        self.stage_weights = stage_weights
        self.chunk_multiple, self.bucket, self.paired = chunk_multiple, bucket, paired
        if vocab_max_sp is None and cost is not None:
            vocab_max_sp = cost.coeffs.gpus_per_node
        self.vocab_max_sp = vocab_max_sp
        self._service = None

    @classmethod
    def for_given_plans(cls, ctx: StepContext, layout: Layout, **options) -> "PipelineStrategy":
        """A strategy whose caller brings the plans (no cost model, no planner): research steps and
        compile checks. ``options``: the constructor's keywords (residual, stage_weights, ...)."""
        return cls(ctx, layout, None, "epp", None, rows_per_batch=1, ahead=0, **options)

    def planner(self) -> Planner:
        solve = functools.partial(plan_iteration, cost=self.cost, policy=self.policy, options=self.options)
        if self.ahead > 0 and self._service is None:
            self._service = PlanningService(
                self.cost, self.policy, self.options, workers=self.workers, reproducible=self.wait
            )
        inline = functools.partial(cpsat.call_reproducibly, solve) if self.wait else solve
        return Planner(split_by_rows(self.layout.dp, self.rows_per_batch), inline, self._service, self.wait)

    def prepare(self, iteration, known=()) -> Prepared:
        wrong = [p.layout for p in iteration.plans if p.layout != self.layout]
        if wrong:
            raise ValueError(f"a plan for {wrong[0]} given to the pipeline step of {self.layout}")
        sig, batch = prepare_plans(
            iteration.plans,
            iteration.groups,
            self.ctx.model.num_layers,
            known,
            chunk_multiple=self.chunk_multiple,
            bucket=self.bucket,
            paired=self.paired,
        )
        info = {
            "dp": self.layout.dp,
            "pp": self.layout.pp,
            "sp": self.layout.sp,
            "chunks": sum(p.n_chunks for p in iteration.plans),
            "split_documents": sum(split_documents(p) for p in iteration.plans),
            "bucket": sig.bucket,
            "longest_piece": max(len(p.tokens) for p in iteration.pieces),
        }
        for key in ("iteration_time_s", "bubble_ratio", "peak_memory_bytes"):
            values = [p.stats[key] for p in iteration.plans if key in p.stats]
            if values:
                combined = float(np.mean(values)) if key == "bubble_ratio" else max(np.max(v) for v in values)
                info[f"predicted_{key}"] = combined if np.ndim(combined) else float(combined)
        return Prepared(sig, batch, info)

    def step_inputs(self, sig: PipelineSignature) -> tuple:
        """(grads_fn, batch shapes, batch shardings) of signature ``sig`` (each pipeline's arrays
        over dp)."""
        ctx = self.ctx
        mesh = ctx.placement.mesh(sig.layout)
        grads = make_pipeline_grads(
            ctx.graphdef,
            ctx.model,
            sig,
            mesh,
            residual_policy=self.residual,
            stage_weights=self.stage_weights,
            vocab_max_sp=self.vocab_max_sp,
        )

        def grads_fn(params, batch):
            sums, g, layer_forwards = grads(params, batch)
            return sums, g, {"layer_forwards": layer_forwards}

        shapes = {k: jax.ShapeDtypeStruct(s, np.int32) for k, s in sig.input_shapes().items()}
        sharding = NamedSharding(mesh, P(DATA))
        return grads_fn, shapes, {k: sharding for k in shapes}

    def compile(self, sig: PipelineSignature) -> CompiledStep:
        return self.ctx.compile(*self.step_inputs(sig))

    def record(self, iteration, prepared: Prepared, metrics: dict) -> dict:
        return {"layer_forwards": np.asarray(metrics["layer_forwards"]).sum(0).tolist()}

    def observe(self, check, iteration, prepared: Prepared, step_s: float, run_s: float) -> dict:
        return {
            "pipeline_s": run_s,
            **check.observe_plans(iteration.plans, run_s, sharded=self.stage_weights == "sharded"),
        }

    def fingerprint(self) -> dict:
        return {"the planner's cost model": self.cost.fingerprint(), "the planner's options": repr(self.options)}

    def describe(self) -> str:
        return (
            f"elastic pipeline: {self.layout}, policy {self.policy}, chunks padded to buckets in 1/{chunk.BUCKET_STEPS} "
            "steps of a power of two"
        )

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
            self._service = None
