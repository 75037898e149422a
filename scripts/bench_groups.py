"""Do heterogeneous device groups run concurrently? Two groups, one process per group, each pinned
to its own core (one CPU device per process, ``jax.distributed`` on 127.0.0.1).

    python scripts/bench_groups.py [--repeats 7] [--json out.json]

Group A (device 0, process 0) trains documents of total work t_A, group B (device 1, process 1)
documents of total work t_B. The iteration (pull, the groups' programs, one update) is timed for
"A only" (B's device idle), "B only", and "A and B"; if the groups overlap, "A and B" takes about
max(t_A, t_B), not t_A + t_B. The same three plans also run in ONE process with two fake devices
(labelled so): there XLA's CPU runtime shares one thread pool between the devices, so the groups
cannot overlap and "A and B" takes about the sum (ARCHITECTURE facts, jvarlen docs/benchmarks.md).
Reports the minimum and the spread over ``--repeats`` interleaved repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS_A = (1024, 768, 512, 512)  # the heavier group
LENGTHS_B = (896, 640, 384, 256)


def build(devices):
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jvarlen.api import Session
    from jvarlen.config import Config, ModelConfig
    from jvarlen.layout import Layout
    from jvarlen.plan.api import make_cost
    from jvarlen.plan.cost import ModelShape
    from jvarlen.plan.strategy import GroupPlan, Scheme, SchemeCosts, StrategyPlan, build_group_plan
    from jvarlen.runtime.state import create_train_state

    config = Config(
        model=ModelConfig(
            vocab_size=320, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, mlp_dim=384, compute_dtype="float32"
        )
    )
    graphdef, _, state = create_train_state(config)
    optimizer = optax.sgd(1e-3)
    state = state.replace(opt_state=optimizer.init(state.params))
    session = Session(graphdef, config.model, optimizer, state, devices=devices)
    costs = SchemeCosts(make_cost(ModelShape.from_config(config.model), "a800", Layout(2, 1, 1)), 2)
    lengths = LENGTHS_A + LENGTHS_B
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 320, size=n).astype(np.int32) for n in lengths]
    na = len(LENGTHS_A)

    def group(device, group_lengths, first):  # one micro-batch per document; documents first, first+1, ...
        ids = tuple(range(first, first + len(group_lengths)))
        micro = [[j] for j in range(len(ids))]
        return GroupPlan(
            Scheme(1, 1), (device,), ids, build_group_plan("bench", Scheme(1, 1), group_lengths, micro, costs)
        )

    plans = {
        "A only": (StrategyPlan("bench", 2, LENGTHS_A, (group(0, LENGTHS_A, 0),)), docs[:na]),
        "B only": (StrategyPlan("bench", 2, LENGTHS_B, (group(1, LENGTHS_B, 0),)), docs[na:]),
        "A and B": (StrategyPlan("bench", 2, lengths, (group(0, LENGTHS_A, 0), group(1, LENGTHS_B, na))), docs),
    }
    step = session.strategy_step(residual_policy="all")
    prepared = {name: step.prepare(p, d) for name, (p, d) in plans.items()}
    return session, step, prepared, jnp


def measure(devices, repeats: int) -> dict:
    import jax

    session, step, prepared, _ = build(devices)
    state = session.state
    for p in prepared.values():  # compile first: a process still compiling would time out the
        step.compiled(p)  # other's first collective (Gloo's connect timeout)
    if jax.process_count() > 1:
        from jax._src import distributed

        distributed.global_state.client.wait_at_barrier("bench_groups_compiled", 1_800_000)
    for name in prepared:  # compile and warm up every plan
        state, m = step(state, prepared[name])
        jax.block_until_ready(m)
    times = {name: [] for name in prepared}
    for _ in range(repeats):  # interleaved
        for name, p in prepared.items():
            t0 = time.perf_counter()
            state, m = step(state, p)
            jax.block_until_ready(m)
            times[name].append(time.perf_counter() - t0)
    return times


def worker(pid: int, port: int, out: str, repeats: int) -> None:
    os.sched_setaffinity(0, {pid % os.cpu_count()})  # this process's own core
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    times = measure(devices, repeats)
    if pid == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    jax.distributed.shutdown()


def summary(times: dict) -> dict:
    return {k: {"min_s": min(v), "max_s": max(v), "median_s": sorted(v)[len(v) // 2]} for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        pid, port, out = args.worker
        worker(int(pid), int(port), out, args.repeats)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join("/tmp", f"bench_groups_{os.getpid()}.json")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, __file__, "--repeats", str(args.repeats), "--worker"]
    procs = [subprocess.Popen([*cmd, str(pid), str(port), out], env=env, cwd=ROOT) for pid in (0, 1)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit("a worker failed")
    with open(out) as f:
        two = summary(json.load(f))
    # the same plans in one process with two fake devices sharing one thread pool
    one_env = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    code = (
        "import json, sys; sys.path.insert(0, 'scripts'); import bench_groups as b, jax; "
        f"print(json.dumps(b.measure(sorted(jax.devices(), key=lambda d: d.id), {args.repeats})))"
    )
    line = subprocess.run(
        [sys.executable, "-c", code], env=one_env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    one = summary(json.loads(line.stdout.strip().splitlines()[-1]))
    print("| run | A only (s) | B only (s) | A and B (s) | A and B / max | A and B / sum |")
    print("|---|---|---|---|---|---|")
    for label, res in (
        ("two processes, one core each (groups on their own cores)", two),
        ("one process, two fake devices (one shared thread pool)", one),
    ):
        a, b, ab = (res[k]["min_s"] for k in ("A only", "B only", "A and B"))
        spread = " / ".join(f"{res[k]['min_s']:.3f}-{res[k]['max_s']:.3f}" for k in res)
        print(
            f"| {label} | {a:.3f} | {b:.3f} | {ab:.3f} | {ab / max(a, b):.2f} | {ab / (a + b):.2f} |  <!-- min-max: {spread} -->"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"two_processes": two, "one_process": one}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
