"""Planning CPU time of the SP-group policies on fixed instances, and whether two checkouts plan them alike.

Plans the same seeded batches as scripts/bench_flexsp_dcp.py's settings (GPT-7B on 64 analytic
A800s, github and commoncrawl with ZeRO-3; Transformer-1D on 32 H200s limited to 80 GB) with
FlexSP's heuristic, DCP, DCP-inter and the dynamic homogeneous reference, and records each call's
process CPU seconds and its plan (``strategy_settings.plan_record``: without the searches' own records). Pin it to a core (``taskset -c 1``):
the numbers are one core's. ``--against`` compares with a file another checkout wrote (run
this script from each, e.g. a ``git worktree`` of the older commit) and reports plans that
differ and the CPU time ratio per case.

    python scripts/sp_planning_time.py [--large] --json runs/sp_planning_time.json [--against OLD.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_flexsp_dcp import Setting, sample_tokens  # noqa: E402
from strategy_settings import plan_record  # noqa: E402

from jvarlen.plan.flexsp import FlexSPOptions  # noqa: E402
from jvarlen.plan.homogeneous import HomogeneousOptions, plan_homogeneous  # noqa: E402
from jvarlen.plan.strategy import plan_strategy  # noqa: E402

_K = 1024


def cases(large: bool) -> list[tuple[str, Setting, int]]:
    out = []
    for seed in range(4):
        out.append((f"7b-github-200k-{seed}", Setting("t", "7b", "a800", 64, "github", 200_000, 384 * _K, False), seed))
        out.append(
            (f"7b-cc-zero3-200k-{seed}", Setting("t", "7b", "a800", 64, "commoncrawl", 200_000, 384 * _K, True), seed)
        )
        out.append(
            (
                f"t1d-balanced-200k-{seed}",
                Setting("t", "t1d", "h200", 32, "dcp-balanced", 200_000, 256 * _K, False),
                seed,
            )
        )
    if large:
        out.append(("7b-github-2m-0", Setting("t", "7b", "a800", 64, "github", 2_000_000, 384 * _K, False), 0))
        out.append(("t1d-long-1m-0", Setting("t", "t1d", "h200", 32, "dcp-long", 1_000_000, 256 * _K, False), 0))
    return out


POLICIES = {
    "flexsp-heuristic": lambda lengths, costs: plan_strategy("flexsp", lengths, costs, FlexSPOptions(milp=False)),
    "dcp": lambda lengths, costs: plan_strategy("dcp", lengths, costs),
    "dcp-inter": lambda lengths, costs: plan_strategy("dcp-inter", lengths, costs),
    "homogeneous": lambda lengths, costs: plan_homogeneous(lengths, costs, HomogeneousOptions()),
}


def run(large: bool) -> dict:
    out = {}
    for name, setting, seed in cases(large):
        costs = setting.costs()
        lengths = sample_tokens(setting.workload, setting.tokens, setting.context, seed=9000 + seed)
        for policy, plan_it in POLICIES.items():
            c0 = time.process_time()
            plan = plan_it(lengths, costs)
            cpu = time.process_time() - c0
            out[f"{name}/{policy}"] = {
                "cpu_s": cpu,
                "iter_s": plan.stats["iteration_time_s"],
                "plan": plan_record(plan),
            }
            print(f"{name:26s} {policy:17s} {cpu:7.2f} s CPU  {plan.describe()}", flush=True)
    return out


def compare(new: dict, old: dict) -> int:
    differ = [k for k in new if k in old and new[k]["plan"] != old[k]["plan"]]
    for k in differ:
        print(f"DIFFERS {k}: {old[k]['iter_s']:.6f} s -> {new[k]['iter_s']:.6f} s")
    for policy in POLICIES:
        keys = [k for k in new if k in old and k.endswith("/" + policy)]
        a, b = sum(old[k]["cpu_s"] for k in keys), sum(new[k]["cpu_s"] for k in keys)
        print(f"{policy:17s} {len(keys)} cases: {a:7.2f} s -> {b:7.2f} s CPU ({a / max(b, 1e-9):.2f}x)")
    print(f"{len(differ)} of {len(set(new) & set(old))} plans differ")
    return 1 if differ else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large", action="store_true", help="also the 1-2M-token instances (minutes)")
    ap.add_argument("--json", default=str(ROOT / "runs" / "sp_planning_time.json"))
    ap.add_argument("--against", help="a file this script wrote on another checkout")
    args = ap.parse_args()
    results = run(args.large)
    pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.json).write_text(json.dumps(results))
    return compare(results, json.loads(pathlib.Path(args.against).read_text())) if args.against else 0


if __name__ == "__main__":
    sys.exit(main())
