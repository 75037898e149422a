"""Evaluation in the run loop: every ``eval.every_steps`` steps and after the run's last step, the
loss of documents no step trains on: ``eval.documents`` held out of the training corpus, or the
validation corpus ``eval.path`` (docs/design/evaluation.md).

The batches are those documents' pieces, packed once and the same at every evaluation
(:meth:`jvarlen.data.DataPipeline.eval_batches`). Each one runs as the data-parallel layouts
strategy's forward pass (:meth:`LayoutStrategy.compile_eval`), one program for all of them,
kept in the run's compile cache. The loss is the sum over all batches divided by their targets.
"""

from __future__ import annotations

import signal
import time
from typing import Callable, Optional

import jax
import numpy as np

from jvarlen.config import Config, ConfigError
from jvarlen.layout import Layout
from jvarlen.runtime.feed import Iteration
from jvarlen.runtime.strategies.layouts import LayoutPolicy, LayoutStrategy
from jvarlen.runtime.strategy import ExecutionStrategy, Prepared, StepContext

PROGRESS_EVERY_S = 30.0  # a long evaluation says how far it is this often


class Evaluator:
    """Runs the evaluation batches through ``strategy``'s forward pass (:meth:`evaluate`) when
    :meth:`due`."""

    def __init__(self, strategy: LayoutStrategy, batches: list, every_steps: int, what: str, say: Callable):
        """``what``: the documents, in words, for the log line."""
        self.strategy, self.batches, self.every, self.what, self.say = strategy, batches, every_steps, what, say
        self._compiling = None  # the background compile's future, until it is known to have succeeded
        self.key = strategy.eval_key(self._prepare(0))  # every batch has the one shape: one program

    @classmethod
    def from_config(
        cls,
        config: Config,
        pipeline,
        eval_pipeline,
        ctx: StepContext,
        strategy: Optional[ExecutionStrategy],
        say: Callable,
    ) -> Optional["Evaluator"]:
        """The run's evaluator, or None when it does not evaluate: the documents ``pipeline`` holds
        out (``eval.documents``) or every document of ``eval_pipeline`` (``eval.path``).

        A layouts run (``strategy``) evaluates with its own layout policy; a pipeline or
        device-group run, or none (``python -m jvarlen.evaluate``), on ``Layout(devices / sp, 1,
        parallel.sp)``. A batch has ``data.rows_per_batch`` rows rounded up to a multiple of the
        layout's dp: the rows that would be padding hold pieces instead (a pipeline run's one row on
        8 devices: 8 rows, an eighth of the batches)."""
        if not config.eval.enabled:
            return None
        if isinstance(strategy, LayoutStrategy):
            policy, choose = strategy.policy, strategy.layout_for_step
        else:
            policy = _eval_policy(config, len(ctx.placement.devices))
            choose = policy.choose
        seq_len = config.data.seq_len
        dp = choose(0, config.data.rows_per_batch, seq_len).dp
        rows = -(-config.data.rows_per_batch // dp) * dp
        strategy = LayoutStrategy(
            ctx,
            policy,
            rows,
            seq_len,
            choose,
            residual=config.parallel.residual_policy,
            eval_position_edges=tuple(config.eval.position_bins or ()),
        )
        if eval_pipeline is not None:
            n = eval_pipeline.corpus.num_documents
            batches, what = eval_pipeline.eval_batches(rows, every=True), f"{n:,} documents of eval.path"
        else:
            batches, what = pipeline.eval_batches(rows), f"{config.eval.documents:,} held-out documents"
        return cls(strategy, batches, config.eval.every_steps, what, say)

    def due(self, step: int, end: int) -> bool:
        """Whether the run evaluates after step ``step`` (1-based) of a call that ends at ``end``."""
        return step % self.every == 0 or step == end

    def _prepare(self, b: int) -> Prepared:
        pieces, rows = self.batches[b]
        return self.strategy.prepare(Iteration(0, pieces, rows, {}))

    def precompile(self, cache) -> None:
        """Compiles the evaluation program in the cache's background thread (:meth:`check` raises
        its failure as soon as it is known)."""
        self._compiling = cache.precompile(self.key, self.strategy.compile_eval)

    def check(self) -> None:
        """Raises the background compile's error once it has failed: a program refused (one that
        does not fit the device, :mod:`jvarlen.runtime.memory_fit`) stops the run within a few
        steps of its start, not at the first evaluation ``eval.every_steps`` steps later."""
        if self._compiling is not None and self._compiling.done():
            compiling, self._compiling = self._compiling, None
            compiling.result()  # raises what the compile raised

    def evaluate(self, state, cache, step: int, stop: Callable[[], Optional[int]] = lambda: None) -> dict:
        """The loss of ``state`` after step ``step``: the record's ``eval_*`` fields. ``stop``: the
        signal the run stops on, if any (:meth:`jvarlen.runtime.stop.StopSignals.agreed`, the same
        answer on every process); asked before each batch, a signal abandons the evaluation ({} is
        returned), so that the step's checkpoint is written before a preemption's grace period ends."""
        start = time.perf_counter()
        compiled = cache.get(self.key, self.strategy.compile_eval)
        outputs, said, running = [], start, None
        for b in range(len(self.batches)):
            prepared = self._prepare(b)  # packed while the device runs the batch before
            assert self.strategy.eval_key(prepared) == self.key, "the held-out batches have one shape"
            if running is not None:
                # one program in flight: XLA:CPU deadlocks in the collectives of several queued ones
                outputs.append(jax.device_get(running))
            signum = stop()  # asked with nothing in flight: on several processes it is a collective
            if signum is not None:
                self.say(
                    f"[jvarlen] step {step}: evaluation abandoned before batch {b + 1} of {len(self.batches)} "
                    f"({signal.Signals(signum).name}): the checkpoint comes first"
                )
                return {}
            running = compiled(state, prepared.arrays)
            if time.perf_counter() - said > PROGRESS_EVERY_S:
                said = time.perf_counter()
                self.say(
                    f"[jvarlen] step {step}: evaluating, batch {b + 1} of {len(self.batches)} ({said - start:.0f} s)"
                )
        outputs.append(jax.device_get(running))
        # summed on the host in float64: many batches, no rounding drift
        totals = {name: np.sum([np.asarray(o[name], np.float64) for o in outputs], axis=0) for name in outputs[0]}
        seconds = time.perf_counter() - start
        targets = float(totals["target_tokens"])
        loss = float(totals["loss_sum"]) / max(targets, 1.0)
        by_position = self._by_position(totals)
        self.say(
            f"[jvarlen] step {step}: eval loss {loss:.4f} on {self.what} "
            f"({targets:,.0f} targets, {len(self.batches)} batches, {seconds:.1f} s)"
            + "".join(f"; {name.split('/')[1]} {value:.4f}" for name, value in by_position.items())
        )
        return {
            "eval_loss": loss,
            "eval_tokens": targets,
            "eval_batches": len(self.batches),
            "eval_s": seconds,
            **by_position,
        }

    def _by_position(self, totals: dict) -> dict:
        """``eval_loss/pos_<first>-<last>`` of each position bin that holds a target (``eval.position_bins``)."""
        edges = self.strategy.eval_position_edges
        if not edges:
            return {}
        sums, counts = totals["loss_sum_by_position"], totals["targets_by_position"]
        lows, out = (0, *edges), {}
        for k, low in enumerate(lows):
            name = f"eval_loss/pos_{low}-{edges[k] - 1}" if k < len(edges) else f"eval_loss/pos_{low}+"
            if counts[k] > 0:
                out[name] = float(sums[k] / counts[k])
        return out


def _eval_policy(config: Config, num_devices: int) -> LayoutPolicy:
    """The fixed layout a pipeline or device-group run evaluates on: ``parallel.sp`` over every device."""
    sp = config.parallel.sp
    layout = Layout(dp=max(num_devices // sp, 1), pp=1, sp=sp)
    problems = []
    try:
        layout.validate(num_devices, num_heads=config.model.num_heads)
    except ValueError as error:
        problems.append(str(error))
    if config.data.seq_len % sp:
        problems.append(f"data.seq_len ({config.data.seq_len}) is not divisible by sp={sp}")
    if problems:
        raise ConfigError(
            f"eval: the evaluation runs on the data-parallel layout {layout} (parallel.sp over every "
            f"device), which does not fit: {'; '.join(problems)}"
        )
    return LayoutPolicy(num_devices, config.model.num_heads, fixed=layout)
