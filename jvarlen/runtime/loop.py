"""The training loop: data pipeline → sharded jitted step → metrics and checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional

import jax
import numpy as np

from jvarlen.config import Config, ConfigError, to_dict
from jvarlen.data import DataPipeline
from jvarlen.parallel.mesh import batch_sharded, data_mesh, replicated
from jvarlen.runtime.checkpoint import Checkpointer, abstract_like
from jvarlen.runtime.metrics import MetricsLogger
from jvarlen.runtime.state import create_train_state, learning_rate_schedule
from jvarlen.runtime.step import BATCH_KEYS, make_train_step


@dataclasses.dataclass
class TrainResult:
    run_dir: str
    first_step: int  # first step run by this call (> 0 after a resume)
    losses: list[float]  # mean loss of every step run by this call
    final_state: object


def jit_train_step(graphdef, optimizer, state, mesh):
    """The step jitted with replicated state, row-sharded batch and a donated state."""
    state_sharding = jax.tree.map(lambda _: replicated(mesh), state)
    batch_sharding = {key: batch_sharded(mesh) for key in BATCH_KEYS}
    return jax.jit(
        make_train_step(graphdef, optimizer),
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, replicated(mesh)),
        donate_argnums=0,
    ), state_sharding, batch_sharding


def train(config: Config, *, quiet: bool = False, stop_after: Optional[int] = None) -> TrainResult:
    """Trains up to ``config.train.steps`` (resuming first if asked) and returns the losses.

    ``stop_after`` ends the run early at that step, as a preemption would: the schedule
    still follows ``train.steps`` and the last step reached is checkpointed.
    """
    run_dir = os.path.abspath(config.logging.run_dir)
    os.makedirs(run_dir, exist_ok=True)
    say = (lambda *_: None) if quiet else (lambda msg: print(msg, flush=True))
    say(f"[jvarlen] run directory: {run_dir}")

    mesh = data_mesh()
    pipeline = DataPipeline(config.data, vocab_size=config.model.vocab_size)
    if config.data.rows_per_batch % mesh.size:
        raise ConfigError(
            f"data.rows_per_batch ({config.data.rows_per_batch} = tokens_per_batch / seq_len) must be "
            f"divisible by the {mesh.size} data-parallel devices; change data.tokens_per_batch"
        )
    say(f"[jvarlen] corpus: {pipeline.summary()}")

    graphdef, optimizer, state = create_train_state(config)
    step_fn, state_sharding, batch_sharding = jit_train_step(graphdef, optimizer, state, mesh)
    state = jax.device_put(state, state_sharding)
    checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"), config.checkpoint)

    start = 0
    if config.checkpoint.resume and checkpointer.latest_step() is not None:
        start, state, data_state = checkpointer.restore(abstract_like(state), config.model)
        pipeline.restore(data_state)
        say(f"[jvarlen] resumed from step {start}")
    elif config.checkpoint.resume:
        say("[jvarlen] checkpoint.resume set but no checkpoint found; starting fresh")
    with open(os.path.join(run_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(to_dict(config), f, indent=2)

    total = config.train.steps
    end = total if stop_after is None else min(stop_after, total)
    lr_at = learning_rate_schedule(config.optimizer, total)
    logger = MetricsLogger(run_dir, config.logging, total_steps=total, initial_step=start, show_progress=not quiet)
    losses: list[float] = []
    tokens_seen, t_start = 0.0, time.perf_counter()
    try:
        for step in range(start, end):
            t0 = time.perf_counter()
            batch = pipeline.next_batch()
            arrays = {key: batch.as_dict()[key] for key in BATCH_KEYS}
            state, metrics = step_fn(state, jax.device_put(arrays, batch_sharding))
            metrics = jax.device_get(metrics)
            dt = time.perf_counter() - t0
            loss = float(metrics["loss_sum"] / max(metrics["target_tokens"], 1.0))
            losses.append(loss)
            tokens_seen += float(metrics["real_tokens"])
            record = {
                "loss": loss,
                "target_tokens": float(metrics["target_tokens"]),
                "real_tokens": float(metrics["real_tokens"]),
                "padding_ratio": float(batch.padding_ratio),
                "grad_norm": float(metrics["grad_norm"]),
                "learning_rate": float(lr_at(step)),
                "step_time_s": dt,
                "tokens_per_s": float(metrics["real_tokens"]) / dt,
            }
            logger.log(step + 1, record, postfix={"loss": f"{loss:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"})
            if checkpointer.should_save(step + 1, end):
                checkpointer.save(step + 1, state, pipeline.state(), config.model)
        checkpointer.wait()
    finally:
        checkpointer.close()
        logger.close()

    if losses:
        k = max(1, min(10, len(losses) // 4))
        elapsed = time.perf_counter() - t_start
        say(
            f"[jvarlen] steps {start + 1}-{end}: loss first {k} avg {np.mean(losses[:k]):.4f}, "
            f"last {k} avg {np.mean(losses[-k:]):.4f}; {tokens_seen / elapsed:.0f} tokens/s"
        )
    say(f"[jvarlen] done; run directory: {run_dir}")
    return TrainResult(run_dir=run_dir, first_step=start, losses=losses, final_state=state)
