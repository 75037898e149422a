"""The training loop: data pipeline → layout per iteration → cached compiled step → metrics.

The train state stays in one canonical FSDP sharding for the whole run (and in
checkpoints); each iteration's layout only selects which compiled step runs, so layout
changes need no transfer code and a resumed run may use other layouts than the first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable, Optional

import jax
import numpy as np
from flax import nnx

from jvarlen.config import Config, resolve_pipeline_stages, to_dict
from jvarlen.data import DataPipeline
from jvarlen.layout import Layout
from jvarlen.parallel.layouts import batch_sharding
from jvarlen.runtime import distributed
from jvarlen.runtime.checkpoint import Checkpointer, abstract_like
from jvarlen.runtime.cost_check import StepTimeCheck
from jvarlen.runtime.layout_policy import LayoutPolicy, pad_rows
from jvarlen.runtime.layout_step import Placement, make_layout_step, place_global
from jvarlen.runtime.metrics import MetricsLogger
from jvarlen.runtime.state import create_train_state, learning_rate_schedule
from jvarlen.runtime.step import BATCH_KEYS
from jvarlen.runtime.step_cache import StepCache, enable_persistent_cache


@dataclasses.dataclass
class TrainResult:
    run_dir: str
    first_step: int  # first step run by this call (> 0 after a resume)
    losses: list[float]  # mean loss of every step run by this call
    final_state: object


@dataclasses.dataclass
class Run:
    """What both training paths share: output, data, canonical state, checkpoints, logger."""

    config: Config
    main: bool
    say: Callable[[str], None]
    note: Callable[[str], None]
    run_dir: str
    pipeline: DataPipeline
    graphdef: object
    optimizer: object
    placement: Placement
    state: object
    checkpointer: Checkpointer
    logger: MetricsLogger
    start: int
    end: int
    lr_at: Callable[[int], float]

    def end_step(self, step: int, record: dict, state, postfix: dict, data_state: Optional[dict] = None) -> None:
        """Logs step ``step`` (0-based) and saves a checkpoint when one is due. ``data_state``:
        the data position after this step when the sampler has run ahead of training."""
        if self.main:
            self.logger.log(step + 1, record, postfix=postfix)
        if self.checkpointer.should_save(step + 1, self.end):
            data_state = self.pipeline.state() if data_state is None else data_state
            self.checkpointer.save(step + 1, state, data_state, self.config.model)

    def close(self) -> None:
        self.checkpointer.close()
        self.logger.close()


def open_run(config: Config, quiet: bool, stop_after: Optional[int]) -> Run:
    """Run directory, data pipeline, canonical FSDP state (resumed if asked), logger."""
    distributed.initialize(config.parallel)
    enable_persistent_cache(config.parallel.compilation_cache_dir)
    main = jax.process_index() == 0
    quiet = quiet or not main
    run_dir = os.path.abspath(config.logging.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    say = (lambda *_: None) if quiet else (lambda msg: print(msg, flush=True))
    say(f"[jvarlen] run directory: {run_dir}")
    pipeline = DataPipeline(config.data, vocab_size=config.model.vocab_size)
    say(f"[jvarlen] corpus: {pipeline.summary()}")

    graphdef, optimizer, host_state = create_train_state(config)
    placement = Placement.for_state(host_state, optimizer)
    state = place_global(host_state, placement.state_sharding)
    del host_state
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"), config.checkpoint)

    start = 0
    if config.checkpoint.resume and checkpointer.latest_step() is not None:
        start, state, data_state = checkpointer.restore(abstract_like(state), config.model)
        pipeline.restore(data_state)
        say(f"[jvarlen] resumed from step {start}")
    elif config.checkpoint.resume:
        say("[jvarlen] checkpoint.resume set but no checkpoint found; starting fresh")
    if main:
        with open(os.path.join(run_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(to_dict(config), f, indent=2)

    total = config.train.steps
    end = total if stop_after is None else min(stop_after, total)
    lr_at = learning_rate_schedule(config.optimizer, total)
    log_cfg = config.logging if main else dataclasses.replace(config.logging, tensorboard=False)
    logger = MetricsLogger(run_dir, log_cfg, total_steps=total, initial_step=start, show_progress=not quiet)
    note = (lambda _: None) if quiet else logger.write  # prints without breaking the progress bar
    return Run(
        config,
        main,
        say,
        note,
        run_dir,
        pipeline,
        graphdef,
        optimizer,
        placement,
        state,
        checkpointer,
        logger,
        start,
        end,
        lr_at,
    )


def close_run(run: Run, losses: list[float], tokens_seen: float, t_start: float, state) -> TrainResult:
    """The closing summary line and the result (call after the loop's ``finally``)."""
    if losses:
        k = max(1, min(10, len(losses) // 4))
        elapsed = time.perf_counter() - t_start
        run.say(
            f"[jvarlen] steps {run.start + 1}-{run.end}: loss first {k} avg {np.mean(losses[:k]):.4f}, "
            f"last {k} avg {np.mean(losses[-k:]):.4f}; {tokens_seen / elapsed:.0f} tokens/s"
        )
    run.say(f"[jvarlen] done; run directory: {run.run_dir}")
    return TrainResult(run_dir=run.run_dir, first_step=run.start, losses=losses, final_state=state)


def step_record(metrics: dict, step_time_s: float, learning_rate: float) -> dict:
    """The metrics every training path logs for a step, from the step's host metrics."""
    real = float(metrics["real_tokens"])
    return {
        "loss": float(metrics["loss_sum"] / max(metrics["target_tokens"], 1.0)),
        "target_tokens": float(metrics["target_tokens"]),
        "real_tokens": real,
        "grad_norm": float(metrics["grad_norm"]),
        "learning_rate": learning_rate,
        "step_time_s": step_time_s,
        "tokens_per_s": real / step_time_s,
    }


def jit_train_step(graphdef, optimizer, state, mesh):
    """A data-parallel step over ``mesh``'s devices with the canonical FSDP state.

    Returns (step, state_sharding, batch_sharding); the step donates the state.
    """
    placement = Placement.for_state(state, optimizer, list(mesh.devices.flat))
    layout = Layout(dp=mesh.size)
    model_cfg = nnx.merge(graphdef, state.params).config
    step = make_layout_step(graphdef, optimizer, placement, layout, model_cfg)
    batch = {key: batch_sharding(placement.mesh(layout)) for key in BATCH_KEYS}
    return step, placement.state_sharding, batch


def train(
    config: Config,
    *,
    quiet: bool = False,
    stop_after: Optional[int] = None,
    layout_for_step: Optional[Callable[[int, int, int], Layout]] = None,
) -> TrainResult:
    """Trains up to ``config.train.steps`` (resuming first if asked) and returns the losses.

    ``stop_after`` ends the run early at that step, as a preemption would: the schedule
    still follows ``train.steps`` and the last step reached is checkpointed.
    ``layout_for_step(step, rows, seq_len)`` overrides the config's layout policy.
    """
    distributed.initialize(config.parallel)  # before jax.devices() starts the backend
    config = resolve_pipeline_stages(config, len(jax.devices()))
    if config.parallel.pp > 1:
        from jvarlen.runtime.pipeline_loop import train_pipeline

        return train_pipeline(config, quiet=quiet, stop_after=stop_after)
    run = open_run(config, quiet, stop_after)
    note, pipeline, checkpointer = run.note, run.pipeline, run.checkpointer
    graphdef, optimizer, placement, state = run.graphdef, run.optimizer, run.placement, run.state
    start, end, lr_at = run.start, run.end, run.lr_at
    policy = LayoutPolicy.from_config(config, len(placement.devices))
    cache = StepCache(
        lambda layout: make_layout_step(graphdef, optimizer, placement, layout, config.model),
        abstract_like(state),
        batch_sharding=lambda layout: batch_sharding(placement.mesh(layout)),
        say=note,
    )
    step_time_check = StepTimeCheck.from_config(config, note)
    layout_for_step = layout_for_step or (lambda step, rows, seq_len: policy.choose(step, rows, seq_len))
    last_layout: Optional[Layout] = None
    losses: list[float] = []
    tokens_seen, t_start = 0.0, time.perf_counter()
    try:
        for step in range(start, end):
            t0 = time.perf_counter()
            batch = pipeline.next_batch()
            arrays = {key: batch.as_dict()[key] for key in BATCH_KEYS}
            layout = layout_for_step(step, *arrays["tokens"].shape)
            if layout != last_layout:
                note(f"[jvarlen] step {step + 1}: {layout}")
                last_layout = layout
            arrays = pad_rows(arrays, layout.dp)
            misses = cache.stats.misses
            compiled = cache.get(layout, arrays)
            compile_s = cache.stats.last_compile_s if cache.stats.misses > misses else 0.0
            mesh = placement.mesh(layout)
            state, metrics = compiled(state, place_global(arrays, {k: batch_sharding(mesh) for k in arrays}))
            metrics = jax.device_get(metrics)
            dt = time.perf_counter() - t0
            record = step_record(metrics, dt, float(lr_at(step)))
            losses.append(record["loss"])
            tokens_seen += record["real_tokens"]
            record.update(
                {
                    "padding_ratio": float(batch.padding_ratio),
                    "dp": layout.dp,
                    "sp": layout.sp,
                    "compile_s": compile_s,
                    "step_cache_hits": cache.stats.hits,
                    "step_cache_misses": cache.stats.misses,
                }
            )
            if step_time_check is not None and compile_s == 0.0:
                record.update(step_time_check.observe(arrays["segment_ids"], layout, dt))
            run.end_step(
                step, record, state, {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
            )
        checkpointer.wait()
    finally:
        run.close()

    return close_run(run, losses, tokens_seen, t_start, state)
