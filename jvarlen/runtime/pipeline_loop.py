"""The elastic pipeline (EPP) training path, selected by ``parallel.pp > 1``.

Per iteration: the token-budget sampler draws a global batch of whole document pieces
(up to ``data.max_doc_tokens`` = ``data.seq_len`` tokens each; its packing rows only
decide which pieces make the batch), the pieces are split into ``dp`` groups by row,
each group is planned by :func:`jvarlen.plan.plan_iteration` (chunks, split documents,
schedule and recomputation tables) with the cost model of this model — ahead of time, in
background worker processes (:mod:`jvarlen.runtime.plan_feed`), while earlier iterations
train, and the next iteration's step signature is compiled ahead in a thread — and
:class:`jvarlen.parallel.pipeline_run.PipelineRunner` runs the ``dp`` plans as one
optimizer update. The state stays in the data-parallel loop's canonical FSDP sharding,
so checkpoints, resume and logging are the shared ones of :mod:`jvarlen.runtime.loop`.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import jax
import numpy as np

from jvarlen.config import Config, ConfigError, resolve_pipeline_stages
from jvarlen.layout import Layout
from jvarlen.parallel.pipeline_run import PipelineRunner
from jvarlen.parallel.pipeline_stage import residual_policy
from jvarlen.plan.api import PlannerOptions, make_cost
from jvarlen.plan.checkpointing import SolverOptions
from jvarlen.plan.cost import CostCoefficients, CostModel, ModelShape
from jvarlen.runtime.cost_check import PACKAGE_PROFILES, StepTimeCheck, find_profile
from jvarlen.runtime.loop import TrainResult, close_run, open_run, step_record
from jvarlen.runtime.plan_feed import PlanFeed

# Deterministic-time limits only, so that a resumed run plans exactly the same chunks.
SOLVER = SolverOptions(time_limit_s=30.0, deterministic_time=0.5, workers=1, seed=0)


def pipeline_layout(config: Config, num_devices: int) -> Layout:
    """(dp, pp, sp) over all devices; dp defaults to the devices left by pp and sp."""
    par = resolve_pipeline_stages(config, num_devices).parallel
    if par.chooses_dp_layouts:
        raise ConfigError(
            "parallel.tokens_per_device / parallel.sp_cycle choose data-parallel layouts; "
            "the pipeline path (parallel.pp > 1) uses the fixed (dp, pp, sp)"
        )
    if num_devices % (par.pp * par.sp):
        raise ConfigError(f"parallel.pp * parallel.sp = {par.pp * par.sp} must divide the {num_devices} devices")
    dp = par.dp if par.dp is not None else num_devices // (par.pp * par.sp)
    layout = Layout(dp=dp, pp=par.pp, sp=par.sp)
    if layout.num_devices != num_devices:
        raise ConfigError(
            f"{layout} uses {layout.num_devices} devices, but there are {num_devices}: "
            "set parallel.dp to devices / (pp * sp) or leave it unset"
        )
    if config.model.num_layers % par.pp:
        raise ConfigError(f"model.num_layers ({config.model.num_layers}) must be divisible by parallel.pp ({par.pp})")
    if config.model.num_heads % par.sp or config.model.num_kv_heads % par.sp:
        raise ConfigError(
            f"model.num_heads ({config.model.num_heads}) and model.num_kv_heads "
            f"({config.model.num_kv_heads}) must be divisible by parallel.sp ({par.sp})"
        )
    if config.data.rows_per_batch % dp:
        raise ConfigError(
            f"data.tokens_per_batch / data.seq_len = {config.data.rows_per_batch} rows must be "
            f"divisible by dp = {dp}: each pipeline plans the documents of its rows"
        )
    return layout


def cost_model(config: Config, layout: Layout, say) -> CostModel:
    """The measured profile for this backend (``train.cost_profile``, see ``find_profile``)
    with this model's shape, else the analytic a800 model (plans are still valid)."""
    shape = ModelShape.from_config(config.model)
    path = find_profile(config)
    if path is None and config.train.cost_profile != "none":
        shipped = [
            f for f in sorted(os.listdir(PACKAGE_PROFILES)) if f.endswith(f"__{jax.default_backend()}__cpu.json")
        ]
        if shipped:  # another shape's coefficients: plans are valid, predicted times are approximate
            path = os.path.join(PACKAGE_PROFILES, shipped[0])
            say(f"[jvarlen] planner: no profile for {shape.key()}; using the shipped {shipped[0]}")
    if path is None:
        say("[jvarlen] planner: analytic a800 cost model (no measured profile for this backend)")
        return make_cost(shape, "a800", layout)
    say(f"[jvarlen] planner cost model: {path}")
    return CostModel(shape, layout, CostCoefficients.load(path))


def train_pipeline(config: Config, *, quiet: bool = False, stop_after: Optional[int] = None) -> TrainResult:
    """Trains with EPP plans; same outputs (metrics.jsonl, checkpoints, resume) as the DP loop."""
    layout = pipeline_layout(config, len(jax.devices()))
    kept = config.parallel.residual_policy
    try:
        residual_policy(kept)
    except ValueError as error:
        raise ConfigError(f"parallel.residual_policy: {error}") from None
    run = open_run(config, quiet, stop_after)
    say, note, pipeline, checkpointer = run.say, run.note, run.pipeline, run.checkpointer
    state = run.state
    run.state = None
    cost = cost_model(config, layout, say)
    # candidates are simulated in the executor's own lock-step execution model
    options = PlannerOptions(
        min_slice_tokens=config.parallel.plan_min_slice_tokens,
        solver=SOLVER,
        simulation="ticks",
        gpipe_units=config.parallel.plan_gpipe_units,
    )
    runner = PipelineRunner(
        run.graphdef,
        config.model,
        run.optimizer,
        state,
        chunk_multiple=4,
        say=note,
        residual_policy=None if kept == "all" else kept,
    )
    say(
        f"[jvarlen] elastic pipeline: {layout}, policy {config.parallel.plan_policy}, "
        "chunks padded to buckets in quarter steps of a power of two"
    )
    # Every process plans its own copy of the iteration; only solved plans (no timing-dependent
    # fallbacks) are guaranteed to be the same on all of them, so multi-process runs wait.
    wait = config.parallel.plan_wait or jax.process_count() > 1
    feed = PlanFeed(
        pipeline,
        layout,
        cost,
        config.parallel.plan_policy,
        options,
        run.start,
        run.end,
        ahead=config.parallel.plan_ahead,
        wait=wait,
        say=note,
    )
    step_time_check = StepTimeCheck.from_config(config, note)
    losses: list[float] = []
    tokens_seen, t_start = 0.0, time.perf_counter()
    try:
        for step in range(run.start, run.end):
            t0 = time.perf_counter()
            it = feed.next()
            ahead = feed.peek_plans()  # compile the next iteration's signature while this one runs
            if ahead is not None:
                runner.precompile(*ahead)
            misses = runner.cache.misses
            t_run = time.perf_counter()
            state, metrics, info = runner.step(state, it.plans, it.groups)
            metrics = jax.device_get(metrics)
            run_s = time.perf_counter() - t_run  # the pipeline itself: no plan wait, no precompile dispatch
            dt = time.perf_counter() - t0
            record = step_record(metrics, dt, float(run.lr_at(step)))
            losses.append(record["loss"])
            tokens_seen += record["real_tokens"]
            record.update(
                {
                    "pieces": sum(len(g) for g in it.groups),
                    "documents": len({p.doc_id for g in it.groups for p in g}),
                    "longest_piece": max(len(p.tokens) for g in it.groups for p in g),
                    "plan_s": it.plan_s,
                    "plan_fallbacks": it.fallbacks,
                    "dp": layout.dp,
                    "pp": layout.pp,
                    "sp": layout.sp,
                    "compiled": runner.cache.misses > misses,
                    "step_cache_misses": runner.cache.misses,
                    "layer_forwards": np.asarray(metrics["layer_forwards"]).sum(0).tolist(),
                    **{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in info.as_dict().items()},
                }
            )
            if step_time_check is not None and not record["compiled"]:
                record["pipeline_s"] = run_s
                record.update(step_time_check.observe_plans(it.plans, run_s))
            run.end_step(
                step,
                record,
                state,
                {"loss": f"{record['loss']:.3f}", "chunks": info.chunks, "split": info.split_documents},
                data_state=it.data_state,
            )
        checkpointer.wait()
    finally:
        feed.close()
        run.close()
    return close_run(run, losses, tokens_seen, t_start, state)
