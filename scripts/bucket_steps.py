"""What the executor's bucket granularity costs and saves (planner and host side only, no JAX step).

    python scripts/bucket_steps.py [--steps 4,8,16] [--only REGEX] [--seeds 3000,3001]
                                   [--reuse-setting REGEX] [--reuse-policy homogeneous] [--reuse-batches 100]

The pipeline executor pads every chunk of a step to one token bucket, a multiple of
``1/BUCKET_STEPS`` of the next power of two (:func:`jvarlen.plan.chunk.executor_buckets`). For
each ``--steps`` value (set as :data:`jvarlen.plan.chunk.BUCKET_STEPS` for the run, a what-if):

1. **policies**: on the 64-device settings of ``scripts/bench_strategies.py`` matching ``--only``
   (pull/push overlapped), every policy of ``AUTO_POLICIES`` plans each batch (Hydraulis with its
   corpus proposal), and the iteration time its plan simulates to in the executor's model is
   printed, then per policy the median and range of time(steps) / time(first steps value), ``auto``
   being the fastest policy of each batch;
2. **compiles**: ``--reuse-batches`` batches of ``--reuse-setting`` planned by ``--reuse-policy``
   go through the groups runtime's host side in order (:func:`jvarlen.parallel.pipeline.prepare_plans`
   per group, with the signatures compiled so far for that group's devices, as
   ``runtime/strategies/groups.py`` does): the number of distinct programs the run compiles, and
   how many token rows the steps run against the plans' own smallest buckets (a compiled larger
   bucket is reused rather than compiling a smaller one).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_strategies as bench  # noqa: E402

from jvarlen.parallel.pipeline import prepare_plans  # noqa: E402
from jvarlen.plan import chunk  # noqa: E402
from jvarlen.plan.api import PlanningError  # noqa: E402
from jvarlen.plan.auto import AUTO_POLICIES  # noqa: E402
from jvarlen.plan.strategy import plan_strategy  # noqa: E402


def policy_times(settings, seeds) -> dict:
    """{(setting name, seed): {policy: simulated iteration seconds (nan: no plan)}}."""
    out = {}
    for setting in settings:
        costs, pool, extra = bench.auto_setup(setting)
        for seed in seeds:
            batch = bench.token_batch(pool, setting.tokens, seed)
            row = {}
            for policy in AUTO_POLICIES:
                try:  # options: Hydraulis' corpus proposal, the defaults otherwise
                    row[policy] = plan_strategy(policy, batch, costs, extra.get(policy)).stats["iteration_time_s"]
                except PlanningError:
                    row[policy] = float("nan")
            finite = [t for t in row.values() if np.isfinite(t)]
            row["auto"] = min(finite) if finite else float("nan")
            out[(setting.name, seed)] = row
    return out


def compiles(setting, policy: str, batches: int, num_layers: int) -> tuple[int, float, float]:
    """(programs compiled, Σ token rows run / Σ token rows of the plans' smallest buckets, the
    largest per-batch ratio) over ``batches`` batches in order, as the groups runtime picks buckets."""
    costs, pool, extra = bench.auto_setup(setting)
    options = extra.get(policy)  # None: the policy's defaults
    known: dict = {}
    ran = planned = 0
    worst = 1.0
    for b in range(batches):
        plan = plan_strategy(policy, bench.token_batch(pool, setting.tokens, 5000 + b), costs, options)
        ran_b = planned_b = 0
        for g in plan.groups:
            key = (g.scheme, tuple(g.devices))
            docs = [[np.zeros(plan.lengths[d], np.int32) for d in g.documents]]
            sig, _ = prepare_plans([g.plan], docs, num_layers, sorted(known.get(key, ()), key=str))
            known.setdefault(key, set()).add(sig)
            longest = max(sum(p[2] for p in c) for c in g.plan.chunks)
            rows = g.plan.n_chunks * g.scheme.num_devices
            ran_b += sig.bucket * rows
            planned_b += chunk.executor_bucket(longest, g.scheme.sp) * rows
        ran, planned, worst = ran + ran_b, planned + planned_b, max(worst, ran_b / planned_b)
    return sum(len(v) for v in known.values()), ran / planned, worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="4,8,16")
    ap.add_argument("--only", default="h100")
    ap.add_argument("--seeds", default="3000,3001")
    ap.add_argument("--reuse-setting", default="commoncrawl 7B h100 64 dev 200K tok 32K ctx,")
    ap.add_argument("--reuse-policy", default="homogeneous")
    ap.add_argument("--reuse-batches", type=int, default=100)
    args = ap.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    settings = [s for s in bench.auto_settings() if re.search(args.only, s.name)]
    reuse = [s for s in bench.auto_settings() if re.search(args.reuse_setting, s.name)]
    times, programs = {}, {}
    for n in steps:
        chunk.BUCKET_STEPS = n
        times[n] = policy_times(settings, seeds)
        for key, row in times[n].items():
            print(
                f"steps {n}: {key[0]}, batch {key[1]}: " + ", ".join(f"{p} {t:.3f}" for p, t in row.items()), flush=True
            )
        if args.reuse_batches and reuse:
            layers = bench.shape(reuse[0].model).num_layers
            programs[n] = compiles(reuse[0], args.reuse_policy, args.reuse_batches, layers)
    base = steps[0]
    if times[base]:
        print(f"\niteration time / time with {base} steps, per policy (median, range over {len(times[base])} batches):")
    for n in steps[1:] if times[base] else ():
        cells = []
        for policy in (*AUTO_POLICIES, "auto"):
            # a batch the policy could not plan at either step count (NaN) is left out, and said so
            r = [times[n][k][policy] / times[base][k][policy] for k in times[base]]
            r = [x for x in r if np.isfinite(x)]
            left_out = f", {len(times[base]) - len(r)} batches not planned" if len(r) < len(times[base]) else ""
            if r:
                cells.append(f"{policy} {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f}{left_out})")
        print(f"  {n} steps: " + ", ".join(cells))
    if programs:
        print(f"\n{args.reuse_policy} on {reuse[0].name} ({args.reuse_batches} batches in order):")
        for n, (count, ratio, worst) in programs.items():
            print(
                f"  {n} steps: {count} programs compiled; token rows run / planned {ratio:.3f} (worst batch {worst:.3f})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
