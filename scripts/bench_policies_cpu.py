"""Every strategy policy's plan of one long-tailed batch, run on the CPU executor and set beside
the cost model's prediction.

    python scripts/bench_policies_cpu.py [--repeats 5] [--core 0] [--json out.json]

One process with 8 fake CPU devices, pinned to one core (``--core``) before JAX starts, so the
devices' programs run one after another: the measured wall time of an iteration is the work of
all devices together. It is compared with the plan's *predicted device-seconds*, the sum over
groups, stages and the stage's ``sp`` devices of the simulated busy time (``stage_busy_s``);
idle time in a pipeline bubble costs nothing on one core and is not in it. The plan's predicted
iteration time (the slowest group: what 8 real devices would take) is printed beside it; that
the groups really overlap when they have their own cores is ``scripts/bench_groups.py``.

The model is the shipped CPU profile's shape (L4-d128-h4-kv2-hd32-f384-v320, float32), planned
with that profile. Iterations are measured interleaved across policies; median and min-max of
``--repeats``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = os.path.join(ROOT, "jvarlen/profiles/measured/L4-d128-h4-kv2-hd32-f384-v320-tied__cpu__cpu.json")
# a long tail: two long documents hold 40 % of the tokens
LENGTHS = (4096, 2048, 768, 512, 512, 384, 384, 256, 256, 256, 192, 128, 128, 128, 96, 64, 64, 48, 32, 32)
POLICIES = ("homogeneous", "hydraulis", "flexsp", "dcp", "dcp-inter", "epp-pipelines", "auto")


def predicted_device_seconds(plan, costs=None, mode=None) -> float:
    """Σ over groups of the stages' simulated busy seconds × sp, as planned, or re-simulated in
    ``mode`` (``"ticks"``: the model without the executor's one-bucket padding)."""
    if mode is None:
        return sum(float(sum(g.plan.stats["stage_busy_s"])) * g.scheme.sp for g in plan.groups)
    from jvarlen.plan.assemble import simulate

    return sum(float(sum(simulate(g.plan, costs.cost(g.scheme), mode).stage_busy)) * g.scheme.sp for g in plan.groups)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=PROFILE, help="cost profile the policies plan with (default: the shipped one)")
    ap.add_argument(
        "--parts",
        default="policies,groups",
        help="policies: every policy's plan; groups: each group of the dcp and epp-pipelines plans alone, "
        "and the pull + update with no group",
    )
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, ROOT)
    import jax
    import numpy as np
    import optax

    from jvarlen.api import Session
    from jvarlen.config import Config, ModelConfig
    from jvarlen.layout import Layout
    from jvarlen.plan.coefficients import CostCoefficients
    from jvarlen.plan.cost import CostModel, ModelShape
    from jvarlen.plan.strategy import SchemeCosts, plan_strategy
    from jvarlen.runtime.state import create_train_state

    model = ModelConfig(
        vocab_size=320, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, mlp_dim=384, compute_dtype="float32"
    )
    costs = SchemeCosts(
        CostModel(ModelShape.from_config(model), Layout(8, 1, 1), CostCoefficients.load(args.profile)), 8
    )
    graphdef, _, state = create_train_state(Config(model=model))
    optimizer = optax.sgd(1e-3)
    state = state.replace(opt_state=optimizer.init(state.params))
    session = Session(graphdef, model, optimizer, state, devices=sorted(jax.devices(), key=lambda d: d.id))
    step = session.strategy_step()
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 320, size=n).astype(np.int32) for n in LENGTHS]

    parts = args.parts.split(",")
    runs = {}
    plans = {policy: plan_strategy(policy, LENGTHS, costs) for policy in POLICIES}
    if "groups" in parts:  # the same executables, one group at a time (and none: pull + update)
        base = plans["dcp"]
        runs["pull + update only"] = dict(plan=dataclasses.replace(base, groups=(), stats={}), plan_s=0.0, times=[])
        for policy in ("dcp", "epp-pipelines"):
            for i, g in enumerate(plans[policy].groups):
                sub = dataclasses.replace(plans[policy], groups=(g,), stats={})
                runs[f"{policy} group {i}: {g.scheme}, {sum(LENGTHS[d] for d in g.documents)} tokens"] = dict(
                    plan=sub, plan_s=0.0, times=[]
                )
    for policy in POLICIES if "policies" in parts else ():
        t0 = time.perf_counter()
        plan = plan_strategy(policy, LENGTHS, costs)
        runs[policy] = dict(plan=plan, plan_s=time.perf_counter() - t0, times=[])
    for name, run in runs.items():
        run["prepared"] = step.prepare(run["plan"], docs)
        t0 = time.perf_counter()
        step.compiled(run["prepared"])
        print(f"[bench] {name}: {run['plan'].describe()} (compiled in {time.perf_counter() - t0:.0f} s)", flush=True)
    state = session.state
    for run in runs.values():  # warm-up
        state, m = step(state, run["prepared"])
        jax.block_until_ready(m)
    for _ in range(args.repeats):
        for run in runs.values():
            t0 = time.perf_counter()
            state, m = step(state, run["prepared"])
            jax.block_until_ready(m)
            run["times"].append(time.perf_counter() - t0)

    rows = []
    print(
        "| policy | strategy | predicted iteration (8 devices, s) | predicted device-s | measured on one core (s) "
        '| error | device-s without padding ("ticks") | its error | plan (s) |'
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for policy, run in runs.items():
        plan, times = run["plan"], sorted(run["times"])
        med, device_s = times[len(times) // 2], predicted_device_seconds(plan)
        ticks_s = predicted_device_seconds(plan, costs, "ticks")
        row = dict(
            policy=policy,
            strategy=plan.describe(),
            chosen=str(plan.stats.get("policy_chosen", policy)),
            predicted_iteration_s=float(plan.stats.get("iteration_time_s", float("nan"))),
            predicted_device_s=device_s,
            measured_median_s=med,
            measured_min_s=times[0],
            measured_max_s=times[-1],
            error=device_s / med - 1 if device_s else float("nan"),
            ticks_device_s=ticks_s,
            ticks_error=ticks_s / med - 1 if ticks_s else float("nan"),
            plan_s=run["plan_s"],
        )
        rows.append(row)
        print(
            f"| {policy if policy != 'auto' else 'auto → ' + row['chosen']} | {row['strategy']} | {row['predicted_iteration_s']:.3f} | {device_s:.3f} | "
            f"{med:.3f} ({times[0]:.3f}-{times[-1]:.3f}) | {row['error']:+.1%} | {ticks_s:.3f} | "
            f"{row['ticks_error']:+.1%} | {row['plan_s']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lengths": LENGTHS, "repeats": args.repeats, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
