"""One training run's frame, shared by every execution strategy: run directory, data pipeline,
canonical train state (resumed if asked), checkpoints, metrics, signals, and the closing line.

The train state stays in one canonical FSDP sharding for the whole run (and in checkpoints);
a strategy only decides how each iteration's gradients are computed, so a resumed run may use
other layouts or strategies than the first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable, Optional

import jax
import numpy as np

from jvarlen.config import Config, ConfigError, to_dict
from jvarlen.data import DataPipeline
from jvarlen.parallel.sharding import Placement, place_global
from jvarlen.runtime import distributed
from jvarlen.runtime.checkpoint import Checkpointer, abstract_like
from jvarlen.runtime.compile_cache import enable_persistent_cache
from jvarlen.runtime.metrics import MetricsLogger
from jvarlen.runtime.run_dir import check_one_run_dir, claim_fresh, delete_earlier_run
from jvarlen.runtime.run_lock import RunDirLock
from jvarlen.runtime.state import create_train_state, learning_rate_schedule, warmup_updates
from jvarlen.runtime.stop import Interrupted, StopSignals


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


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
    checkpointer: Optional[Checkpointer]  # None until start_logging when an earlier run is to be overwritten
    logger: Optional[MetricsLogger]  # None until :meth:`start_logging`
    start: int
    end: int
    lr_at: Callable[[int], float]
    quiet: bool = False
    nonfinite_run: int = 0  # consecutive steps whose update was skipped
    nonfinite_total: int = 0
    signals: "StopSignals" = dataclasses.field(default_factory=lambda: StopSignals())
    earlier_run: Optional[str] = None  # what logging.overwrite deletes in start_logging, in words
    lock: Optional[RunDirLock] = None  # the run directory's, held by the first process until close
    created_dir: bool = False  # this run made run_dir: a refusal at its start removes it again
    cost_check: Optional[object] = None  # the loop's StepTimeCheck: its refit is saved with each checkpoint
    resumed_refit: Optional[dict] = None  # the refit state of the checkpoint resumed from
    eval_pipeline: Optional[DataPipeline] = None  # eval.path's corpus (held-out documents are in pipeline)
    last_eval: Optional[tuple] = None  # (step, eval loss) of the latest evaluation, for the closing line

    def start_logging(self) -> None:
        """Claims the run directory's logs (after everything that may refuse the configuration):
        ``config.json``, and the metrics logger, which drops the records after the resumed step.
        An earlier run that ``logging.overwrite`` replaces is deleted here, not before."""
        if self.earlier_run is not None:
            if self.main:
                self.say(
                    f"[jvarlen] logging.overwrite: deleting the earlier run in {self.run_dir} ({self.earlier_run})"
                )
                delete_earlier_run(self.run_dir)
            self.earlier_run = None
            self.checkpointer = Checkpointer(
                os.path.join(self.run_dir, "checkpoints"), self.config.checkpoint, say=self.say
            )
        if self.main:
            _write_config(self.run_dir, self.config, self.start)
        self.logger = MetricsLogger(
            self.run_dir,
            self.config.logging,
            total_steps=self.config.train.steps,
            initial_step=self.start,
            show_progress=not self.quiet,
            write=self.main,
        )
        if not self.quiet:
            self.note = self.logger.write  # prints without breaking the progress bar

    def learning_rate(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based): a skipped update leaves the optimizer's count,
        and so the schedule, where it was."""
        return float(self.lr_at(step - self.nonfinite_total))

    def end_step(self, step: int, record: dict, state, postfix: dict, data_state: Optional[dict] = None) -> None:
        """Logs step ``step`` (0-based) and saves a checkpoint when one is due. ``data_state``:
        the data position after this step when the sampler has run ahead of training.

        A step with a non-finite loss or gradient (its update was skipped in the step) is
        reported; ``train.max_nonfinite_steps`` of them in a row raise :class:`NonFiniteError`. A
        checkpoint whose background write failed on this process is raised here, a step later
        (:meth:`Checkpointer.check`), not at the next save."""
        self.checkpointer.check()
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
        stop = self.signals.agreed()
        if self.checkpointer.should_save(step + 1, self.end) or stop is not None:
            data_state = self.pipeline.state() if data_state is None else data_state
            schedule = {
                "train_steps": self.config.train.steps,
                "skipped_updates": self.nonfinite_total,
                "skipped_in_a_row": self.nonfinite_run,
                "optimizer": dataclasses.asdict(self.config.optimizer),
            }
            if self.cost_check is not None:
                schedule["cost_refit"] = self.cost_check.state()
            self.checkpointer.save(step + 1, state, {**data_state, RUN_STATE: schedule}, self.config.model)
        if stop is not None:
            self.checkpointer.wait()
            raise Interrupted(stop, step + 1)

    def close(self, refused: bool = False) -> None:
        """``refused``: the configuration was refused before :meth:`start_logging`; a run directory
        this run made is removed where it holds nothing (no empty directory left behind)."""
        self.signals.restore()
        try:
            if self.checkpointer is not None:
                self.checkpointer.close()  # raises a failed final save's CheckpointWriteError
        finally:
            if self.logger is not None:
                self.logger.close()
            if self.lock is not None:
                if refused and self.created_dir and self.logger is None:
                    self.lock.remove_directory_if_unused()
                self.lock.release()


def open_run(config: Config, quiet: bool, stop_after: Optional[int]) -> Run:
    """Run directory, data pipeline, canonical FSDP state (resumed if asked), logger."""
    _check_tokenizer(config)
    distributed.initialize(config.parallel)
    # at once: jax.distributed's preemption notifier takes SIGTERM until then, and a SIGTERM it
    # takes during the start-up (minutes on a large corpus) would be ignored (the run trained on)
    signals = StopSignals().install()
    try:
        return _open_with_signals(config, quiet, stop_after, signals)
    except BaseException:
        signals.restore()
        raise


def _open_with_signals(config: Config, quiet: bool, stop_after: Optional[int], signals: StopSignals) -> Run:
    enable_persistent_cache(config.parallel.compilation_cache_dir)
    main = jax.process_index() == 0
    quiet = quiet or not main
    run_dir = os.path.abspath(os.path.expanduser(config.logging.run_dir))  # "--flag=~/x": no shell expands it
    created = main and not os.path.lexists(run_dir)
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as error:  # a file where a directory should be, no permission, ...
        why = "it is a file" if os.path.isfile(run_dir) else error.strerror or error
        raise ConfigError(f"logging.run_dir {run_dir!r} cannot be created ({why}); choose another directory") from None
    say = (lambda *_: None) if quiet else (lambda msg: print(msg, flush=True))
    say(f"[jvarlen] run directory: {run_dir}")
    lock = RunDirLock.acquire(run_dir, say) if main else None  # before anything reads or writes the directory
    try:
        check_one_run_dir(run_dir, main)
        run = _open_locked(config, main, quiet, say, run_dir, stop_after, signals)
    except BaseException:
        if lock is not None:
            if created:  # a run refused at its start leaves no directory it made (its lock file only)
                lock.remove_directory_if_unused()
            lock.release()
        raise
    run.lock, run.created_dir = lock, created
    return run


def _open_locked(
    config: Config, main: bool, quiet: bool, say, run_dir: str, stop_after: Optional[int], signals: StopSignals
) -> Run:
    # an earlier run to overwrite is deleted only once the configuration is accepted (start_logging);
    # until then no checkpointer touches its checkpoints (a checkpointer rotates them on close)
    earlier = None if config.checkpoint.resume else claim_fresh(run_dir, config.logging.overwrite)
    pipeline = DataPipeline(config.data, vocab_size=config.model.vocab_size, say=say, held_out=config.eval.documents)
    say(f"[jvarlen] corpus: {pipeline.summary()}")
    eval_pipeline = open_eval_corpus(config, say)

    checkpointer = None if earlier else Checkpointer(os.path.join(run_dir, "checkpoints"), config.checkpoint, say=say)
    resuming = config.checkpoint.resume and checkpointer.latest_step() is not None
    if config.model.init_from is None:
        graphdef, optimizer, host_state = create_train_state(config)
        placement = Placement.for_state(host_state, optimizer)
        state = place_global(host_state, placement.state_sharding)
        del host_state
        target = abstract_like(state)
    else:
        say(f"[jvarlen] {config.model.describe_checkpoint_fields()}")
        graphdef, optimizer, target, placement, state = _state_from_hf(config, resuming, say)

    start, skipped, in_a_row, resumed_refit = 0, 0, 0, None
    total = config.train.steps
    if resuming:  # a run's own checkpoint takes precedence over model.init_from
        start, state, data_state = checkpointer.restore(target, config.model)
        saved = data_state.pop(RUN_STATE, {})
        _check_horizon(start, total, saved.get("train_steps"), say)
        _report_optimizer_changes(saved.get("optimizer"), config, start, say)
        skipped = int(saved.get("skipped_updates", 0))
        in_a_row = int(saved.get("skipped_in_a_row", 0))  # train.max_nonfinite_steps counts on across the resume
        pipeline.restore(data_state)
        resumed_refit = saved.get("cost_refit")
        say(f"[jvarlen] resumed from step {start}")
    elif config.checkpoint.resume:
        aside = checkpointer.set_aside()
        if aside:  # starting over would drop the run's records: the checkpoints may be fine after all
            raise ConfigError(
                f"checkpoint.resume: no checkpoint to resume from in {checkpointer.directory}, but an earlier "
                f"resume set aside {len(aside)} it could not read ({', '.join(aside)}). Rename one back to its "
                "step to retry it, or start over without checkpoint.resume and with logging.overwrite=true"
            )
        say("[jvarlen] checkpoint.resume set but no checkpoint found; starting fresh")
    end = total if stop_after is None else min(stop_after, total)
    lr_at = learning_rate_schedule(config.optimizer, total)
    warmup = warmup_updates(config.optimizer, total)
    if warmup < config.optimizer.warmup_steps:
        say(
            f"[jvarlen] optimizer.warmup_steps={config.optimizer.warmup_steps} does not fit train.steps={total}: "
            f"the warmup takes {warmup} updates and the last update runs at the peak rate"
        )
    return Run(
        config,
        main,
        say,
        say,  # until start_logging
        run_dir,
        pipeline,
        graphdef,
        optimizer,
        placement,
        state,
        checkpointer,
        None,
        start,
        end,
        lr_at,
        quiet=quiet,
        signals=signals,
        earlier_run=earlier,
        nonfinite_run=in_a_row,
        nonfinite_total=skipped,
        resumed_refit=resumed_refit,
        eval_pipeline=eval_pipeline,
    )


def open_eval_corpus(config: Config, say) -> Optional[DataPipeline]:
    """The validation corpus ``eval.path`` (None without one), read with the training data's settings."""
    if config.eval.path is None:
        return None
    from jvarlen.data import DataError

    try:
        pipeline = DataPipeline(config.eval.data(config.data), vocab_size=config.model.vocab_size, say=say)
    except DataError as error:  # its messages name data.path: say which corpus it is
        raise type(error)(f"eval.path {config.eval.path!r}: {error}") from None
    say(f"[jvarlen] eval corpus: {pipeline.summary()}")
    return pipeline


def _check_tokenizer(config: Config) -> None:
    """A pretrained model (``model.init_from``) trains on its own tokenizer's ids, never on the byte
    tokenizer's default ones, and marks documents with BOS/EOS tokens its tokenizer has."""
    init_from = config.model.init_from
    if init_from is not None and config.data.tokenizer == "byte":
        own = os.path.join(init_from, "tokenizer.json")
        hint = f"--data.tokenizer={own} (the model's own)" if os.path.isfile(own) else "--data.tokenizer=<its file>"
        raise ConfigError(
            f"model.init_from={init_from!r} with data.tokenizer=byte (the default): the corpus would be byte ids "
            "with BOS 256 / EOS 257, which mean other tokens to a pretrained model's embedding; set "
            f"{hint}, the tokenizer the model was trained with"
        )
    if init_from is not None:  # a Hugging Face tokenizer file
        from jvarlen.data.tokenizer import load_tokenizer

        boundaries = [k for k in load_tokenizer(config.data.tokenizer).appended if k != "pad"]
        if boundaries:  # ids past the tokenizer's vocabulary: rows of the embedding no training touched
            raise ConfigError(
                f"data.tokenizer {config.data.tokenizer!r} names no {' and no '.join(t.upper() for t in boundaries)} "
                "token (neither in a tokenizer_config.json beside it nor by a usual name such as <s>, </s>, "
                "<|endoftext|>): the corpus would mark documents with new ids, untrained rows of "
                f"{init_from}'s embedding; add a tokenizer_config.json naming bos_token and eos_token"
            )


def _report_optimizer_changes(saved: Optional[dict], config: Config, start: int, say) -> None:
    """One line naming every ``optimizer.*`` setting that differs from the checkpoint's run (taken
    up from the resumed step on: a deliberate change, e.g. a lower rate after a loss spike, or an
    edited config file; either way the log says so). Checkpoints written before 2026-11-29 hold none."""
    if not saved:
        return
    now = dataclasses.asdict(config.optimizer)
    changes = [f"{k} {saved[k]!r} -> {now[k]!r}" for k in now if k in saved and saved[k] != now[k]]
    if changes:
        say(
            f"[jvarlen] optimizer settings differ from the checkpoint's run: {', '.join(changes)}; the updates "
            f"after step {start} use the new ones (the earlier config: config.until-step-{start}.json)"
        )


def _write_config(run_dir: str, config: Config, start: int) -> None:
    """Writes ``config.json``; a resume whose configuration differs keeps the earlier one as
    ``config.until-step-<start>.json`` (the first kept where a step is resumed more than once: the
    steps after it that a later resume discarded were never checkpointed)."""
    path = os.path.join(run_dir, "config.json")
    text = json.dumps(to_dict(config), indent=2)
    if start > 0 and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            earlier = f.read()
        before = os.path.join(run_dir, f"config.until-step-{start}.json")
        if _run_settings(earlier) != _run_settings(text) and not os.path.exists(before):
            os.replace(path, before)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _run_settings(config_json: str) -> Optional[dict]:
    """A ``config.json``'s settings but how the run was started (``checkpoint.resume``,
    ``logging.overwrite``: every resume sets the first); None where it is not a configuration."""
    try:
        d = json.loads(config_json)
        d["checkpoint"].pop("resume", None)
        d["logging"].pop("overwrite", None)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return d


def _check_horizon(start: int, total: int, saved_total: Optional[int], say) -> None:
    """A resumed run's ``train.steps``: the checkpoint's step must not lie beyond it, and a horizon
    other than the one the run was started with is reported (the learning-rate schedule's decay
    follows it, so its rate changes from the resumed step on)."""
    if start > total:
        raise ConfigError(
            f"train.steps={total} is below the checkpoint's step {start}; resume with train.steps >= {start}"
        )
    if saved_total is not None and saved_total != total:
        say(
            f"[jvarlen] train.steps changed from {saved_total} (the checkpoint's run) to {total}: the learning-rate "
            "schedule now decays over the new horizon"
        )
    if start == total:
        say(f"[jvarlen] the checkpoint is at step {start} = train.steps: nothing left to train")


RUN_STATE = "run"  # key of the schedule's state (horizon, skipped updates) in a checkpoint's data state


def _state_from_hf(config: Config, resuming: bool, say):
    """The canonical state whose parameters are model.init_from's weights (not loaded at all when a
    checkpoint of the run is about to replace them), and the restore target with its shardings."""
    from jvarlen.hf.load import initial_state

    graphdef, optimizer, placement, state, target = initial_state(config, load=not resuming, say=say)
    return graphdef, optimizer, target, placement, state


def close_run(
    run: Run,
    losses: list[float],
    tokens_seen: float,
    t_start: float,
    state,
    step_seconds: float = 0.0,
    flops: str = "",
) -> TrainResult:
    """The closing summary line and the result (call after the loop's ``finally``): the tokens per
    second of the steps themselves (``step_seconds``, their sum; with ``flops``, their model FLOP/s
    in words) and of the wall clock since the loop started (compiles, plan waits, data and
    checkpoints included)."""
    if losses:
        k = max(1, min(10, len(losses) // 4))
        elapsed = time.perf_counter() - t_start
        rate = f" ({flops})" if flops else ""
        steps = f"{tokens_seen / step_seconds:.0f} tokens/s in steps{rate}, " if step_seconds > 0 else ""
        evaluated = "" if run.last_eval is None else f", eval loss {run.last_eval[1]:.4f} after step {run.last_eval[0]}"
        run.say(
            f"[jvarlen] steps {run.start + 1}-{run.end}: loss first {k} avg {np.mean(losses[:k]):.4f}, "
            f"last {k} avg {np.mean(losses[-k:]):.4f}{evaluated}; {steps}{tokens_seen / elapsed:.0f} tokens/s wall-clock"
        )
    run.say(f"[jvarlen] done; run directory: {run.run_dir}")
    return TrainResult(run_dir=run.run_dir, first_step=run.start, losses=losses, final_state=state)


def step_record(metrics: dict, step_time_s: float, step_seconds: float, learning_rate: float, real_tokens: int) -> dict:
    """The metrics every training path logs for a step, from the step's host metrics: ``step_time_s``
    the whole iteration (plan wait, compile, data), ``step_seconds`` the step itself, which
    ``tokens_per_s`` divides ``real_tokens`` (the sampled pieces' tokens: not the one-token
    stand-in of a pipeline an epoch's last batch leaves without documents) by."""
    real = float(real_tokens)
    return {
        "loss": float(metrics["loss_sum"] / max(metrics["target_tokens"], 1.0)),
        "target_tokens": float(metrics["target_tokens"]),
        "real_tokens": real,
        "grad_norm": float(metrics["grad_norm"]),
        "nonfinite": int(metrics["nonfinite"]),
        "learning_rate": learning_rate,
        "step_time_s": step_time_s,
        "tokens_per_s": real / max(step_seconds, 1e-9),
    }
