"""Nothing lost, nothing silent: non-finite steps, checkpoint fallback and rotation, signals, process
hygiene, metrics after resume, and the answers to bad input (docs/reliability.md lists them all)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import cli_env, values_compile
from test_train import TINY_ARGS, _config

from jvarlen.config import ConfigError, parse_config
from jvarlen.runtime.checkpoint import (
    Checkpointer,
)
from jvarlen.runtime.loop import NonFiniteError
from jvarlen.runtime.loop import train as _train
from jvarlen.runtime.metrics import truncate_records
from jvarlen.runtime.state import TrainState
from jvarlen.runtime.step import apply_gradients


def train(config, **kwargs):
    """jvarlen's training loop, compiling with the values-only options of conftest.values_compile."""
    return _train(config, compiler_options=values_compile(), **kwargs)


@pytest.fixture
def cache_dir(corpus_cache):
    return corpus_cache


def _state(optimizer, value=1.0):
    params = {"w": jnp.full((4,), value, jnp.float32)}
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), jnp.zeros((2,), jnp.uint32))


# ------------------------------------------------------------------------------------- non-finite steps


@pytest.mark.parametrize("bad", ["nan_grad", "inf_loss", "huge_update"])
def test_a_non_finite_step_keeps_the_state_and_counts(bad):
    optimizer = optax.adam(1.0)
    state = _state(optimizer)
    grads = {"w": jnp.full((4,), jnp.nan if bad == "nan_grad" else 1.0)}
    sums = {
        "loss_sum": jnp.float32(jnp.inf if bad == "inf_loss" else 2.0),
        "target_tokens": jnp.float32(3),
        "real_tokens": jnp.float32(3),
    }
    if bad == "huge_update":
        optimizer = optax.sgd(3e38)
        state = _state(optimizer)
        grads = {"w": jnp.full((4,), 10.0)}
    new, metrics = jax.jit(lambda s, g, m: apply_gradients(optimizer, s, g, m))(state, grads, sums)
    assert float(metrics["nonfinite"]) == 1.0 and int(new.step) == 1
    np.testing.assert_array_equal(new.params["w"], state.params["w"])
    for a, b in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(a, b)


def test_a_finite_step_updates():
    optimizer = optax.sgd(0.5)
    state = _state(optimizer)
    sums = {"loss_sum": jnp.float32(2.0), "target_tokens": jnp.float32(3), "real_tokens": jnp.float32(3)}
    new, metrics = apply_gradients(optimizer, state, {"w": jnp.ones(4)}, sums)
    assert float(metrics["nonfinite"]) == 0.0 and float(metrics["real_tokens"]) == 3.0
    np.testing.assert_allclose(new.params["w"], 0.5)


def test_training_stops_after_consecutive_non_finite_steps(tmp_path, cache_dir):
    """A learning rate that overflows every update: each step is skipped (logged, counted), the
    second in a row stops the run with NonFiniteError; the checkpoint of step 1 holds the last
    finite state (the initial one), step 2's is not written."""
    run_dir = tmp_path / "run"
    config = _config(
        run_dir,
        cache_dir,
        "--train.steps=8",
        "--train.max_nonfinite_steps=2",
        "--optimizer.learning_rate=3e38",
        "--optimizer.warmup_steps=0",
        "--optimizer.grad_clip_norm=1e38",
        "--checkpoint.every_steps=1",
    )
    with pytest.raises(NonFiniteError, match="2 steps in a row"):
        train(config, quiet=True)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2]
    assert [r["nonfinite"] for r in records] == [1, 1] and records[-1]["nonfinite_steps"] == 2
    assert all(np.isfinite(r["loss"]) for r in records)  # the state never took the overflowing update
    assert Checkpointer(run_dir / "checkpoints", config.checkpoint).all_steps() == [1]
    # a skipped update leaves the optimizer's count where it was: the schedule (and the logged rate) too
    assert records[1]["learning_rate"] == records[0]["learning_rate"] == pytest.approx(3e38)
    # the checkpoint keeps the run of skipped steps: resumed with the same rate, step 2 is the second in a row
    with pytest.raises(NonFiniteError, match=r"2 steps in a row \(up to step 2\)"):
        train(dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, resume=True)), quiet=True)
    assert Checkpointer(run_dir / "checkpoints", config.checkpoint).all_steps() == [1]
    # ... also across a resume (the checkpoint keeps the skipped count): step 2 runs at the schedule's
    # first rate (here of a finite learning rate and another horizon)
    resumed = _config(run_dir, cache_dir, "--train.steps=3", "--optimizer.warmup_steps=0", "--checkpoint.resume=true")
    train(resumed, quiet=True)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3] and records[1]["nonfinite"] == 0
    assert records[1]["learning_rate"] == pytest.approx(resumed.optimizer.learning_rate)
    assert records[1]["nonfinite_steps"] == 1


def test_resume_checks_the_horizon():
    from jvarlen.runtime.run import _check_horizon

    said = []
    with pytest.raises(ConfigError, match="train.steps=4 is below the checkpoint's step 6"):
        _check_horizon(6, 4, 8, said.append)
    _check_horizon(6, 10, 8, said.append)
    _check_horizon(6, 6, 6, said.append)
    assert said == [
        "[jvarlen] train.steps changed from 8 (the checkpoint's run) to 10: the learning-rate schedule now decays "
        "over the new horizon",
        "[jvarlen] the checkpoint is at step 6 = train.steps: nothing left to train",
    ]


def test_a_resume_with_other_optimizer_settings_says_so_and_keeps_the_earlier_config(tmp_path, cache_dir, capsys):
    """A resume whose settings differ keeps the earlier config.json; one that only sets
    ``checkpoint.resume`` keeps none (before: every first resume kept a copy)."""
    run_dir = tmp_path / "run"
    args = ("--train.steps=4", "--checkpoint.every_steps=1")
    train(_config(run_dir, cache_dir, *args), quiet=True, stop_after=1)
    train(_config(run_dir, cache_dir, *args, "--checkpoint.resume=true"), quiet=True, stop_after=2)
    assert sorted(p.name for p in run_dir.glob("config*.json")) == ["config.json"]
    first = json.loads((run_dir / "config.json").read_text())
    changed = ("--optimizer.learning_rate=0.001", "--optimizer.b2=0.99", "--checkpoint.resume=true")
    train(_config(run_dir, cache_dir, *args, *changed))
    out = capsys.readouterr().out
    assert (
        "optimizer settings differ from the checkpoint's run: learning_rate 0.003 -> 0.001, b2 0.95 -> 0.99; "
        "the updates after step 2 use the new ones (the earlier config: config.until-step-2.json)"
    ) in out
    assert json.loads((run_dir / "config.until-step-2.json").read_text()) == first
    assert json.loads((run_dir / "config.json").read_text())["optimizer"]["learning_rate"] == 0.001
    # the same settings again (at step 4, nothing left to train): nothing said, nothing kept
    train(_config(run_dir, cache_dir, *args, *changed))
    assert "optimizer settings differ" not in capsys.readouterr().out
    assert sorted(p.name for p in run_dir.glob("config*.json")) == ["config.json", "config.until-step-2.json"]


# ------------------------------------------------------------------------------------- metrics after resume


def _tensorboard_events(path):
    """The Event protos of one TensorBoard event file (TFRecord: length, its CRC, data, data CRC)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    events = []
    with open(path, "rb") as f:
        while len(header := f.read(12)) == 12:
            events.append(Event.FromString(f.read(struct.unpack("<Q", header[:8])[0])))
            f.read(4)
    return events


def test_a_run_that_starts_over_purges_the_earlier_tensorboard_steps(tmp_path):
    """A resume that finds no checkpoint starts at step 0: metrics.jsonl drops the earlier records,
    and TensorBoard gets a purge (SessionLog START at step 1) so that no step shows twice."""
    from tensorboardX.proto.event_pb2 import SessionLog

    from jvarlen.config import LoggingConfig
    from jvarlen.runtime.metrics import MetricsLogger

    cfg = LoggingConfig(run_dir=str(tmp_path), progress_bar=False)
    for _ in range(2):
        logger = MetricsLogger(str(tmp_path), cfg, total_steps=3, initial_step=0)
        for step in (1, 2):
            logger.log(step, {"loss": 1.0})
        logger.close()
        time.sleep(1.1)  # event files are named by the second they were opened in
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2]
    second = sorted((tmp_path / "tensorboard").iterdir())[-1]
    starts = [e.step for e in _tensorboard_events(second) if e.session_log.status == SessionLog.START]
    assert starts == [1]


def test_non_finite_metrics_are_written_as_json_null(tmp_path):
    """A step with a NaN loss wrote ``NaN`` into metrics.jsonl, which is not JSON: jq and other
    strict readers refused the whole file."""
    from jvarlen.config import LoggingConfig
    from jvarlen.runtime.metrics import MetricsLogger

    logger = MetricsLogger(str(tmp_path), LoggingConfig(run_dir=str(tmp_path), progress_bar=False), total_steps=2)
    logger.log(1, {"loss": float("nan"), "nonfinite": True, "estimates": [1.5, float("inf")], "g": {"x": -math.inf}})
    logger.log(2, {"loss": 2.5, "nonfinite": False})
    logger.close()

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    records = [json.loads(line, parse_constant=refuse) for line in open(tmp_path / "metrics.jsonl")]
    assert records == [
        {"step": 1, "loss": None, "nonfinite": True, "estimates": [1.5, None], "g": {"x": None}},
        {"step": 2, "loss": 2.5, "nonfinite": False},
    ]


def test_truncate_records_drops_later_steps_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    assert truncate_records(str(path), 3) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert truncate_records(str(path), 3) == 0


# ------------------------------------------------------------------------------------- signals, processes


def test_sigterm_checkpoints_the_current_step_and_exits_143(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    env = cli_env(1, values_only=True, PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "jvarlen.train",
        *TINY_ARGS,
        "--model.attention=reference",
        "--train.steps=200",
        "--checkpoint.every_steps=100",
        f"--logging.run_dir={run_dir}",
        f"--data.cache_dir={cache_dir}",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "SIGTERM received" in out and "continue with --checkpoint.resume=true" in out
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    steps = Checkpointer(run_dir / "checkpoints", parse_config([]).checkpoint).all_steps()
    assert steps == [logged[-1]] and 2 <= logged[-1] < 100


def test_planner_workers_exit_when_the_trainer_is_killed(tmp_path):
    """SIGKILL gives the trainer no chance to shut its planning pool down: the workers notice
    their parent is gone and exit by themselves."""
    parent = textwrap.dedent(
        """
        import sys, time
        from conftest import small_cost
        from jvarlen.plan.service import PlanningService
        svc = PlanningService(small_cost(pp=2, sp=1), delay_s=60.0)
        svc.submit(0, [1000, 2000])
        while not [p for p in svc._pool._processes.values() if p.pid]:
            time.sleep(0.05)
        print(" ".join(str(p.pid) for p in svc._pool._processes.values()), flush=True)
        time.sleep(600)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, env=env)
    workers = [int(pid) for pid in proc.stdout.readline().split()]
    assert workers and all(os.path.exists(f"/proc/{pid}") for pid in workers)
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers), "planner workers outlived the killed trainer"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------------------------- bad input


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    from jvarlen.plan.__main__ import main as plan_main
    from jvarlen.train import main as train_main

    assert train_main(["--data.source=bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "invalid choice: 'bogus'" in err and "'jsonl'" in err

    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: [1, 2\n")
    assert train_main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "is not valid YAML" in err and "line 2, column 12" in err  # the parser's own words

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n# a comment\nabc\n")
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "default.yaml")
    cases = [
        (["--lengths", str(lengths), "--config", config], f"{lengths}:3: document length must be a whole number"),
        (["--lengths", str(tmp_path), "--config", config], "cannot read it (Is a directory)"),
        (["--lengths", str(tmp_path / "none"), "--config", config], "cannot read it (No such file or directory)"),
        (["--lengths", str(lengths), "--config", config, "--policy", "x"], "--policy must be one of epp"),
        (["--lengths", str(lengths), "--config", str(tmp_path / "no.yaml")], "does not exist"),
        (["--lengths", str(lengths), "--config", config, "--iterations", "x"], "Couldn't parse 'x'"),
        (["--lengths", str(lengths), "--config", config, "--json", "/no/dir/x.json"], "--json /no/dir/x.json: its"),
        ([f"--lengths={lengths}", f"--config={config}", "--json=/no/my-dir/x-1.json"], "/no/my-dir/x-1.json"),
        (["--lengths", str(lengths), "--config", config, "--policy", "hydraulis", "--n_slices", "3"], "does not read"),
        (["--lengths", str(lengths), "--config", config, "--policy", "dapple", "--n_slices", "3"], "fixes EPP's N"),
        # refused before planning (before: a matplotlib traceback after it, the --json results lost; and
        # one output silently replacing another)
        (["--lengths", str(lengths), "--config", config, "--gantt", str(tmp_path / "g.txt")], "name a .png, .pdf"),
        (
            [f"--lengths={lengths}", f"--config={config}", f"--json={tmp_path}/o.json", f"--plan={tmp_path}/o.json"],
            "same file",
        ),
        (["--lengths", str(lengths), "--config", config, "--iterations", "5"], "without it the file is one batch"),
        (["--lengths", str(lengths), "--config", config, "--devices", "64"], "epp plans the config's dp*pp*sp"),
        ([f"--lengths={lengths}", f"--config={config}", "--policy=auto", "--simulation=async"], "its own execution"),
    ]
    for argv, message in cases:
        assert plan_main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, (argv, err)


def test_run_dir_under_a_file_is_a_config_error(tmp_path, cache_dir):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"cannot be created \(Not a directory\)"):
        train(_config(tmp_path / "file" / "run", cache_dir, "--train.steps=1"), quiet=True)
    # the file itself: said so (before: "File exists")
    with pytest.raises(ConfigError, match=r"logging.run_dir '.*file' cannot be created \(it is a file\)"):
        train(_config(tmp_path / "file", cache_dir, "--train.steps=1"), quiet=True)
    from jvarlen.config import DataConfig
    from jvarlen.data import DataPipeline, UnreadableFileError

    with pytest.raises(UnreadableFileError, match=r"data.cache_dir '.*file' cannot be created \(it is a file\)"):
        DataPipeline(DataConfig(cache_dir=str(tmp_path / "file"), max_documents=4))


def test_token_fields_refuse_floats_booleans_and_strings(tmp_path):
    from jvarlen.config import DataConfig
    from jvarlen.data import DataError, DataPipeline

    for bad, what in (
        ("[1, 2.5, 3]", "item 1 is 2.5"),
        ("[1, true]", "item 1 is True"),
        ('["12", 3]', "item 0 is '12'"),
    ):
        path = tmp_path / "c.jsonl"
        path.write_text('{"ids": [5, 6, 7]}\n' + '{"ids": ' + bad + "}\n")
        config = DataConfig(source="jsonl", path=str(path), tokens_field="ids", cache_dir=str(tmp_path / "cache"))
        with pytest.raises(DataError, match=rf"{path}:2: field 'ids' .*{what}"):
            DataPipeline(config)


def test_token_ids_outside_the_tokenizer_are_refused(tmp_path):
    """Pre-tokenized ids get data.tokenizer's BOS/EOS around them: ids that tokenizer cannot have
    made (here the byte tokenizer's 259 and above) are refused, not stored beside its 256/257."""
    from jvarlen.config import DataConfig
    from jvarlen.data import DataPipeline, TokenIdError

    path = tmp_path / "c.jsonl"
    path.write_text('{"ids": [5, 6, 258]}\n{"ids": [300, 1000]}\n')
    config = DataConfig(source="jsonl", path=str(path), tokens_field="ids", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(TokenIdError, match=rf"{path} \(record 2\): token id 1000 is outside the vocabulary"):
        DataPipeline(config, vocab_size=2048)


def test_binary_files_in_a_text_dir_are_skipped_and_counted(tmp_path):
    from jvarlen.config import DataConfig
    from jvarlen.data import DataPipeline

    root = tmp_path / "docs"
    root.mkdir()
    (root / "a.txt").write_text("hello world " * 20)
    (root / "b.md").write_text("# title\n" + "some text " * 30)
    (root / "blob.bin").write_bytes(bytes(range(256)) * 8)
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + b"\x00" * 64)
    pipeline = DataPipeline(DataConfig(source="text_dir", path=str(root), cache_dir=str(tmp_path / "cache")))
    assert pipeline.corpus.num_documents == 2
    assert sorted(os.path.basename(p) for p in pipeline.corpus.skipped_binary) == ["blob.bin", "image.png"]
    assert "2 binary files skipped" in pipeline.summary()


def test_text_files_that_are_not_utf8_are_counted(tmp_path):
    """A Latin-1 file whose first non-ASCII byte lies past the binary sniff's 8 KiB is read as text;
    a text tokenizer sees U+FFFD for its undecodable bytes. Kept (the byte tokenizer reads bytes),
    but named in the corpus summary (before: nothing said so)."""
    from jvarlen.config import DataConfig
    from jvarlen.data import DataPipeline

    root = tmp_path / "docs"
    root.mkdir()
    (root / "a.txt").write_text("plain text " * 20)
    (root / "latin1.txt").write_bytes(b"ascii line\n" * 1000 + "caf\xe9 cr\xe8me".encode("latin-1"))
    pipeline = DataPipeline(DataConfig(source="text_dir", path=str(root), cache_dir=str(tmp_path / "cache")))
    assert pipeline.corpus.num_documents == 2 and not pipeline.corpus.skipped_binary
    assert [os.path.basename(p) for p in pipeline.corpus.not_utf8] == ["latin1.txt"]
    assert "1 file not valid UTF-8 (read as bytes; first:" in pipeline.summary()


def test_messages_name_what_is_wrong(tmp_path):
    from jvarlen.config import DataConfig
    from jvarlen.data import DataError, DataPipeline
    from jvarlen.data.tokenizer import load_tokenizer

    (tmp_path / "tok").mkdir()
    with pytest.raises(DataError, match="is a directory, not a tokenizer JSON file"):
        load_tokenizer(str(tmp_path / "tok"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "one.txt").write_text("")
    with pytest.raises(DataError, match=r"no non-empty documents in '.*one\.txt'"):
        DataPipeline(DataConfig(source="text_dir", path=str(empty), cache_dir=str(tmp_path / "cache")))

    from jvarlen.kernels import varlen_attention

    q = jnp.zeros((1, 0, 4, 8))
    ids = jnp.zeros((1, 0), jnp.int32)
    with pytest.raises(ValueError, match="at least one query and one key token"):
        varlen_attention(q, q, q, q_segment_ids=ids, kv_segment_ids=ids, q_positions=ids, kv_positions=ids)


# ------------------------------------------------------------------------------------- planner in bounded time


def test_the_planner_answers_an_impossible_budget_at_once():
    from conftest import small_cost

    from jvarlen.plan.api import PlannerOptions, PlanningError, plan_iteration

    cost = small_cost(pp=2, sp=1)
    state = max(cost.model_state_memory(p) for p in range(2)) + cost.layer_gradient_memory()
    tight = small_cost(pp=2, sp=1, budget=state + 2**20)  # 1 MiB of activations: tens of tokens per chunk
    start = time.perf_counter()
    with pytest.raises(PlanningError, match="cannot be split into slices that fit memory"):
        plan_iteration([2_000_000, 300], cost=tight, options=PlannerOptions(min_slice_tokens=512))
    for policy in ("epp", "seq1f1b", "seq1f1b-tuned"):  # seq1f1b: a ValueError about chunk_tokens=0 before
        with pytest.raises(PlanningError, match="model states and a backward's layer gradients"):
            plan_iteration([5000], cost=small_cost(pp=2, sp=1, budget=state / 2), policy=policy)
    dapple = plan_iteration([5000], cost=small_cost(pp=2, sp=1, budget=state / 2), policy="dapple")
    assert not dapple.stats["fits_memory"] and "dapple: out of memory" in dapple.events[0]  # a baseline, flagged
    for policy in ("wo-wbc", "seq1f1b-tuned"):  # every fixed chunk size was tried first (147 s)
        with pytest.raises(PlanningError, match="cannot be split into slices that fit memory"):
            plan_iteration([2_000_000, 300], cost=tight, policy=policy)
    assert time.perf_counter() - start < 30  # a hang guard, not a speed bar (a hang ran > 300 s)


def test_planner_options_and_strategy_inputs_are_checked_up_front():
    from conftest import small_cost

    from jvarlen.plan.api import PlannerOptions, plan_iteration
    from jvarlen.plan.auto import EPPPipelinesOptions
    from jvarlen.plan.hydraulis import HydraulisOptions
    from jvarlen.plan.strategy import Scheme, SchemeCosts, plan_strategy

    for bad in ("n_candidates=0", "n_slices=0", "min_slice_tokens=0", "chunk_tokens=()"):
        with pytest.raises(ValueError, match=rf"PlannerOptions: {re.escape(bad)} must be >= 1"):
            PlannerOptions(**eval(f"dict({bad})"))
    costs = SchemeCosts(small_cost(pp=1, sp=1), 8)
    with pytest.raises(ValueError, match=r"scheme \(pp=16, sp=1\) needs more than the run's 8 devices"):
        plan_strategy("epp-pipelines", [3000, 2000], costs, EPPPipelinesOptions(scheme=Scheme(16, 1)))
    for lengths in ([], [3000, 0]):
        with pytest.raises(ValueError, match="non-empty list of positive document lengths"):
            plan_strategy("epp-pipelines", lengths, costs)
    # a fractional, boolean, NaN or text length is refused with its entry, never truncated by int()
    for lengths, entry in (([3000, 1000.7], "entry 1 is 1000.7"), ([True, 300], "entry 0 is True")):
        for policy in ("homogeneous", "flexsp", "dcp", "hydraulis"):
            with pytest.raises(ValueError, match=re.escape(entry)):
                plan_strategy(policy, lengths, costs)
    for lengths in ([float("nan")], ["12"], [np.int64(-3)]):
        with pytest.raises(ValueError, match="entry 0 is"):
            plan_strategy("flexsp", lengths, costs)
    with pytest.raises(ValueError, match="entry 1 is 2.5"):
        plan_iteration([3000, 2.5], cost=small_cost(pp=2, sp=1))
    whole = plan_strategy("homogeneous", np.array([3000.0, 2000.0]), costs)  # whole floats are lengths
    ints = plan_strategy("homogeneous", [3000, 2000], costs)
    assert [(g.devices, g.documents, g.plan.chunks) for g in whole.groups] == [
        (g.devices, g.documents, g.plan.chunks) for g in ints.groups
    ]
    with pytest.raises(ValueError, match=r"candidate .* needs more than the run's 8 devices"):
        plan_strategy("hydraulis", [3000, 2000], costs, HydraulisOptions(candidates=((Scheme(8, 2),),)))
    # 5 devices: no pipeline scheme divides them; one pipeline of 4 runs and a device idles
    five = plan_strategy("epp-pipelines", [3000, 2000, 1000], SchemeCosts(small_cost(pp=1, sp=1), 5))
    assert sum(g.scheme.num_devices for g in five.groups) in (4, 5) and sorted(
        d for g in five.groups for d in g.documents
    ) == [0, 1, 2]


def test_a_two_million_token_document_is_planned(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("2000000\n500\n3000\n")
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "default.yaml")
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "jvarlen.plan", "--lengths", str(lengths), "--config", config, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard; it takes a few seconds
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())
    assert summary["tokens_planned"] == summary["tokens_in"] == 2_003_500 and summary["fits_memory"]


def test_profile_cli_refuses_what_would_mislabel_or_overwrite_a_profile(tmp_path, capsys):
    """``python -m jvarlen.profile`` without measuring anything: bad flags and missing files are one
    line with exit 2; a report of another model is not saved as this model's; an existing profile is
    neither replaced by a refit without --force nor reused without saying so."""
    import glob
    import json

    from jvarlen.plan.cost import CostCoefficients
    from jvarlen.profile.cli import cli

    base = ["--cpu_pin", "false", "--out_dir", str(tmp_path), "--compilation_cache", str(tmp_path / "xla")]
    for flags, message in (
        (["--repeats", "0"], "repeats and calibration_rounds must be >= 1"),
        (["--refit_from", str(tmp_path / "none.json")], "none.json"),
        # measuring flags a refit would ignore (before: ignored)
        (
            ["--refit_from", "r.json", "--sp", "[1,2]", "--recalibrate", "true", "--extend_report", "r.json"],
            "--sp, --e",
        ),
    ):
        assert cli(base + flags) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, err
    from jvarlen.runtime.cost_check import PACKAGE_PROFILES

    shipped = sorted(glob.glob(f"{PACKAGE_PROFILES}/*__cpu__cpu.report.json"))[0]
    report = json.load(open(shipped))
    other = tmp_path / "other.report.json"
    json.dump({**report, "model_key": "L80-d8192-other", "backend": "gpu"}, open(other, "w"))
    assert cli(base + ["--refit_from", str(other)]) == 2
    assert "was measured for L80-d8192-other on gpu, not this" in capsys.readouterr().err
    assert cli(base + ["--refit_from", shipped]) == 0  # an older report without the keys: taken as it is
    path = capsys.readouterr().out.strip()
    CostCoefficients.load(path)
    assert cli(base + ["--refit_from", shipped]) == 2
    assert "exists; pass --force true" in capsys.readouterr().err
    assert cli(base) == 0  # reused, and said so
    assert "reusing the profile" in capsys.readouterr().err
    # not for a config whose layers keep other residuals (before: reused as if it were its profile)
    (tmp_path / "all.yaml").write_text("parallel:\n  residual_policy: all\n")
    assert cli(base + ["--config", str(tmp_path / "all.yaml")]) == 2
    assert "keeping residual_policy 'dots_and_attention', the config's keep 'all'" in capsys.readouterr().err
    # a file that is not a report is refused before the saved report is touched (before: it replaced it)
    saved = {p: open(p).read() for p in glob.glob(f"{tmp_path}/*.report.json")}
    (tmp_path / "empty.json").write_text("{}")
    assert cli(base + ["--config", str(tmp_path / "all.yaml"), "--extend_report", str(tmp_path / "empty.json")]) == 2
    assert "is not a profile report" in capsys.readouterr().err
    assert {p: open(p).read() for p in glob.glob(f"{tmp_path}/*.report.json")} == saved


def test_a_run_refused_at_its_start_leaves_no_run_dir_it_made(tmp_path, cache_dir):
    """A configuration refused at the start (by the layout policy, or by the data) in a run
    directory the run made: the directory is removed again (before: an empty directory with a
    lock file was left); one that existed before is kept."""
    from jvarlen.data import DataError

    refusals = (
        (("--parallel.tokens_per_device=10",), ConfigError, "no layout fits"),
        (("--data.source=jsonl", f"--data.path={tmp_path / 'none.jsonl'}"), DataError, "none.jsonl"),
    )
    for flags, error, message in refusals:
        run_dir = tmp_path / "run"
        with pytest.raises(error, match=message):
            train(_config(run_dir, cache_dir, "--train.steps=1", *flags), quiet=True)
        assert not run_dir.exists()
        run_dir.mkdir()
        with pytest.raises(error, match=message):
            train(_config(run_dir, cache_dir, "--train.steps=1", *flags), quiet=True)
        assert run_dir.is_dir()
        shutil.rmtree(run_dir)
