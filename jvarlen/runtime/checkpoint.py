"""Orbax checkpoints of the train state, the sampler position and the run's model shape.

Guarantees beyond Orbax's atomic step directories:

* a state holding a non-finite value is never written (:class:`NonFiniteStateError`);
* rotation (``checkpoint.max_to_keep``) is done here, and only once a newer checkpoint has been
  finalized: an older checkpoint is never deleted before its successor is complete, so a crash
  or a failed write never leaves the run without its newest good checkpoint;
* resume falls back from a checkpoint that cannot be read to the newest one that can (every
  process of a distributed run to the same one), says which it skipped and why, and moves the
  damaged one aside (renamed, never deleted) so that the run can write that step again. Damage
  includes a state whose bits differ from those written (every leaf's checksums are saved beside
  it, :func:`state_checksums`). What is not damage is
  not moved: a train state of another structure (another optimizer chain, another jvarlen
  version) is a :class:`CheckpointMismatchError`, a storage error (an ``OSError`` other than a
  missing file, or TensorStore's equivalent: :func:`is_storage_error`) or running out of memory is
  raised as it is.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from jvarlen.config import CheckpointConfig, ModelConfig
from jvarlen.runtime import distributed


class CheckpointMismatchError(ValueError):
    """The checkpoint does not belong to this model or train state (shape, dtype or structure differ)."""


class NoReadableCheckpointError(RuntimeError):
    """Resume was asked for, checkpoints exist, and none of them can be read."""


class CheckpointReadError(RuntimeError):
    """Another process of a distributed run could not read the checkpoint for a reason that is not
    damage (a storage error, out of memory): every process stops, nothing is moved."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions, a failed mount): the checkpoints
    before it are complete and the run can resume from the newest once the cause is fixed."""


class NonFiniteStateError(RuntimeError):
    """A checkpoint was about to be written from a state holding NaN or Inf."""


def _all_finite_of(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


CHECKSUMS = "state_checksums"  # key of the train state's checksums in a checkpoint's data item
_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """Two uint32 sums of a leaf's bit patterns (wrapping): plain, and weighted by odd position
    factors (moved data changes it). Orbax's files carry no checksum: a flipped bit or a damaged
    chunk would restore as finite, wrong values."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if x.dtype.itemsize == 8:
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        words = jax.lax.bitcast_convert_type(x, _WORDS[x.dtype.itemsize]).astype(jnp.uint32)
    words = words.reshape(-1)
    weights = jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weights, dtype=jnp.uint32)])


# one pass (and one compile per state structure) for both checks
_inspect = jax.jit(lambda tree: (_all_finite_of(tree), [_leaf_checksum(x) for x in jax.tree.leaves(tree)]))


def inspect_state(tree) -> tuple[bool, dict[str, list[int]]]:
    """(every float finite, :func:`state_checksums`) of ``tree``."""
    finite, sums = jax.device_get(_inspect(tree))
    paths = [_leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return bool(finite), {name: [int(v) for v in value] for name, value in zip(paths, sums)}


def state_checksums(tree) -> dict[str, list[int]]:
    """Leaf name (its path's keys joined by ``/``) -> the leaf's two checksums; equal for the same
    bits whatever the sharding or the tree's container types (a train state, its params as numpy)."""
    return inspect_state(tree)[1]


def _leaf_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def verify_checksums(sums: dict[str, list[int]], saved: Optional[dict]) -> Optional[str]:
    """The first leaf whose checksums ``sums`` (:func:`state_checksums` of what was read) differ
    from ``saved`` (None when all agree, or when the checkpoint predates checksums). Leaves
    ``saved`` lacks are not checked (a partial restore reads a subset)."""
    for name, value in sums.items():
        if saved and name in saved and list(saved[name]) != value:
            return name
    return None


class Checkpointer:
    """Saves ``TrainState`` + data-pipeline state + model config every N steps (async)."""

    def __init__(self, directory: str | os.PathLike, cfg: CheckpointConfig, say: Callable[[str], None] = print):
        self.cfg = cfg
        self.say = say
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # rotation is ours (see _rotate): only after a newer save is finalized
            enable_async_checkpointing=cfg.async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        _quiet_storage_failures()
        if cfg.async_save and not logging.getLogger("absl").isEnabledFor(logging.ERROR):
            say(
                "note: absl logging is set above ERROR, so a checkpoint write that fails in the background is "
                "seen only when the next save or the run's end waits for it (with several processes the others "
                "wait in Orbax's barriers until its timeout); keep absl's verbosity at ERROR or below"
            )
        self._saved = False  # rotation on close only after a save of this run (a refused one deletes nothing)
        self._pending: Optional[int] = None  # the step of the save in flight
        self._failures_before = 0  # background write failures logged before the save in flight
        self._abandoned = False  # a background failure raised by check(): Orbax's threads are not waited for

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def should_save(self, step: int, last_step: int) -> bool:
        return step % self.cfg.every_steps == 0 or step == last_step

    def save(self, step: int, state: Any, data_state: dict, model_cfg: ModelConfig) -> None:
        """Writes checkpoint ``step`` (in the background with ``async_save``); raises
        :class:`NonFiniteStateError` instead of writing a state with NaN/Inf."""
        finite, sums = inspect_state(state)
        if not finite:
            raise NonFiniteStateError(
                f"not writing checkpoint {step}: the train state holds NaN or Inf; the newest good checkpoint "
                f"in {self.directory} is {self.latest_step()}"
            )
        data_state = {**data_state, CHECKSUMS: sums}
        self._finish()  # the previous save is finalized: older ones may go now
        newest = self.latest_step()
        if newest is not None and step <= newest:  # before the rotation: nothing of theirs is deleted
            raise CheckpointWriteError(self._not_after(step, newest))
        self._rotate(keep=self.cfg.max_to_keep)
        self._saved = True
        self._pending = step
        self._failures_before = len(_background_failures)
        try:
            accepted = self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=ocp.args.JsonSave(data_state),
                    model=ocp.args.JsonSave(dataclasses.asdict(model_cfg)),
                ),
            )
        except Exception as error:  # noqa: BLE001 (a synchronous save fails here, an async one in _finish)
            self._write_failed(error)
        if not accepted:  # Orbax declines, without an error, a step at or below the newest it holds
            self._pending = None
            raise CheckpointWriteError(self._not_after(step, self.latest_step()))
        if not self.cfg.async_save:
            self._pending = None

    def _not_after(self, step: int, newest: Optional[int]) -> str:
        return (
            f"checkpoint {step} was not written: {self.directory} already holds checkpoint {newest} (Orbax "
            "writes only steps after its newest), which this run did not write; move the checkpoints of "
            "the other run away, or start over with logging.overwrite=true"
        )

    def check(self) -> None:
        """(Every step; no wait.) Raises the :class:`CheckpointWriteError` of a save in flight whose
        background write has already failed on this process. In a run of several processes the
        others wait for this one in Orbax's barriers (20 minutes, then Orbax's timeout), and this
        process's own finalizing thread waits in the next: it must stop now and say why, so that the
        others stop too (:func:`jvarlen.runtime.distributed.report_failure`), and nothing may wait
        for Orbax's threads after that (:meth:`close` does not)."""
        if self._pending is not None and len(_background_failures) > self._failures_before:
            self._abandoned = True
            self._write_failed(_background_failures[-1])

    def _finish(self) -> None:
        """Waits for the save in flight; its failure is a :class:`CheckpointWriteError`."""
        if self._abandoned:  # raised by check(); Orbax's threads may wait in a barrier for good
            return
        try:
            self.manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 (orbax and tensorstore raise their own types)
            self._write_failed(error)
        self._pending = None

    def _write_failed(self, error: Exception) -> None:
        step, self._pending = self._pending, None
        newest = self.latest_step()
        way_on = "no checkpoint is complete: start again" if newest is None else f"resume from checkpoint {newest}"
        raise CheckpointWriteError(
            f"checkpoint {step} could not be written in {self.directory} ({read_error_summary(error)}); fix the "
            f"cause (free space, permissions) and {way_on}"
        ) from error

    def _rotate(self, keep: int) -> None:
        """Deletes finalized checkpoints beyond the newest ``keep`` (called when no save is running)."""
        steps = self.all_steps()
        for old in steps[: max(0, len(steps) - keep)]:
            self.manager.delete(old)

    def set_aside(self) -> list[str]:
        """The checkpoints an earlier resume found unreadable and renamed (``<step>.unreadable-<time>``)."""
        if not os.path.isdir(self.directory):
            return []
        return sorted(name for name in os.listdir(self.directory) if ".unreadable-" in name)

    def restore(self, abstract_state: Any, model_cfg: ModelConfig, step: Optional[int] = None):
        """Returns (step, state, data_state); ``abstract_state`` gives shapes and shardings.

        Without ``step``: the newest checkpoint that can be read. A checkpoint that cannot be read
        is reported, renamed to ``<step>.unreadable-<time>`` (kept for inspection, out of the way of
        new saves) and the next older one is tried; :class:`NoReadableCheckpointError` when none can
        be read. A checkpoint of another model or train-state structure raises
        :class:`CheckpointMismatchError` and a storage error is raised as it is (no fallback, nothing
        moved: neither is damage). In a distributed run each process reads its part and all agree
        on every candidate (:func:`jvarlen.runtime.distributed.agree`): one that any process finds
        damaged is skipped by all, and where one process must raise, the others raise
        :class:`CheckpointReadError` naming it."""
        steps = self.all_steps() if step is None else [step]
        if not steps:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.directory}")
        skipped = []
        for candidate in reversed(steps):
            outcome, found = self._read(candidate, abstract_state, model_cfg)
            # every process reads its part of the state: all must agree on each candidate, or one
            # would fall back alone and train from another step than the others (or wait for ever)
            verdicts = distributed.agree(f"restore/{candidate}", outcome + "\n" + _verdict_text(found))
            if outcome == "raise":
                raise found
            elsewhere = [(p, *v.split("\n", 1)) for p, v in enumerate(verdicts) if not v.startswith("ok")]
            stops = [(p, why) for p, kind, why in elsewhere if kind == "raise"]
            if stops:
                p, why = stops[0]
                raise CheckpointReadError(
                    f"process {p} of this run cannot read checkpoint {candidate} in {self.directory} ({why}); "
                    "nothing was moved: fix the cause and resume again"
                )
            if elsewhere:  # damaged as one of the processes sees it: every process skips it
                p, _, why = elsewhere[0]
                skipped.append(self._set_aside(candidate, why if len(verdicts) == 1 else f"process {p}: {why}"))
                continue
            # read by every process: the checks run on the whole state (collectives), alike everywhere
            state, data = found
            finite, sums = inspect_state(state)
            if not finite:
                skipped.append(self._set_aside(candidate, "ValueError: state holds NaN or Inf"))
                continue
            differs = verify_checksums(sums, data.pop(CHECKSUMS, None))
            if differs is not None:
                reason = f"ValueError: {differs} does not hold the bits that were written (checksum)"
                skipped.append(self._set_aside(candidate, reason))
                continue
            return candidate, state, data
        raise NoReadableCheckpointError(
            f"none of the {len(steps)} checkpoints in {self.directory} can be read: " + "; ".join(skipped) + ". "
            "They were renamed <step>.unreadable-<time> (nothing deleted); rename one back to <step> to retry it"
        )

    def _read(self, step: int, abstract_state: Any, model_cfg: ModelConfig) -> tuple[str, Any]:
        """This process's read of checkpoint ``step`` -> ("ok", (state, data)), ("damaged", the
        error) or ("raise", the error to raise: another model or state structure, a storage error,
        out of memory). No collective: a process whose read failed must still reach the agreement.
        Reads with Orbax's handler, which holds no barrier (Orbax's restore waits for every process
        at its end, which a process whose read failed never reaches)."""
        directory = epath.Path(self.directory) / str(step)
        handler = ocp.CompositeCheckpointHandler()
        try:
            saved_model = handler.restore(directory, args=ocp.args.Composite(model=ocp.args.JsonRestore()))["model"]
            _check_same_model(saved_model, dataclasses.asdict(model_cfg), self.directory)
            restored = handler.restore(
                directory,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()),
            )
        except CheckpointMismatchError as error:
            return "raise", error
        except Exception as error:  # noqa: BLE001 (a read failure that is not a storage error: damaged)
            try:
                _raise_unless_damage(error, step, self.directory)
            except Exception as other:  # noqa: BLE001
                return "raise", other
            return "damaged", error
        finally:
            handler.close()  # its item handlers' resources, one handler per candidate read
        return "ok", (restored["state"], dict(restored["data"]))

    def _set_aside(self, step: int, reason: str) -> str:
        path = os.path.join(self.directory, str(step))
        aside = f"{path}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}"
        if os.path.exists(aside):  # the same step set aside twice within a second
            aside = f"{aside}-{len([n for n in os.listdir(self.directory) if n.startswith(os.path.basename(aside))])}"
        if jax.process_index() == 0 and os.path.isdir(path):
            os.rename(path, aside)
        # renamed before any process lists the steps again; every process names process 0's
        aside = distributed.agree(f"set-aside/{step}", aside)[0]
        self.manager.reload()
        self.say(f"[jvarlen] checkpoint {step} cannot be read ({reason}); moved to {aside}, trying an older one")
        return f"step {step}: {reason}"

    def wait(self) -> None:
        self._finish()

    def close(self) -> None:
        if self._abandoned:  # see check(): the failed save's threads are left to the process's end
            return
        try:
            self._finish()
            if self._saved:
                self._rotate(keep=self.cfg.max_to_keep)
        except BaseException:
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 (the failed save's error again; the first one is raised)
                pass
            raise
        self.manager.close()


# TensorStore (under Orbax) reports I/O failures as ValueError("PERMISSION_DENIED: ... [os_error_code='13']")
# inside a generic Exception, not as OSError; these status codes say nothing about the checkpoint
_STORAGE_STATUSES = ("PERMISSION_DENIED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "UNAUTHENTICATED", "ABORTED")
_MISSING = (errno.ENOENT, errno.ENOTDIR)  # the checkpoint's own: a file of it is not there


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and what it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    while error is not None and all(error is not seen for seen in chain):
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _storage_cause(error: BaseException) -> bool:
    if isinstance(error, OSError):
        return not isinstance(error, (FileNotFoundError, NotADirectoryError))
    text = str(error)
    code = re.search(r"os_error_code='?(\d+)", text)
    if code is not None:
        return int(code.group(1)) not in _MISSING
    return text.startswith(_STORAGE_STATUSES)


def is_storage_error(error: Exception) -> bool:
    """A failed read that says nothing about the checkpoint (EIO, a stale mount, permissions), as
    Python or TensorStore reports it anywhere in the error's chain: it may be fine. A missing file
    or a damaged one is the checkpoint's."""
    return any(_storage_cause(cause) for cause in _causes(error))


def read_error_summary(error: Exception) -> str:
    """One line naming a failed read: the type and first message line of the innermost error of its
    chain (TensorStore's status, not the array index Orbax wraps it in)."""
    root = _causes(error)[-1]
    text = f"{type(root).__name__}: {str(root).splitlines()[0] if str(root) else ''}"
    # TensorStore puts the cause last ("... File too large [os_error_code='27']"): keep both ends
    return text if len(text) <= 300 else f"{text[:140]} ... {text[-150:]}"


# Errors Orbax's background threads logged (a write that failed): the failure is known there at
# once, while Orbax raises it in the main thread only when the next save or close waits for them
_background_failures: list[BaseException] = []


class _OneLineStorageFailures(logging.Filter):
    """Notes the errors of Orbax's background save threads (:meth:`Checkpointer.check`) and drops
    the tracebacks of its records of a storage failure: each of its background threads logs the
    same failed write at ERROR with ~100 lines of traceback, and the run reports it once as a
    :class:`CheckpointWriteError`. The records keep their message (which holds the OS's reason);
    any other error keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.exc_info and f"{os.sep}orbax{os.sep}" in record.pathname):
            return True
        background = record.threadName != threading.main_thread().name
        if record.levelno >= logging.ERROR and background and record.exc_info[1] is not None:
            _background_failures.append(record.exc_info[1])
        if is_storage_error(record.exc_info[1]):
            record.exc_info = record.exc_text = None
        return True


def closed_loop_callback(unraisable) -> bool:
    """TensorStore completing the other writes of a failed save on the asyncio loop Orbax already
    closed: ``RuntimeError('Event loop is closed')`` from ``call_soon_threadsafe``, reported as an
    unraisable exception, dozens of times after one full disk."""
    error = unraisable.exc_value
    return (
        isinstance(error, RuntimeError)
        and str(error) == "Event loop is closed"
        and any(frame.name == "call_soon_threadsafe" for frame in traceback.extract_tb(unraisable.exc_traceback))
    )


def _quiet_storage_failures() -> None:
    """Installs, once per process, the two filters of a failed write's follow-on noise."""
    absl = logging.getLogger("absl")
    if any(isinstance(f, _OneLineStorageFailures) for f in absl.filters):
        return
    absl.addFilter(_OneLineStorageFailures())
    previous = sys.unraisablehook

    def hook(unraisable):
        if not closed_loop_callback(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook


def _verdict_text(found: Any) -> str:
    """What the other processes are told of this process's read (one line)."""
    if isinstance(found, BaseException):
        return " ".join(read_error_summary(found).split())[:1000]
    return ""


def _out_of_memory(error: Exception) -> bool:
    """The host or a device ran out of memory while reading (a state too large for this layout)."""
    return any(isinstance(c, MemoryError) or "RESOURCE_EXHAUSTED" in str(c) for c in _causes(error))


def _raise_unless_damage(error: Exception, step: int, directory: str) -> None:
    """Raises what a failed read of checkpoint ``step`` means when it is not damage."""
    if is_storage_error(error) or _out_of_memory(error):  # the checkpoint may well be fine
        raise error
    if isinstance(error, ValueError) and "structures do not match" in str(error):
        diff = "\n".join(str(error).splitlines()[1:9])
        raise CheckpointMismatchError(
            f"cannot resume from checkpoint {step} in {directory}: its train state has another structure than "
            "this run's (another optimizer chain or another jvarlen version wrote it); nothing was moved. "
            f"Differences (checkpoint: Metadata):\n{diff}"
        ) from None


def _check_same_model(saved: dict, current: dict, directory: str) -> None:
    # init_from only says where the first weights came from; a key that older checkpoints lack
    # (qkv_bias, rope_scaling) had its default value then
    shape_keys = [k for k in current if k not in ("attention", "remat", "compute_dtype", "init_from")]
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    diffs = [
        f"model.{key}: checkpoint has {saved.get(key, defaults[key])!r}, config has {current[key]!r}"
        for key in shape_keys
        if saved.get(key, defaults[key]) != current[key]
    ]
    if diffs:
        raise CheckpointMismatchError(
            f"cannot resume from {directory}: the checkpoint was written by a different model ("
            + "; ".join(diffs)
            + "). Use the original model settings or a fresh logging.run_dir."
        )


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a concrete pytree, as orbax restore targets."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
