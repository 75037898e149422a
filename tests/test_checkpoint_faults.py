"""Nothing lost to a checkpoint: a state with NaN never written, damage found by checksum and set
aside, rotation that keeps the newest good checkpoint, writes the file system refuses, storage
errors told from damage (docs/reliability.md, "Checkpoints"). Split from test_reliability.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import cli_env, flip_a_bit
from test_reliability import _state, train
from test_train import TINY_ARGS, _config

from jvarlen.config import ConfigError, parse_config
from jvarlen.runtime.checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    CheckpointWriteError,
    NonFiniteStateError,
    NoReadableCheckpointError,
    abstract_like,
    closed_loop_callback,
    is_storage_error,
    read_error_summary,
    state_checksums,
)
from jvarlen.runtime.state import TrainState


@pytest.fixture
def cache_dir(corpus_cache):
    return corpus_cache


def test_a_state_with_nan_is_never_written(tmp_path):
    config = parse_config(["--checkpoint.async_save=false"]).checkpoint
    ckpt = Checkpointer(tmp_path / "ckpt", config, say=lambda _: None)
    optimizer = optax.sgd(1.0)
    ckpt.save(1, _state(optimizer), {"pos": 1}, parse_config([]).model)
    with pytest.raises(NonFiniteStateError, match="newest good checkpoint .* is 1"):
        ckpt.save(2, _state(optimizer, value=float("nan")), {"pos": 2}, parse_config([]).model)
    ckpt.close()
    assert Checkpointer(tmp_path / "ckpt", config).all_steps() == [1]


def test_a_checkpoint_whose_bits_changed_is_set_aside(tmp_path):
    """Orbax's files carry no checksum: a flipped bit restored as a finite, wrong value. Every leaf's
    checksums are saved beside the state; a mismatch is damage (reported, set aside, an older one used)."""
    config = parse_config(["--checkpoint.async_save=false"]).checkpoint
    model = parse_config([]).model
    optimizer = optax.sgd(1.0)
    rng = np.random.default_rng(0)
    states = {}
    ckpt = Checkpointer(tmp_path / "ckpt", config, say=lambda _: None)
    for step in (1, 2):
        params = {"w": jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)}
        states[step] = TrainState(jnp.int32(step), params, optimizer.init(params), jnp.zeros((2,), jnp.uint32))
        ckpt.save(step, states[step], {"pos": step}, model)
    ckpt.close()
    flip_a_bit(tmp_path / "ckpt" / "2")
    said = []
    step, state, data = Checkpointer(tmp_path / "ckpt", config, say=said.append).restore(
        abstract_like(states[1]), model
    )
    assert step == 1 and data == {"pos": 1}  # the checksums are not part of the data position
    np.testing.assert_array_equal(state.params["w"], states[1].params["w"])
    assert "checkpoint 2 cannot be read (ValueError: params/w does not hold the bits that were written" in said[0]
    # the same bits give the same checksums whatever holds them (export reads the params as numpy)
    sums = state_checksums(states[1])
    host = state_checksums({"params": {"w": np.asarray(states[1].params["w"])}})
    assert host == {"params/w": sums["params/w"]}


def test_rotation_keeps_the_newest_good_checkpoint_when_a_save_fails(tmp_path, monkeypatch):
    config = parse_config(["--checkpoint.async_save=false", "--checkpoint.max_to_keep=1"]).checkpoint
    model = parse_config([]).model
    ckpt = Checkpointer(tmp_path / "ckpt", config, say=lambda _: None)
    optimizer = optax.sgd(1.0)
    for step in (1, 2, 3):
        ckpt.save(step, _state(optimizer, step), {"pos": step}, model)
    assert ckpt.all_steps() == [2, 3]  # the older one goes only once a newer one is finalized

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.manager, "save", broken_save)
    with pytest.raises(
        CheckpointWriteError, match=r"checkpoint 4 could not be written .*OSError: disk full.*from checkpoint 3"
    ):
        ckpt.save(4, _state(optimizer, 4), {"pos": 4}, model)
    assert ckpt.all_steps()[-1] == 3  # the newest good checkpoint survived the failed save
    monkeypatch.undo()
    ckpt.close()
    assert Checkpointer(tmp_path / "ckpt", config).all_steps() == [3]


def test_a_checkpoint_the_file_system_refuses_stops_the_run_naming_the_newest_complete_one(tmp_path, caplog):
    """A background save whose files cannot be written (here each file limited to 64 KiB, as a full
    disk refuses them; TensorStore reports OUT_OF_RANGE with the OS error) is a
    :class:`CheckpointWriteError` at the next save or wait, naming the step, the OS's reason and the
    checkpoint to resume from; nothing newer is listed and rotation deleted nothing (before: Orbax's
    traceback, which named neither). Orbax's own records of the failure keep their one-line message
    and lose their tracebacks (before: four of ~100 lines each)."""
    import resource

    config = parse_config(["--checkpoint.async_save=true", "--checkpoint.max_to_keep=1"]).checkpoint
    ckpt = Checkpointer(tmp_path / "ckpt", config, say=lambda _: None)
    optimizer = optax.sgd(1.0)

    def state(seed):  # 1 MiB of random weights (incompressible): files far above the limit
        params = {"w": jax.random.normal(jax.random.key(seed), (512, 512), jnp.float32)}
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), jnp.zeros((2,), jnp.uint32))

    model = parse_config([]).model
    ckpt.save(2, state(2), {"pos": 2}, model)
    ckpt.wait()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))  # Python ignores SIGXFSZ: writes fail EFBIG
    try:
        ckpt.save(4, state(4), {"pos": 4}, model)
        with pytest.raises(CheckpointWriteError) as failed:
            ckpt.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    message = str(failed.value)
    assert message.startswith(f"checkpoint 4 could not be written in {tmp_path / 'ckpt'} (")
    assert "File too large" in message and message.endswith("resume from checkpoint 2"), message
    assert ckpt.all_steps() == [2]
    orbax_errors = [r for r in caplog.records if "orbax" in r.pathname and r.levelno >= logging.ERROR]
    assert any("File too large" in r.getMessage() for r in orbax_errors), [r.getMessage() for r in orbax_errors]
    assert all(r.exc_info is None for r in orbax_errors)
    ckpt.close()  # the failure was raised once; nothing in flight now
    assert Checkpointer(tmp_path / "ckpt", config).all_steps() == [2]


def test_a_background_write_failure_is_raised_at_the_next_step_and_nothing_waits_for_orbax_after(tmp_path):
    """:meth:`Checkpointer.check` (every step) raises a save's background failure as soon as Orbax's
    thread has logged it, without waiting for the save (in a run of several processes that wait
    would not end: tests/test_multihost.py); :meth:`close` then waits for nothing and deletes
    nothing. Before the failure, and with no save in flight, it raises nothing."""
    import resource
    import time

    config = parse_config(["--checkpoint.async_save=true", "--checkpoint.max_to_keep=1"]).checkpoint
    ckpt = Checkpointer(tmp_path / "ckpt", config, say=lambda _: None)
    optimizer = optax.sgd(1.0)
    params = {"w": jax.random.normal(jax.random.key(0), (512, 512), jnp.float32)}
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), jnp.zeros((2,), jnp.uint32))
    model = parse_config([]).model
    ckpt.check()  # nothing in flight
    ckpt.save(2, state, {"pos": 2}, model)
    ckpt.wait()
    ckpt.check()  # a save that succeeded
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        ckpt.save(4, state, {"pos": 4}, model)
        deadline = time.time() + 60
        with pytest.raises(CheckpointWriteError, match="checkpoint 4 could not be written .*File too large"):
            while time.time() < deadline:
                ckpt.check()
                time.sleep(0.05)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    ckpt.wait()  # no second error, no wait
    ckpt.close()
    assert Checkpointer(tmp_path / "ckpt", config).all_steps() == [2]


def test_absl_logging_above_error_is_said_to_hide_background_write_failures(tmp_path):
    """:meth:`Checkpointer.check` learns of a background write failure from Orbax's ERROR record: a
    run whose absl logging drops it is told so when the checkpointer starts (not otherwise, and not
    with synchronous saves, whose failures raise in the save itself)."""
    import absl.logging

    said = []
    config = parse_config(["--checkpoint.async_save=true"]).checkpoint
    Checkpointer(tmp_path / "a", config, say=said.append).close()
    assert said == []
    level = logging.getLogger("absl").level
    absl.logging.set_verbosity(absl.logging.FATAL)
    try:
        Checkpointer(tmp_path / "b", config, say=said.append).close()
        sync = parse_config(["--checkpoint.async_save=false"]).checkpoint
        Checkpointer(tmp_path / "c", sync, say=said.append).close()
    finally:
        logging.getLogger("absl").setLevel(level)
    assert len(said) == 1 and said[0].startswith("note: absl logging is set above ERROR")


def test_only_the_closed_loop_callbacks_of_a_failed_write_are_silenced():
    """The unraisable ``Event loop is closed`` that TensorStore's late callbacks raise after a failed
    save (dozens per full disk) is recognised from its real traceback; other unraisables are not."""
    import asyncio
    import types

    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as error:
        closed = error
    other = RuntimeError("Event loop is closed")  # the same words raised elsewhere
    assert closed_loop_callback(types.SimpleNamespace(exc_value=closed, exc_traceback=closed.__traceback__))
    assert not closed_loop_callback(types.SimpleNamespace(exc_value=other, exc_traceback=None))
    try:
        raise ValueError("Event loop is closed")
    except ValueError as error:
        assert not closed_loop_callback(types.SimpleNamespace(exc_value=error, exc_traceback=error.__traceback__))


def _damage(step_dir):
    """Overwrites every file of a checkpoint's state with garbage of the same size."""
    for root, _, files in os.walk(step_dir):
        for name in files:
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            with open(path, "wb") as f:
                f.write(b"\x13" * max(size, 7))


def test_resume_falls_back_past_a_damaged_checkpoint_and_logs_each_step_once(tmp_path, cache_dir, capsys):
    run_dir = tmp_path / "run"
    args = ("--train.steps=4", "--checkpoint.every_steps=2", "--checkpoint.max_to_keep=3")
    first = train(_config(run_dir, cache_dir, *args), quiet=True)
    ckpt_dir = run_dir / "checkpoints"
    _damage(ckpt_dir / "4")
    # as if the process had died after logging steps 3-4 while writing checkpoint 4
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    resumed = train(_config(run_dir, cache_dir, *args, "--checkpoint.resume=true"))
    out = capsys.readouterr().out
    assert "checkpoint 4 cannot be read" in out and "resumed from step 2" in out
    assert resumed.first_step == 2
    np.testing.assert_array_equal(resumed.losses, first.losses[2:])  # bitwise: steps 3-4 again, same data
    assert any(name.startswith("4.unreadable-") for name in os.listdir(ckpt_dir))
    steps = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4]
    # every checkpoint damaged: a clear error, nothing trained
    for step in Checkpointer(ckpt_dir, parse_config([]).checkpoint).all_steps():
        _damage(ckpt_dir / str(step))
    with pytest.raises(NoReadableCheckpointError, match="none of the 2 checkpoints.*rename one back"):
        train(_config(run_dir, cache_dir, *args, "--checkpoint.resume=true"), quiet=True)
    # resumed again: refused, not started over (which would drop the run's records)
    with pytest.raises(ConfigError, match=r"set aside 3 it could not read \(2\.unreadable-.*logging\.overwrite"):
        train(_config(run_dir, cache_dir, *args, "--checkpoint.resume=true"), quiet=True)
    assert [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_train_state_of_another_structure_is_refused_and_not_set_aside(tmp_path, cache_dir, monkeypatch):
    """A checkpoint whose train state another optimizer chain wrote (as another jvarlen version
    may) is a mismatch, not damage, and a storage error or a device out of memory is not damage:
    all refused, every checkpoint left where it is."""
    import jvarlen.runtime.state as state_module

    run_dir = tmp_path / "run"
    args = ("--train.steps=4", "--checkpoint.every_steps=2")
    train(_config(run_dir, cache_dir, *args), quiet=True, stop_after=2)
    chain = state_module.make_optimizer
    monkeypatch.setattr(state_module, "make_optimizer", lambda *a: optax.chain(chain(*a), optax.scale(1.0)))
    with pytest.raises(CheckpointMismatchError, match="checkpoint 2 .* another structure .*nothing was moved"):
        train(_config(run_dir, cache_dir, *args, "--checkpoint.resume=true"), quiet=True)
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2"]
    monkeypatch.setattr(state_module, "make_optimizer", chain)
    # a storage error is not damage either: raised as it is, nothing moved
    import errno

    import orbax.checkpoint as ocp

    def failing_read(*_, **__):
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(ocp.CompositeCheckpointHandler, "restore", failing_read)
        with pytest.raises(OSError, match="Input/output error"):
            train(_config(run_dir, cache_dir, *args, "--checkpoint.resume=true"), quiet=True)
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2"]

    # nor is a device out of memory while restoring (the state is too large for this layout)
    def out_of_memory(*_, **__):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")

    with monkeypatch.context() as m:
        m.setattr(ocp.CompositeCheckpointHandler, "restore", out_of_memory)
        with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
            train(_config(run_dir, cache_dir, *args, "--checkpoint.resume=true"), quiet=True)
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2"]
    assert train(_config(run_dir, cache_dir, *args, "--checkpoint.resume=true"), quiet=True).first_step == 2


def test_a_checkpoint_file_that_cannot_be_opened_is_a_storage_error_not_damage(tmp_path, cache_dir):
    """A data file of the newest checkpoint the process may not read (a shared file system with wrong
    permissions): TensorStore's PERMISSION_DENIED, wrapped by Orbax in a plain Exception, is raised as
    it is and nothing is moved (before: taken for damage, the checkpoint renamed aside and the run
    resumed from the older one, its steps redone). Root ignores file modes, so as root the resume
    runs without the capabilities that let it."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: a file mode cannot deny a read")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    run_dir = tmp_path / "run"
    args = ("--train.steps=6", "--checkpoint.every_steps=2")
    train(_config(run_dir, cache_dir, *args), quiet=True, stop_after=4)
    data = run_dir / "checkpoints" / "4" / "state" / "ocdbt.process_0" / "d"
    for f in data.iterdir():
        f.chmod(0)
    cli = [*prefix, sys.executable, "-m", "jvarlen.train", *TINY_ARGS, "--model.attention=reference"]
    cli += [f"--logging.run_dir={run_dir}", f"--data.cache_dir={cache_dir}", *args, "--checkpoint.resume=true"]
    proc = subprocess.run(cli, env=cli_env(values_only=True), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "PERMISSION_DENIED" in proc.stderr, proc.stderr[-2000:]
    assert "resumed from" not in proc.stdout
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4"]
    for f in data.iterdir():
        f.chmod(0o644)
    assert train(_config(run_dir, cache_dir, *args, "--checkpoint.resume=true"), quiet=True).first_step == 4


def test_storage_errors_are_told_from_damage_through_the_error_chain():
    """What Orbax raises around TensorStore's status: a permission or I/O failure anywhere in the
    chain is a storage error; a missing file or undecodable data is the checkpoint's damage."""

    def wrapped(inner: Exception) -> Exception:
        try:
            try:
                raise inner
            except Exception as error:
                raise Exception("Encountered error while reading array index: (slice(0, 2, 1),)") from error
        except Exception as outer:
            return outer

    denied = ValueError("PERMISSION_DENIED: Error reading \"params/0\" ...: Permission denied [os_error_code='13']")
    io = ValueError("UNKNOWN: Error reading ...: Input/output error [os_error_code='5']")
    missing = ValueError("NOT_FOUND: Error reading ...: No such file or directory [os_error_code='2']")
    corrupt = ValueError("DATA_LOSS: Error decoding ...: invalid zstd frame")
    assert is_storage_error(wrapped(denied)) and is_storage_error(wrapped(io))
    assert is_storage_error(wrapped(ValueError("UNAVAILABLE: connection reset")))
    assert is_storage_error(OSError(5, "Input/output error"))
    assert not is_storage_error(wrapped(missing)) and not is_storage_error(wrapped(corrupt))
    assert not is_storage_error(FileNotFoundError(2, "gone"))
    assert read_error_summary(wrapped(denied)).startswith("ValueError: PERMISSION_DENIED: Error reading")


def test_a_step_orbax_declines_is_a_write_error_not_a_silent_skip(tmp_path):
    """Orbax returns False, without an error, for a step at or below the newest it holds (before,
    the run went on as if step 1 were written; a resume then took up the other run's step 3)."""
    config = parse_config(["--checkpoint.async_save=false"]).checkpoint
    model, optimizer = parse_config([]).model, optax.sgd(1.0)
    earlier = Checkpointer(tmp_path / "ckpt", config, say=lambda _: None)
    earlier.save(3, _state(optimizer), {"pos": 3}, model)
    earlier.close()
    later = Checkpointer(tmp_path / "ckpt", config, say=lambda _: None)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint 1 was not written: .* already holds checkpoint 3"):
        later.save(1, _state(optimizer), {"pos": 1}, model)
    later.manager.save = lambda *args, **kwargs: False  # declined for a reason the check before it cannot see
    with pytest.raises(CheckpointWriteError, match=r"checkpoint 4 was not written"):
        later.save(4, _state(optimizer), {"pos": 4}, model)
    later.close()
    assert Checkpointer(tmp_path / "ckpt", config).all_steps() == [3]


def test_overwrite_empties_a_checkpoint_directory_linked_to_another_disk(tmp_path, cache_dir):
    """``checkpoints/`` a link to another disk: ``logging.overwrite`` empties the link's target and
    keeps the link (before, rmtree refused the link without a word, so the earlier run's steps 1-2
    stayed and Orbax declined the new run's saves); a linked ``metrics.jsonl`` is kept as well."""
    run_dir, store, records = tmp_path / "r", tmp_path / "store", tmp_path / "records.jsonl"
    run_dir.mkdir()
    store.mkdir()
    os.symlink(store, run_dir / "checkpoints")
    records.touch()
    os.symlink(records, run_dir / "metrics.jsonl")  # kept too: emptied there by the overwrite, kept by a resume
    train(_config(run_dir, cache_dir, "--train.steps=2", "--checkpoint.every_steps=1"), quiet=True)
    assert sorted(os.listdir(store)) == ["1", "2"]
    train(_config(run_dir, cache_dir, "--train.steps=1", "--logging.overwrite=true"), quiet=True)
    assert os.path.islink(run_dir / "checkpoints") and os.path.islink(run_dir / "metrics.jsonl")
    assert os.listdir(store) == ["1"]
    assert [json.loads(line)["step"] for line in records.read_text().splitlines()] == [1]
    # a resume that drops records after its checkpoint rewrites the link's target (before: replaced the link)
    records.write_text(records.read_text() + json.dumps({"step": 2}) + "\n")
    train(_config(run_dir, cache_dir, "--train.steps=2", "--checkpoint.resume=true"), quiet=True)
    assert os.path.islink(run_dir / "metrics.jsonl")
    assert [json.loads(line)["step"] for line in records.read_text().splitlines()] == [1, 2]
