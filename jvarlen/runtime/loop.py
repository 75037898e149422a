"""The training loop: data pipeline → layout per iteration → cached compiled step → metrics.

The train state stays in one canonical FSDP sharding for the whole run (and in
checkpoints); each iteration's layout only selects which compiled step runs, so layout
changes need no transfer code and a resumed run may use other layouts than the first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from typing import Callable, Optional

import jax
import numpy as np
from flax import nnx

from jvarlen.config import Config, ConfigError, resolve_pipeline_stages, to_dict
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


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived; the step it arrived in was finished and checkpointed."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {step} written")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 143 for SIGTERM, 130 for SIGINT


class StopSignals:
    """SIGTERM/SIGINT handlers for the run (main thread only): the first signal asks the loop to
    finish the current step, checkpoint it and stop; a second SIGINT interrupts at once."""

    def __init__(self):
        self.received: Optional[int] = None
        self._previous: dict = {}

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        print(
            f"[jvarlen] {signal.Signals(signum).name} received: finishing this step, writing a checkpoint, stopping",
            flush=True,
        )

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


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
    nonfinite_run: int = 0  # consecutive steps whose update was skipped
    nonfinite_total: int = 0
    signals: "StopSignals" = dataclasses.field(default_factory=lambda: StopSignals())

    def end_step(self, step: int, record: dict, state, postfix: dict, data_state: Optional[dict] = None) -> None:
        """Logs step ``step`` (0-based) and saves a checkpoint when one is due. ``data_state``:
        the data position after this step when the sampler has run ahead of training.

        A step with a non-finite loss or gradient (its update was skipped in the step) is
        reported; ``train.max_nonfinite_steps`` of them in a row raise :class:`NonFiniteError`."""
        if record.get("nonfinite"):
            self.nonfinite_run += 1
            self.nonfinite_total += 1
            self.note(
                f"[jvarlen] step {step + 1}: loss or gradient not finite (loss {record['loss']}, grad norm "
                f"{record['grad_norm']}); update skipped ({self.nonfinite_run} in a row)"
            )
        else:
            self.nonfinite_run = 0
        record["nonfinite_steps"] = self.nonfinite_total
        if self.main:
            self.logger.log(step + 1, record, postfix=postfix)
        limit = self.config.train.max_nonfinite_steps
        if self.nonfinite_run >= limit:
            raise NonFiniteError(
                f"{self.nonfinite_run} steps in a row (up to step {step + 1}) had a non-finite loss or gradient; "
                f"their updates were skipped and no checkpoint holds them. Lower optimizer.learning_rate or check "
                f"the data, then resume from the last checkpoint (train.max_nonfinite_steps={limit})"
            )
        stop = self.signals.received
        if self.checkpointer.should_save(step + 1, self.end) or stop is not None:
            data_state = self.pipeline.state() if data_state is None else data_state
            self.checkpointer.save(step + 1, state, data_state, self.config.model)
        if stop is not None:
            self.checkpointer.wait()
            raise Interrupted(stop, step + 1)

    def close(self) -> None:
        self.signals.restore()
        self.checkpointer.close()
        self.logger.close()


def open_run(config: Config, quiet: bool, stop_after: Optional[int]) -> Run:
    """Run directory, data pipeline, canonical FSDP state (resumed if asked), logger."""
    distributed.initialize(config.parallel)
    enable_persistent_cache(config.parallel.compilation_cache_dir)
    main = jax.process_index() == 0
    quiet = quiet or not main
    run_dir = os.path.abspath(config.logging.run_dir)
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as error:  # a file where a directory should be, no permission, ...
        raise ConfigError(
            f"logging.run_dir {run_dir!r} cannot be created ({error.strerror or error}); choose another directory"
        ) from None
    say = (lambda *_: None) if quiet else (lambda msg: print(msg, flush=True))
    say(f"[jvarlen] run directory: {run_dir}")
    pipeline = DataPipeline(config.data, vocab_size=config.model.vocab_size)
    say(f"[jvarlen] corpus: {pipeline.summary()}")

    graphdef, optimizer, host_state = create_train_state(config)
    placement = Placement.for_state(host_state, optimizer)
    state = place_global(host_state, placement.state_sharding)
    del host_state
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"), config.checkpoint, say=say)

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
    logger = MetricsLogger(
        run_dir, config.logging, total_steps=total, initial_step=start, show_progress=not quiet, write=main
    )
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
        signals=StopSignals().install(),
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
        "nonfinite": int(metrics["nonfinite"]),
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
