"""Fault drill: kill -9 a training run at random points, resume it each time, and compare it with
an uninterrupted run of the same config, bit for bit.

    python scripts/fault_drill.py                                   # default config, 10 kills
    python scripts/fault_drill.py --config configs/epp-cpu.yaml --steps 24 --kills 10
    python scripts/fault_drill.py --config configs/hydraulis-cpu.yaml --steps 12 \
        --parallel.compilation_cache_dir=/tmp/drill-xla     # other flags go to the trainer

Kill points are drawn (seeded) from three kinds: during a step (a random number of steps after the
last (re)start), while a checkpoint is being written (an Orbax temporary directory exists), and
at a random moment of a (re)start (data loading, planning, compiling). After each kill the run is
resumed with ``--checkpoint.resume=true``; the trainer's planner workers must exit by themselves
(no orphans). At the end the per-step losses of ``metrics.jsonl`` (each step exactly once) and the
final parameters and optimizer state are compared with the uninterrupted run. Both runs wait for
solved plans (``plan.wait=true``): a fast fallback plan depends on timing, and the
comparison is about what a resume does, not about what the machine load does.

Prints a table (kills by kind, resumes, steps compared, bitwise equal) and exits 1 on any
difference. Takes a few minutes on 2 cores (the default run is ~2 minutes by itself).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(config: str | None, run_dir: str, steps: int, every: int, resume: bool, extra=()) -> list[str]:
    cmd = [sys.executable, "-m", "jvarlen.train"]
    if config:
        cmd += ["--config", config]
    cmd += [
        f"--logging.run_dir={run_dir}",
        f"--train.steps={steps}",
        f"--checkpoint.every_steps={every}",
        "--checkpoint.max_to_keep=2",
        "--plan.wait=true",
        "--logging.progress_bar=false",
        "--logging.tensorboard=false",
    ]
    if resume:
        cmd.append("--checkpoint.resume=true")
    return cmd + list(extra)


def steps_logged(run_dir: str) -> list[int]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line)["step"])
            except (json.JSONDecodeError, KeyError):
                pass  # a line cut by the kill
    return out


def writing_checkpoint(run_dir: str) -> bool:
    return bool(glob.glob(os.path.join(run_dir, "checkpoints", "*orbax-checkpoint-tmp*")))


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                parent_of[int(entry)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, q in parent_of.items() if q == p]
        out += kids
        frontier += kids
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_once(cmd, env, log):
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def drill(args) -> dict:
    rng = random.Random(args.seed)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    work = args.work_dir or tempfile.mkdtemp(prefix="jvarlen-fault-drill-")
    os.makedirs(work, exist_ok=True)
    ref_dir, run_dir = os.path.join(work, "reference"), os.path.join(work, "drill")
    for d in (ref_dir, run_dir):
        shutil.rmtree(d, ignore_errors=True)
    log = open(os.path.join(work, "drill.log"), "w")
    print(f"[drill] work directory {work}; reference run ...", flush=True)
    t0 = time.time()
    ref = run_once(command(args.config, ref_dir, args.steps, args.every, False, args.extra), env, log)
    if ref.wait() != 0:
        raise SystemExit(f"reference run failed (exit {ref.returncode}); see {log.name}")
    ref_s = time.time() - t0
    print(f"[drill] reference: {args.steps} steps in {ref_s:.0f} s", flush=True)

    kinds = ["step", "checkpoint", "start"]
    killed = {k: 0 for k in kinds}
    orphans, launches = 0, 0
    while True:
        proc = run_once(command(args.config, run_dir, args.steps, args.every, launches > 0, args.extra), env, log)
        launches += 1
        if launches > 4 * args.kills + 10:
            raise SystemExit("the drill did not finish; see " + log.name)
        kind = rng.choice(kinds) if sum(killed.values()) < args.kills else None
        # steps are counted from the checkpoint the run resumes from (later records are dropped)
        target = rng.randint(1, 2 * args.every)
        delay = rng.uniform(0.5, 20.0)
        t_start, base = time.time(), None
        fired = False
        while proc.poll() is None and kind is not None:
            logged = steps_logged(run_dir)
            if base is None and time.time() - t_start > 0.5:
                base = len(logged)
            if kind == "step" and base is not None and base + target >= args.steps:
                kind = "checkpoint"  # too close to the end: the final checkpoint is always written
            due = (
                (kind == "step" and base is not None and len(logged) >= base + target)
                or (kind == "checkpoint" and writing_checkpoint(run_dir))
                or (kind == "start" and time.time() - t_start >= delay)
            )
            if due:
                family = children(proc.pid)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                fired = True
                killed[kind] += 1
                deadline = time.time() + 10
                while time.time() < deadline and any(alive(c) for c in family):
                    time.sleep(0.2)
                left = [c for c in family if alive(c)]
                orphans += len(left)
                for c in left:
                    os.kill(c, signal.SIGKILL)
                print(
                    f"[drill] kill {sum(killed.values())}/{args.kills} ({kind}) at step {logged[-1] if logged else 0}"
                    f"{f'; {len(left)} orphaned processes' if left else ''}",
                    flush=True,
                )
                break
            time.sleep(0.05)
        if fired:
            continue
        code = proc.wait()
        if code != 0:
            raise SystemExit(f"drill run exited {code}; see {log.name}")
        if kind is None or len(steps_logged(run_dir)) >= args.steps:
            break
    return compare(ref_dir, run_dir, args.steps) | {
        "kills": killed,
        "resumes": launches - 1,
        "orphans": orphans,
        "reference_s": ref_s,
        "work_dir": work,
    }


def load_state(run_dir: str, step: int):
    import jax
    import orbax.checkpoint as ocp

    path = os.path.join(run_dir, "checkpoints", str(step), "state")
    ckptr = ocp.PyTreeCheckpointer()
    meta = ckptr.metadata(path)
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
    restore = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return jax.tree.leaves(ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore)))


def compare(ref_dir: str, run_dir: str, steps: int) -> dict:
    def losses(d):
        with open(os.path.join(d, "metrics.jsonl")) as f:
            return [(r["step"], r["loss"]) for r in map(json.loads, f)]

    ref, got = losses(ref_dir), losses(run_dir)
    once = [s for s, _ in got] == list(range(1, steps + 1))
    same_losses = once and all(a == b for (_, a), (_, b) in zip(ref, got))
    a, b = load_state(ref_dir, steps), load_state(run_dir, steps)
    same_state = len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    return {
        "steps_compared": len(got),
        "each_step_once": once,
        "losses_bitwise_equal": same_losses,
        "state_bitwise_equal": same_state,
        "state_leaves": len(a),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="YAML config (default: the built-in default run)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the config's)")
    parser.add_argument("--every", type=int, default=3, help="checkpoint every N steps")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work_dir", default=None)
    parser.add_argument("--json", default=None, help="write the result here")
    args, args.extra = parser.parse_known_args()  # the rest goes to both trainers, e.g. --parallel.*
    if args.steps is None:
        sys.path.insert(0, ROOT)
        from jvarlen.config import parse_config

        args.steps = parse_config(["--config", args.config] if args.config else []).train.steps
    result = drill(args)
    kills = result["kills"]
    print()
    print(
        "| config | steps | kills (step / checkpoint / start) | resumes | orphaned workers | steps compared | each step once | losses bitwise | state bitwise |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.config or 'default'} | {args.steps} | {sum(kills.values())} ({kills['step']} / {kills['checkpoint']} / "
        f"{kills['start']}) | {result['resumes']} | {result['orphans']} | {result['steps_compared']} | "
        f"{result['each_step_once']} | {result['losses_bitwise_equal']} | {result['state_bitwise_equal']} |"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    ok = result["each_step_once"] and result["losses_bitwise_equal"] and result["state_bitwise_equal"]
    return 0 if ok and result["orphans"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
