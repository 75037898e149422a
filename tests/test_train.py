"""The training loop end to end: the CLI, checkpoints, exact resume."""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import cli_env, values_compile
from tiny_flags import TINY_MODEL_ARGS

from jvarlen.config import ConfigError, parse_config
from jvarlen.data.errors import UnreadableFileError
from jvarlen.runtime.checkpoint import CheckpointMismatchError
from jvarlen.runtime.loop import train as _train

TINY_ARGS = [
    *TINY_MODEL_ARGS,
    "--data.seq_len=128",
    "--data.tokens_per_batch=1024",
    "--data.max_documents=60",
    "--logging.tensorboard=false",
    "--logging.progress_bar=false",
    "--parallel.pp=1",
]


def train(config, **kwargs):
    """jvarlen's training loop, compiling with the values-only options of conftest.values_compile."""
    return _train(config, compiler_options=values_compile(), **kwargs)


@pytest.fixture
def cache_dir(corpus_cache):
    return corpus_cache


def _config(run_dir, cache_dir, *extra):
    """In-process runs use dense reference attention (cheap to compile at T=128); the
    CLI test keeps the default implementation."""
    return parse_config(
        [
            *TINY_ARGS,
            "--model.attention=reference",
            f"--logging.run_dir={run_dir}",
            f"--data.cache_dir={cache_dir}",
            *extra,
        ]
    )


def test_cli_runs_three_steps_and_writes_metrics_and_checkpoint(tmp_path, cache_dir):
    # no device count: the entry point gives the host platform the 2 devices dp = 2 asks for (before,
    # only the pipeline and group paths got theirs)
    run_dir = tmp_path / "run"
    env = cli_env(values_only=True)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jvarlen.train",
            *TINY_ARGS,
            "--parallel.dp=2",
            f"--logging.run_dir={run_dir}",
            f"--data.cache_dir={cache_dir}",
            "--train.steps=3",
            "--checkpoint.every_steps=2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(run_dir) in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) and r["real_tokens"] > 0 for r in records)
    assert all((r["dp"], r["sp"]) == (2, 1) for r in records), records[0]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "3"]
    # model FLOP/s over the step's own seconds and both devices; no mfu on a CPU (no peak known)
    for r in records:
        assert r["model_tflops"] > 0 and "mfu" not in r
        assert r["tflops_per_device"] == pytest.approx(r["model_tflops"] / r["step_seconds"] / 2)
    assert "model TFLOP/s per device), " in proc.stdout


def test_the_entry_point_gives_a_cpu_host_the_devices_of_the_layout():
    from jvarlen.train import host_device_flags

    assert host_device_flags("", 4) == "--xla_force_host_platform_device_count=4"
    assert host_device_flags("--xla_dump_to=/d", 2) == "--xla_dump_to=/d --xla_force_host_platform_device_count=2"
    assert host_device_flags("--xla_force_host_platform_device_count=8", 2).endswith("count=8")  # the user's count
    assert host_device_flags("", 1) == ""
    from jvarlen.config import parse_config
    from jvarlen.layout import requested_devices

    # every degree of an sp cycle divides the devices (before: sp_cycle=[1, 2] got 1 device and was refused)
    assert requested_devices(parse_config(["--parallel.sp_cycle=[1,2]"])) == 2
    assert (
        requested_devices(parse_config(["--parallel.sp_cycle=[2,4,3]", "--model.num_heads=12", "--model.d_model=192"]))
        == 12
    )
    assert requested_devices(parse_config(["--parallel.pp=1", "--parallel.sp=2"])) == 2


def test_cli_reports_config_errors(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jvarlen.train", "--model.num_heads=6", "--model.num_kv_heads=4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "num_kv_heads" in proc.stderr


def test_cli_reports_unknown_arguments_without_traceback(capsys):
    from jvarlen.train import main

    assert main(["--train.no_such_field=1"]) == 2  # parsed before any JAX work
    assert "unrecognized arguments: --train.no_such_field=1" in capsys.readouterr().err


def test_cli_reports_data_errors_without_traceback(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jvarlen.train",
            "--data.source=jsonl",
            f"--data.path={tmp_path}/missing.jsonl",
            f"--logging.run_dir={tmp_path}/run",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "missing.jsonl" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_resume_bitwise(tmp_path, cache_dir):
    full = train(_config(tmp_path / "full", cache_dir, "--train.steps=4", "--checkpoint.every_steps=2"), quiet=True)
    part_dir = tmp_path / "part"
    part = train(
        _config(part_dir, cache_dir, "--train.steps=4", "--checkpoint.every_steps=2"), quiet=True, stop_after=2
    )
    resumed = train(
        _config(part_dir, cache_dir, "--train.steps=4", "--checkpoint.every_steps=2", "--checkpoint.resume=true"),
        quiet=True,
    )
    assert resumed.first_step == 2
    assert part.losses + resumed.losses == full.losses  # bitwise on CPU
    for a, b in zip(jax.tree.leaves(full.final_state.params), jax.tree.leaves(resumed.final_state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_resumed_run_takes_up_the_cost_refit_of_its_checkpoint(tmp_path, cache_dir, capsys):
    """The online cost refit is kept in each checkpoint and taken up on resume (before: a resumed
    run predicted from the profile again)."""
    from conftest import SHIPPED_CPU_PROFILE

    args = ("--train.steps=4", "--checkpoint.every_steps=2", f"--train.cost_profile={SHIPPED_CPU_PROFILE}")
    args += ("--train.cost_refit_every=1",)
    train(_config(tmp_path / "r", cache_dir, *args), quiet=True, stop_after=3)
    capsys.readouterr()
    train(_config(tmp_path / "r", cache_dir, *args, "--checkpoint.resume=true"))
    out = capsys.readouterr().out
    assert "resumed from step 3" in out  # stop_after checkpoints the last step reached
    taken = [line for line in out.splitlines() if "the refit of the resumed run taken up" in line]
    assert taken and "(0 refits)" not in taken[0], out


def test_resume_from_different_model_shape_is_refused(tmp_path, cache_dir):
    train(_config(tmp_path / "r", cache_dir, "--train.steps=1"), quiet=True)
    with pytest.raises(CheckpointMismatchError, match="model.d_model: checkpoint has 32, config has 64"):
        train(
            _config(tmp_path / "r", cache_dir, "--train.steps=2", "--model.d_model=64", "--checkpoint.resume=true"),
            quiet=True,
        )


def test_fresh_run_refuses_a_run_directory_holding_an_earlier_run(tmp_path, cache_dir, monkeypatch):
    """Without resume, a run_dir with an earlier run's records and checkpoints is refused before
    anything in it changes; ``logging.overwrite`` starts over in it. The first run names it
    ``~/r`` (a ``--flag=~/r`` no shell expands; before, a directory named ``~`` was made)."""
    run_dir = tmp_path / "r"
    monkeypatch.setenv("HOME", str(tmp_path))
    first = train(_config("~/r", cache_dir, "--train.steps=2", "--checkpoint.every_steps=2"), quiet=True)
    assert first.run_dir == str(run_dir) and not os.path.exists("~")
    before = (run_dir / "metrics.jsonl").read_text()
    assert len(before.splitlines()) == 2
    with pytest.raises(ConfigError, match=r"holds an earlier run \(2 metric records and checkpoints of steps 2\)"):
        train(_config(run_dir, cache_dir, "--train.steps=3"), quiet=True)
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert os.listdir(run_dir / "checkpoints") == ["2"]
    # an overwrite whose configuration is refused (data path, then the step builder) deletes nothing
    with pytest.raises(UnreadableFileError, match="does not exist"):
        train(
            _config(
                run_dir, cache_dir, "--logging.overwrite=true", "--data.source=jsonl", "--data.path=/no/docs.jsonl"
            ),
            quiet=True,
        )
    with pytest.raises(ConfigError, match="unknown residual policy 'bogus'"):
        train(
            _config(
                run_dir, cache_dir, "--logging.overwrite=true", "--parallel.pp=2", "--parallel.residual_policy=bogus"
            ),
            quiet=True,
        )
    # the data-parallel path reads train.cost_profile after the strategy is made (before: after
    # start_logging had deleted the earlier run, and with the signal handlers left installed)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(ConfigError, match="train.cost_profile '/no/profile.json' does not exist"):
        train(_config(run_dir, cache_dir, "--logging.overwrite=true", "--train.cost_profile=/no/profile.json"))
    assert signal.getsignal(signal.SIGINT) is handler
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert os.listdir(run_dir / "checkpoints") == ["2"]
    again = train(_config(run_dir, cache_dir, "--train.steps=1", "--logging.overwrite=true"), quiet=True)
    assert again.losses == first.losses[:1]  # a fresh run from step 0
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1
    assert os.listdir(run_dir / "checkpoints") == ["1"]  # the earlier run's step 2 is gone


def test_a_run_directory_in_use_by_another_run_is_refused(tmp_path, cache_dir):
    """A second run started in the directory of one still running (starting: nothing written yet)
    is refused naming the holder, before it reads or writes anything there; once the first ends
    (its lock released, as a process's end releases it), a run starts there."""
    from jvarlen.runtime.run_lock import RunDirLock

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    other = RunDirLock.acquire(str(run_dir), say=print)  # another open file: flock refuses this process too
    try:
        with pytest.raises(ConfigError, match=rf"'{run_dir}' is in use by another run \(pid {os.getpid()} on "):
            train(_config(run_dir, cache_dir, "--train.steps=1"), quiet=True)
        assert sorted(os.listdir(run_dir)) == [".lock"]
    finally:
        other.release()
    assert len(train(_config(run_dir, cache_dir, "--train.steps=1"), quiet=True).losses) == 1


def test_config_error_found_at_start_leaves_a_resumable_run_untouched(tmp_path, cache_dir):
    """A configuration refused when the run starts (here a residual policy the step builder does
    not know, with the pipeline path) keeps the records, config and checkpoints of the run it was
    to resume (before, its smaller ``max_to_keep`` deleted checkpoints on the way out)."""
    run_dir = tmp_path / "r"
    train(_config(run_dir, cache_dir, "--train.steps=2", "--checkpoint.every_steps=1"), quiet=True)
    metrics, config = (run_dir / "metrics.jsonl").read_text(), (run_dir / "config.json").read_text()
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2"]
    with pytest.raises(ConfigError, match="unknown residual policy 'bogus'"):
        train(
            _config(
                run_dir,
                cache_dir,
                "--train.steps=3",
                "--checkpoint.resume=true",
                "--parallel.pp=2",
                "--parallel.residual_policy=bogus",
                "--checkpoint.max_to_keep=1",
            ),
            quiet=True,
        )
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert (run_dir / "config.json").read_text() == config
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2"]
    with pytest.raises(ConfigError, match="train.cost_profile '/no/profile.json' does not exist"):
        resume = ("--train.steps=3", "--checkpoint.resume=true", "--optimizer.learning_rate=0.5")
        train(_config(run_dir, cache_dir, *resume, "--train.cost_profile=/no/profile.json"), quiet=True)
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert sorted(os.listdir(run_dir)) == [".lock", "checkpoints", "config.json", "metrics.jsonl"]
    assert (run_dir / "config.json").read_text() == config


def test_learning_rate_warms_up_from_the_first_update_and_ends_at_the_final_rate():
    """No update runs at zero (the first warmup update is at peak / warmup), and the last update of
    the run uses ``min_lr_ratio · peak`` (before: the first update ran at zero, and the decay ended
    one update after the run)."""
    from jvarlen.config import OptimizerConfig
    from jvarlen.runtime.state import learning_rate_schedule

    def rates(warmup, steps):
        cfg = OptimizerConfig(learning_rate=1.0, warmup_steps=warmup, min_lr_ratio=0.1)
        return [float(learning_rate_schedule(cfg, steps)(i)) for i in range(steps)]

    r = rates(4, 20)
    assert r[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0]) and r[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(r[3:], r[4:]))  # no rise after the peak
    assert rates(0, 20)[0] == pytest.approx(1.0) and rates(0, 20)[-1] == pytest.approx(0.1)
    assert rates(10, 5) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])  # warmup cut to the run (reported)
    assert rates(0, 1) == pytest.approx([1.0])
