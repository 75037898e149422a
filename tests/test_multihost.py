"""Two processes x 4 CPU devices (jax.distributed over 127.0.0.1) match one process x 8.

Run as a script, this file is one worker process: ``python test_multihost.py PID PORT OUT``.
"""

import functools
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from tiny_flags import REFERENCE_ATTENTION, TINY_MODEL_ARGS  # constants only: safe in the worker processes

STEPS = 3
ROWS, SEQ, VOCAB = 4, 64, 64


def batch_for(step: int) -> dict:
    """Rank-coded tokens, documents crossing the sp shard boundaries (16 tokens), padding."""
    r, t = np.meshgrid(np.arange(ROWS), np.arange(SEQ), indexing="ij")
    tokens = ((13 * r + 5 * t + step) % VOCAB).astype(np.int32)
    lengths = [[21, 30, 11], [64], [7, 40, 5], [33]]  # row 3 ends in padding
    seg, pos = np.zeros((ROWS, SEQ), np.int32), np.zeros((ROWS, SEQ), np.int32)
    for row, docs in enumerate(lengths):
        i = 0
        for s, n in enumerate(docs, start=1):
            n = n - step if n > 10 else n
            seg[row, i : i + n], pos[row, i : i + n] = s, np.arange(n)
            i += n
    loss_mask = ((seg > 0) & (np.roll(seg, -1, axis=1) == seg)).astype(np.float32)
    return dict(tokens=tokens, segment_ids=seg, positions=pos, targets=np.roll(tokens, -1, axis=1), loss_mask=loss_mask)


def run_steps(devices):
    """3 AdamW steps with Layout(dp=2, sp=4) on ``devices``: (mesh, [loss, grad norm] per step, params)."""
    import jax
    from jax.experimental import multihost_utils

    from jvarlen.api import Session
    from jvarlen.layout import Layout

    config = tiny_config()
    session = Session.from_config(config, devices=devices)
    layout = Layout(dp=2, sp=4)
    mesh = session.placement.mesh(layout)
    first = batch_for(0)
    step = session.layout_step(layout, *first["tokens"].shape)
    state = session.state
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, step.from_arrays(batch_for(i)))  # each process fills its own shards
        metrics = jax.device_get(metrics)
        losses.append(float(metrics["loss_sum"] / metrics["target_tokens"]))
        losses.append(float(metrics["grad_norm"]))
    params = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(state.params)]
    return mesh, losses, params


def tiny_config():
    from jvarlen.config import Config, ModelConfig, OptimizerConfig, TrainConfig

    return Config(
        model=ModelConfig(
            vocab_size=VOCAB,
            d_model=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            mlp_dim=64,
            compute_dtype="float32",
            attention="reference",
        ),
        # AdamW divides each gradient element by its own RMS: an element whose gradient is
        # about eps (1e-8) turns fp32 reduction-order rounding (gloo sums in another order
        # than the in-process collectives) into a parameter change of up to ~1e-2 x lr.
        # lr = 3e-4 keeps that under the 1e-5 tolerance while 3 steps still move the
        # parameters by ~1e-3 (checked below), far above it.
        optimizer=OptimizerConfig(warmup_steps=0, learning_rate=3e-4),
        train=TrainConfig(steps=STEPS),
    )


def initial_params():
    import jax

    from jvarlen.runtime.state import create_train_state

    return [np.asarray(x) for x in jax.tree.leaves(create_train_state(tiny_config())[2].params)]


def interleave(first, second):
    """[a0, b0, a1, b1, ...]: every run of 4 (an sp group) holds devices of both halves."""
    return [d for pair in zip(first, second) for d in pair]


def run_group_steps(devices, stage_weights: str = "replicated"):
    """3 SGD steps of a heterogeneous strategy on ``devices``: group A (pp=2, sp=2) on session
    devices 0-3 and group B (pp=1, sp=4) on 4-7, each spanning both processes when ``devices``
    interleaves them. -> (mesh, [loss, grad norm] per step, params)."""
    import jax
    import optax
    from jax.experimental import multihost_utils

    from jvarlen.api import Session
    from jvarlen.layout import Layout
    from jvarlen.plan.api import make_cost
    from jvarlen.plan.cost import ModelShape
    from jvarlen.plan.strategy import GroupPlan, Scheme, SchemeCosts, StrategyPlan, build_group_plan
    from jvarlen.runtime.state import create_train_state

    config = tiny_config()
    graphdef, _, state = create_train_state(config)
    optimizer = optax.sgd(0.1)
    state = state.replace(opt_state=optimizer.init(state.params))
    session = Session(graphdef, config.model, optimizer, state, devices=devices)
    costs = SchemeCosts(make_cost(ModelShape.from_config(config.model), "a800", Layout(8, 1, 1)), 8)
    lengths = (40, 7, 25, 33, 12, 18, 9, 30)
    rng = np.random.default_rng(5)
    docs = [rng.integers(1, VOCAB, size=n).astype(np.int32) for n in lengths]
    groups = []
    for scheme, devs, ids, micro in (
        (Scheme(2, 2), (0, 1, 2, 3), (0, 1, 2, 3), [[0, 1], [2, 3]]),
        (Scheme(1, 4), (4, 5, 6, 7), (4, 5, 6, 7), [[0, 1], [2, 3]]),
    ):
        plan = build_group_plan("test", scheme, [lengths[i] for i in ids], micro, costs)
        groups.append(GroupPlan(scheme, devs, ids, plan))
    plan = StrategyPlan("test", 8, lengths, tuple(groups))
    step = session.strategy_step(residual_policy="all", stage_weights=stage_weights)
    state, losses = session.state, []
    for _ in range(STEPS):
        prepared = step.prepare(plan, docs)
        state, metrics = step(state, prepared)
        # the training loop's record: layer forwards of this process's groups, per stage
        forwards = step.strategy.record(None, prepared, metrics)["layer_forwards"]
        assert sum(sum(f) for f in forwards) > 0
        metrics = jax.device_get({k: metrics[k] for k in ("loss_sum", "target_tokens", "grad_norm")})
        losses += [float(metrics["loss_sum"] / metrics["target_tokens"]), float(metrics["grad_norm"])]
    params = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(state.params)]
    return session.placement.state_mesh, losses, params


def worker(process_id: int, port: int, out: str, mode: str = "layout") -> None:
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    from jvarlen.config import ParallelConfig
    from jvarlen.runtime.distributed import initialize

    initialize(
        ParallelConfig(
            distributed=True, coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
        )
    )
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    by_process = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in (0, 1)]
    run = run_group_steps if mode.startswith("groups") else run_steps
    if mode == "groups-sharded":
        run = functools.partial(run_group_steps, stage_weights="sharded")
    if mode == "groups-per-process":  # group A on process 0's devices, group B on process 1's
        mesh, losses, params = run(by_process[0] + by_process[1])
    elif mode == "groups-stages-per-process":  # group A's first stage on process 0, its second on process 1
        mesh, losses, params = run(by_process[0][:2] + by_process[1][:2] + by_process[0][2:] + by_process[1][2:])
    else:  # every group (or the layout's sp groups) spans both processes
        mesh, losses, params = run(interleave(*by_process))
        assert all({d.process_index for d in group} == {0, 1} for group in mesh.devices.reshape(-1, 4))
    if process_id == 0:
        np.savez(out, *params, losses=np.asarray(losses))
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_distributed_config_is_all_or_nothing():
    from jvarlen.config import ConfigError, ParallelConfig, parse_config
    from jvarlen.runtime.distributed import initialize

    assert initialize(ParallelConfig()) is False  # not configured: nothing happens
    with pytest.raises(ConfigError, match="must be set together"):
        initialize(ParallelConfig(distributed=True, coordinator_address="127.0.0.1:1234"))
    with pytest.raises(ConfigError, match=r"process_id \(2\) must be in \[0, parallel.num_processes=2\)"):
        parse_config(["--parallel.num_processes=2", "--parallel.process_id=2"])
    with pytest.raises(ConfigError, match="parallel.heartbeat_timeout_s must be > 0 and finite, got 0"):
        parse_config(["--parallel.heartbeat_timeout_s=0"])


def test_the_heartbeat_timeout_reaches_jax(monkeypatch):
    import jax

    from jvarlen.config import ParallelConfig
    from jvarlen.runtime import distributed

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(distributed, "_initialized", False)
    explicit = dict(coordinator_address="127.0.0.1:1234", num_processes=1, process_id=0)
    assert distributed.initialize(ParallelConfig(distributed=True, heartbeat_timeout_s=7, **explicit))
    monkeypatch.setattr(distributed, "_initialized", False)
    assert distributed.initialize(ParallelConfig(distributed=True))  # the cluster's own (SLURM ...)
    assert calls == [dict(explicit, heartbeat_timeout_seconds=7), dict(heartbeat_timeout_seconds=100)]


def test_an_error_the_failure_watch_causes_does_not_end_the_process_first(monkeypatch):
    """Process 1 reported a failure; this process's watch shuts the distributed client down,
    which fails what the main thread waits for (a collective's rendezvous: "Gloo context
    initialization failed: CANCELLED"), and then exits with process 1's code. The main thread's
    error handler (``report_failure``) must not report a failure of its own nor end the process
    first with its code: it waits for the watch. (Before: under load the main thread's exit won
    the race, exit 1 or an abort, -6, instead of 2.)"""
    import threading

    import jax

    from jvarlen.runtime import distributed

    class Client:  # the coordination service's key-value store as the watch and the handler use it
        def __init__(self):
            self.reports, self.set = [("jvarlen/failed/1", "2\nUnreadableFileError: not mounted")], []

        def key_value_dir_get(self, prefix):
            return list(self.reports)

        def key_value_set(self, key, value):
            self.set.append(key)

    shutting_down, exits = threading.Event(), []

    def shutdown():  # the main thread's wait fails now; the watch is slow to go on (a loaded host)
        shutting_down.set()
        time.sleep(0.5)

    def exit_(code):  # as os._exit, nothing after it runs: the watch's loop ends, the test's thread raises
        exits.append((threading.current_thread().name, code))
        if threading.current_thread() is not watch:
            raise SystemExit(code)
        watch.stop()

    monkeypatch.setattr(jax.distributed, "shutdown", shutdown)
    monkeypatch.setattr(distributed.os, "_exit", exit_)
    client = Client()
    watch = distributed.FailureWatch(client, me=0, poll_s=0.01, grace_s=0.0)
    monkeypatch.setattr(distributed, "_watch", watch)
    watch.start()
    assert shutting_down.wait(10)
    with pytest.raises(SystemExit) as stopped:
        distributed.report_failure(1, RuntimeError("Gloo context initialization failed: CANCELLED"))
    assert stopped.value.code == 2 and client.set == []  # nothing reported for this process
    assert exits == [("jvarlen-failure-watch", 2), (threading.current_thread().name, 2)]  # the watch first


def _start_two_processes(command, env_of=lambda pid: {}) -> list:
    """Starts ``command(pid)`` for pids 0 and 1, 4 host CPU devices each (``env_of(pid)``: more
    environment variables)."""
    from conftest import cli_env  # here: the workers import this module, and conftest sets 8 devices

    env = cli_env(4, JAX_PLATFORMS="cpu")
    return [
        subprocess.Popen(
            command(pid), env={**env, **env_of(pid)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for pid in (0, 1)
    ]


def _finish(procs, timeout: float = 400) -> list[str]:
    """Each process's output once it exits; any still running after ``timeout`` is killed."""
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _wait_for_records(procs, metrics, count: int, timeout: float = 300) -> None:
    """Until ``metrics`` holds ``count`` step records, a process exits (its exit code then fails the
    test with its log) or ``timeout`` seconds pass."""
    deadline = time.time() + timeout
    while not (metrics.exists() and metrics.read_text().count("\n") >= count) and time.time() < deadline:
        if any(p.poll() is not None for p in procs):
            return
        time.sleep(0.2)


def _run_two_processes(command) -> None:
    """Runs ``command(pid)`` for pids 0 and 1 to completion; fails with the log of a process that
    did not exit cleanly."""
    procs = _start_two_processes(command)
    for p, log in zip(procs, _finish(procs)):
        assert p.returncode == 0, log[-3000:]


@pytest.mark.slow  # two fresh JAX processes compile the step: ~50-90 s on 2 shared cores
def test_two_processes_with_sp_spanning_them_match_one_process(tmp_path):
    import jax

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    out = str(tmp_path / "multihost.npz")
    port = _free_port()
    t0 = time.perf_counter()
    _run_two_processes(lambda pid: [sys.executable, __file__, str(pid), str(port), out])
    elapsed = time.perf_counter() - t0

    # the same mesh positions on one process: device k of "process" p is local device 4p + k
    local = sorted(jax.devices(), key=lambda d: d.id)
    _, losses, params = run_steps(interleave(local[:4], local[4:]))
    initial = initial_params()
    got = np.load(out)
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
    moved = 0.0
    for i, ref in enumerate(params):
        np.testing.assert_allclose(got[f"arr_{i}"], ref, rtol=1e-5, atol=1e-5)
        moved = max(moved, float(np.abs(ref - initial[i]).max()))
    assert moved > 5e-4
    print(f"two-process run: {elapsed:.1f} s")


@pytest.mark.slow  # two fresh JAX processes compile three group programs each: ~2-3 min on 2 shared cores
@pytest.mark.parametrize("mode", ["groups", "groups-per-process", "groups-stages-per-process", "groups-sharded"])
def test_heterogeneous_groups_on_two_processes_match_one_process(tmp_path, mode):
    """Groups of different schemes whose devices span both processes ("groups"), or each on one
    process's devices ("groups-per-process": a process dispatches only its own groups), or a
    pipeline group's stages on different processes ("groups-stages-per-process", as stages on
    different nodes), or groups spanning both with their stages sharded over them, each process
    handed chunks ("groups-sharded"): the pull,
    the groups' programs and the update are multi-controller programs; losses and parameters
    equal one process."""
    import jax

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    out = str(tmp_path / "groups.npz")
    port = _free_port()
    _run_two_processes(lambda pid: [sys.executable, __file__, str(pid), str(port), out, mode])
    local = sorted(jax.devices(), key=lambda d: d.id)
    stage_weights = "sharded" if mode == "groups-sharded" else "replicated"
    _, losses, params = run_group_steps(interleave(local[:4], local[4:]), stage_weights)
    got = np.load(out)
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
    for i, ref in enumerate(params):
        np.testing.assert_allclose(got[f"arr_{i}"], ref, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *(sys.argv[4:5]))


CLI_ARGS = [
    *TINY_MODEL_ARGS,
    REFERENCE_ATTENTION,
    "--data.seq_len=128",
    "--data.tokens_per_batch=1024",
    "--data.max_documents=60",
    "--logging.tensorboard=false",
    "--logging.progress_bar=false",
    "--train.steps=2",
    "--parallel.sp_cycle=[4,2]",
]


def _train_command(tmp_path, args, port: int):
    """``command(pid)``: ``python -m jvarlen.train args`` as process ``pid`` of a two-process run
    (run dir tmp_path/two, a corpus cache per process)."""
    return lambda pid: [
        sys.executable,
        "-m",
        "jvarlen.train",
        *args,
        f"--logging.run_dir={tmp_path / 'two'}",
        f"--data.cache_dir={tmp_path / f'cache{pid}'}",
        "--parallel.distributed=true",
        f"--parallel.coordinator_address=127.0.0.1:{port}",
        "--parallel.num_processes=2",
        f"--parallel.process_id={pid}",
    ]


def _train_on_two_processes(tmp_path, args) -> list[dict]:
    """:func:`_train_command` run to completion; the metrics records process 0 wrote."""
    import json

    _run_two_processes(_train_command(tmp_path, args, _free_port()))
    return [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # the training CLI in two processes: ~1-2 min on 2 shared cores
def test_training_cli_on_two_processes_matches_one_process(tmp_path):

    import jax

    from jvarlen.config import parse_config
    from jvarlen.runtime.loop import train

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    records = _train_on_two_processes(tmp_path, CLI_ARGS)
    assert [(r["step"], r["dp"], r["sp"]) for r in records] == [(1, 2, 4), (2, 4, 2)]  # only process 0 logs
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["2"]
    one = train(
        parse_config([*CLI_ARGS, f"--logging.run_dir={tmp_path / 'one'}", f"--data.cache_dir={tmp_path / 'cache0'}"]),
        quiet=True,
    )
    np.testing.assert_allclose([r["loss"] for r in records], one.losses, rtol=1e-5)


@pytest.mark.slow  # the pipeline path of the training CLI in two processes: ~2-3 min on 2 shared cores
def test_pipeline_cli_on_two_processes_matches_one_process(tmp_path):

    import jax

    from jvarlen.config import parse_config
    from jvarlen.runtime.loop import train

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    args = [a for a in CLI_ARGS if not a.startswith("--parallel.sp_cycle")]
    args += [
        "--parallel.dp=2",
        "--parallel.pp=2",
        "--parallel.sp=2",
        "--plan.min_slice_tokens=32",
        "--data.seq_len=256",
        "--plan.wait=true",  # the solver's plans, as the one-process run below (no fallback when late)
        # held-out evaluation after each step, on a (dp=4, sp=2) layout whose devices span both processes
        "--eval.documents=3",
        "--eval.every_steps=1",
    ]
    records = _train_on_two_processes(tmp_path, args)
    assert [(r["step"], r["dp"], r["pp"], r["sp"]) for r in records] == [(1, 2, 2, 2), (2, 2, 2, 2)]
    # process 0 solved plan 0 of each step and read plan 1 from process 1 (plan_exchange)
    assert [r["plans_fetched"] for r in records] == [1, 1]
    one = train(
        parse_config(
            [
                *args,
                f"--logging.run_dir={tmp_path / 'one'}",
                f"--data.cache_dir={tmp_path / 'cache0'}",
            ]
        ),
        quiet=True,
    )
    np.testing.assert_allclose([r["loss"] for r in records], one.losses, rtol=1e-5)
    one_records = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([r["eval_loss"] for r in records], [r["eval_loss"] for r in one_records], rtol=1e-5)


@pytest.mark.slow  # a strategy policy's groups from the training CLI in two processes: ~2-3 min on 2 shared cores
@pytest.mark.parametrize("stage_weights", ["replicated", "per_iteration"])
def test_strategy_policy_cli_on_two_processes_matches_one_process(tmp_path, stage_weights):
    """One plan a step (the strategy's groups): process 0 solves step 1's, process 1 step 2's, and
    each reads the other's from the coordination service (plan_exchange), with the stage weights
    it chose (``per_iteration``)."""
    import json

    import jax

    from jvarlen.config import parse_config
    from jvarlen.runtime.loop import train

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    args = [a for a in CLI_ARGS if not a.startswith("--parallel.sp_cycle")]
    args += ["--parallel.dp=8", "--parallel.pp=1", "--parallel.sp=1", "--plan.policy=flexsp", "--plan.wait=true"]
    args += [f"--parallel.stage_weights={stage_weights}"]
    records = _train_on_two_processes(tmp_path, args)
    assert [r["step"] for r in records] == [1, 2] and [r["plans_fetched"] for r in records] == [0, 1]
    one = train(
        parse_config(
            [
                *args,
                f"--logging.run_dir={tmp_path / 'one'}",
                f"--data.cache_dir={tmp_path / 'cache0'}",
            ]
        ),
        quiet=True,
    )
    alone = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert [r["strategy"] for r in records] == [r["strategy"] for r in alone]
    assert [r["stage_weights"] for r in records] == [r["stage_weights"] for r in alone]
    np.testing.assert_allclose([r["loss"] for r in records], one.losses, rtol=1e-5)


@pytest.mark.slow  # the training CLI in two processes, twice: ~2-3 min on 2 shared cores
def test_a_signal_to_one_process_stops_every_process_after_the_same_step(tmp_path):
    """SIGTERM reaches one host of a distributed run (a preemption notice, a scheduler): every
    process checkpoints and stops after the same step (before: that process alone stopped, and
    the others waited in the next step's collectives or in a checkpoint it never joined); the
    two processes then resume from that checkpoint."""
    import json
    import signal

    import jax

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    run_dir = tmp_path / "two"
    args = [a if not a.startswith("--train.steps") else "--train.steps=400" for a in CLI_ARGS]
    procs = _start_two_processes(_train_command(tmp_path, [*args, "--checkpoint.every_steps=1000"], _free_port()))
    metrics = run_dir / "metrics.jsonl"
    try:
        _wait_for_records(procs, metrics, 2)
        procs[1].send_signal(signal.SIGTERM)
    finally:
        logs = _finish(procs, timeout=300)
    assert [p.returncode for p in procs] == [143, 143], [log[-2000:] for log in logs]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert os.listdir(run_dir / "checkpoints") == [str(steps[-1])] and steps[-1] < 400
    # both processes resume from that checkpoint (its state checksums verified on the sharded arrays)
    last = steps[-1]
    resumed = [a if not a.startswith("--train.steps") else f"--train.steps={last + 2}" for a in CLI_ARGS]
    procs = _start_two_processes(_train_command(tmp_path, [*resumed, "--checkpoint.resume=true"], _free_port()))
    logs = _finish(procs, timeout=300)
    assert [p.returncode for p in procs] == [0, 0], [log[-2000:] for log in logs]
    assert f"resumed from step {last}" in logs[0]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()][-3:] == [last, last + 1, last + 2]


@pytest.mark.slow  # the training CLI in two processes: ~1 min on 2 shared cores
def test_a_signal_during_the_start_up_stops_every_process_after_the_first_step(tmp_path):
    """SIGTERM while the run starts (here as process 0 reads its corpus; on a large corpus this
    takes minutes): every process stops after the first step with its checkpoint, exit 143 (before:
    jax.distributed's preemption notifier took the signal until jvarlen's handlers were installed
    after the state was built, and the run trained on to the end)."""
    import signal

    import jax

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    run_dir = tmp_path / "two"
    args = [a if not a.startswith("--train.steps") else "--train.steps=30" for a in CLI_ARGS]
    procs = _start_two_processes(_train_command(tmp_path, [*args, "--checkpoint.every_steps=1000"], _free_port()))
    first = []
    try:
        for line in procs[0].stdout:
            first.append(line)
            if "[jvarlen] corpus:" in line:
                procs[0].send_signal(signal.SIGTERM)
                break
    finally:
        logs = _finish(procs, timeout=300)
    logs[0] = "".join(first) + logs[0]
    assert [p.returncode for p in procs] == [143, 143], [log[-2000:] for log in logs]
    assert os.listdir(run_dir / "checkpoints") == ["1"]


@pytest.mark.slow  # two JAX processes start and stop before training: ~20-40 s on 2 shared cores
def test_a_run_directory_that_is_not_one_directory_to_every_process_is_refused(tmp_path):
    """``logging.run_dir`` on each host's own disk (here ``~/two`` with another home directory per
    process: the same configuration, two directories) is refused on every process before training
    (before: both trained, then waited for each other's checkpoint files until Orbax's 20-minute
    timeout)."""
    import jax

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    command = _train_command(tmp_path, CLI_ARGS, _free_port())
    procs = _start_two_processes(
        lambda pid: [*command(pid), "--logging.run_dir=~/two"],  # the last flag is taken
        env_of=lambda pid: {"HOME": str(tmp_path / f"home{pid}")},
    )
    logs = _finish(procs, timeout=300)
    assert [p.returncode for p in procs] == [2, 2], [log[-2000:] for log in logs]
    assert all("differ in the file process 0 wrote into logging.run_dir" in log for log in logs), logs[0][-2000:]
    assert all("must be one directory to every process" in log for log in logs)
    assert not (tmp_path / "home0" / "two").exists()  # made by this run, refused: removed (the probe file too)


@pytest.mark.slow  # the training CLI in two processes, one killed: ~1-2 min on 2 shared cores
def test_a_killed_process_ends_the_others_within_the_heartbeat_timeout(tmp_path):
    """A process killed without a word (SIGKILL: it cannot report, checkpoint or agree on a stop)
    ends the other one once the coordination service misses its heartbeats for
    ``parallel.heartbeat_timeout_s`` (10 s here; JAX's 100 s by default), with the service's message
    that another task died. Measured: process 0 exited 6.8 s after the kill; with JAX's 100 s it took
    91 s (this test then fails)."""
    import signal

    import jax

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    run_dir = tmp_path / "two"
    args = [a if not a.startswith("--train.steps") else "--train.steps=400" for a in CLI_ARGS]
    command = _train_command(tmp_path, [*args, "--parallel.heartbeat_timeout_s=10"], _free_port())
    procs = _start_two_processes(command)
    metrics = run_dir / "metrics.jsonl"
    try:
        _wait_for_records(procs, metrics, 2)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.time()
        procs[0].wait(timeout=120)
        waited = time.time() - killed
    finally:
        logs = _finish(procs, timeout=60)
    assert procs[1].returncode == -signal.SIGKILL, logs[1][-2000:]
    assert procs[0].returncode != 0 and "another task died" in logs[0], logs[0][-2000:]
    assert waited < 10 + 30, waited  # the timeout and a margin for a loaded machine, not JAX's 100 s


# process 1 of a resume reads its part of checkpoint 4 as ``FAULT`` (the processes of a run read
# their own shards: a stale network file system, a host with a bad disk)
_READ_FAULT = """
import errno, runpy, sys
import orbax.checkpoint as ocp
read = ocp.CompositeCheckpointHandler.restore
def faulty(self, directory, *a, **k):
    if directory.name == "4":
        raise {fault}
    return read(self, directory, *a, **k)
ocp.CompositeCheckpointHandler.restore = faulty
runpy.run_module("jvarlen.train", run_name="__main__")
"""


@pytest.mark.slow  # three two-process runs of the training CLI: ~2-3 min on 2 shared cores
def test_a_checkpoint_one_process_cannot_read_is_skipped_or_refused_by_every_process(tmp_path):
    """The processes agree on each checkpoint they read. A checkpoint one process finds damaged is
    set aside by all, and all resume from the older one (before: that process fell back alone, so
    the two restored different steps and then waited in different collectives; on the CPU backend
    both failed 30 s later); a storage error on one process stops both, nothing moved."""
    import json

    import jax

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    run_dir = tmp_path / "two"
    steps = [a if not a.startswith("--train.steps") else "--train.steps=4" for a in CLI_ARGS]
    _run_two_processes(_train_command(tmp_path, [*steps, "--checkpoint.every_steps=2"], _free_port()))
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4"]

    def resume_with(fault: str, train_steps: int) -> tuple[list, list[str]]:
        args = [a if not a.startswith("--train.steps") else f"--train.steps={train_steps}" for a in CLI_ARGS]
        command = _train_command(
            tmp_path, [*args, "--checkpoint.every_steps=2", "--checkpoint.resume=true"], _free_port()
        )
        wrapped = [sys.executable, "-c", _READ_FAULT.format(fault=fault)]
        procs = _start_two_processes(lambda pid: wrapped + command(pid)[3:] if pid == 1 else command(pid))
        return procs, _finish(procs, timeout=300)

    procs, logs = resume_with('OSError(errno.EIO, "Input/output error")', 6)
    assert [p.returncode for p in procs] == [1, 1], [log[-2000:] for log in logs]
    assert "Input/output error" in logs[1]
    assert "CheckpointReadError: process 1 of this run cannot read checkpoint 4" in logs[0], logs[0][-2000:]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4"]

    procs, logs = resume_with('ValueError("a shard of it is damaged")', 4)
    assert [p.returncode for p in procs] == [0, 0], [log[-2000:] for log in logs]
    told = [line for line in logs[0].splitlines() if "checkpoint 4 cannot be read" in line]  # process 0 speaks
    assert len(told) == 1 and "(process 1: ValueError: a shard of it is damaged)" in told[0], logs[0][-2000:]
    assert "resumed from step 2" in logs[0]
    names = sorted(os.listdir(run_dir / "checkpoints"))
    assert names[:2] == ["2", "4"] and len(names) == 3 and names[2].startswith("4.unreadable-"), names
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-2:] == [3, 4]


# process 1 may write files of at most 1 byte from its save of checkpoint 2 on (its own disk full):
# its shards of the state fail in Orbax's background thread, after the save call has returned
_WRITE_FAULT = """
import resource, runpy
from jvarlen.runtime import checkpoint
save = checkpoint.Checkpointer.save
def full_disk(self, step, *args, **kwargs):
    if step == 2:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return save(self, step, *args, **kwargs)
checkpoint.Checkpointer.save = full_disk
runpy.run_module("jvarlen.train", run_name="__main__")
"""


@pytest.mark.slow  # a two-process run of the training CLI: ~25 s on 2 shared cores, each
@pytest.mark.parametrize("failing", [1, 0])  # 0 also hosts the coordination service
def test_a_checkpoint_write_that_fails_on_one_process_stops_every_process_with_its_reason(tmp_path, failing):
    """A checkpoint whose background write fails on one process only (its disk is full) stops that
    process at the next step with the write's error, and the other with its reason (before: both
    waited in Orbax's barriers until its 20-minute timeout, the other process for the failed write,
    the failing process's finalizing thread for the other in the next). Nothing is listed as
    checkpoint 2."""
    import jax

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    args = [a if not a.startswith("--train.steps") else "--train.steps=6" for a in CLI_ARGS]
    command = _train_command(tmp_path, [*args, "--checkpoint.every_steps=2"], _free_port())
    wrapped = [sys.executable, "-c", _WRITE_FAULT]
    procs = _start_two_processes(lambda pid: wrapped + command(pid)[3:] if pid == failing else command(pid))
    logs = _finish(procs, timeout=400)  # killed (-9) if still waiting: Orbax's barriers hold for 1,200 s
    other = 1 - failing
    assert [p.returncode for p in procs] == [1, 1], [log[-3000:] for log in logs]
    assert "CheckpointWriteError: checkpoint 2 could not be written" in logs[failing], logs[failing][-3000:]
    assert "File too large" in logs[failing]
    stopped = [line for line in logs[other].splitlines() if f"process {failing} of this run failed" in line]
    assert len(stopped) == 1 and "checkpoint 2 could not be written" in stopped[0], logs[other][-3000:]
    assert f"process {other} stops too" in stopped[0]
    assert "2" not in os.listdir(tmp_path / "two" / "checkpoints")


@pytest.mark.slow  # two JAX processes start and stop before training: ~20-40 s on 2 shared cores
def test_processes_that_differ_in_config_or_data_are_refused_before_training(tmp_path):
    """Processes of one run must sample, plan and compile alike: a process given another config
    value (here the learning rate) is refused on every process, naming what differs, before any step
    (a profile in one host's ~/.cache/jvarlen/profiles or a different corpus is caught the same way)."""
    import jax

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    command = _train_command(tmp_path, CLI_ARGS, _free_port())
    procs = _start_two_processes(lambda pid: [*command(pid), f"--optimizer.learning_rate={0.001 * (pid + 1)}"])
    logs = _finish(procs, timeout=300)
    assert [p.returncode for p in procs] == [2, 2], [log[-2000:] for log in logs]
    assert all("the 2 processes of this run differ in the configuration" in log for log in logs), logs[0][-2000:]
    assert not (tmp_path / "two" / "metrics.jsonl").exists()


@pytest.mark.slow  # two JAX processes start, one fails at once: ~20-40 s on 2 shared cores
def test_a_process_that_fails_stops_every_process_with_its_reason(tmp_path):
    """One host cannot read the corpus (a file system not mounted there): that process exits with
    its error, and the other stops with the same exit code, naming the failed process and why
    (before: it waited for the failed process in its first collective; on the CPU backend until
    gloo gave up after 30 s with a traceback about a key-value timeout, exit 1)."""
    import jax

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    missing = tmp_path / "not-mounted" / "corpus.jsonl"
    command = _train_command(tmp_path, CLI_ARGS, _free_port())
    unreadable = ["--data.source=jsonl", f"--data.path={missing}"]
    procs = _start_two_processes(lambda pid: [*command(pid), *(unreadable if pid == 1 else [])])
    logs = _finish(procs, timeout=300)
    assert [p.returncode for p in procs] == [2, 2], [log[-2000:] for log in logs]
    assert str(missing) in logs[1]
    stopped = [line for line in logs[0].splitlines() if "process 1 of this run failed" in line]
    assert len(stopped) == 1 and str(missing) in stopped[0] and "process 0 stops too" in stopped[0], logs[0][-2000:]
    assert not (tmp_path / "two" / "metrics.jsonl").exists()
