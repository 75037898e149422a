"""Hydraulis' search against building more: on the strategies benchmark's batches (seeds 1000,
1001, ... as ``bench_strategies.py --parts compare``), per setting,

- ``prune``: ``hydraulis`` and ``homogeneous`` with their exact prunings (a cut or a candidate
  bounded above a fitting plan already built is not built, a candidate is given up on its first
  group slower than one: docs/design/heterogeneous.md, "Hydraulis' candidates skipped by bound")
  and without them (``prune=False``), one after the other on each batch; the plans must be the same, and the CPU
  seconds per iteration are reported (median / mean);
- ``every``: ``hydraulis`` with its defaults against every candidate packed and simulated
  (``pack_top``, ``simulate_top``, ``homogeneous_top`` unbounded): how much the ranking before
  simulation loses.

Prints markdown tables. Pin it to a core for the timings (``taskset -c 1``).

    taskset -c 1 python scripts/hydraulis_search_check.py --only 'a800-ib200|^(github|commoncrawl) 7B (h100|a800) 64 dev 200K tok 32K ctx$'
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_strategies as bs  # noqa: E402

from jvarlen.plan.strategy import plan_strategy, strategy_policies  # noqa: E402


def timed(policy, batch, costs, options):
    t0 = time.process_time()
    plan = plan_strategy(policy, batch, costs, options)
    return plan, time.process_time() - t0


def prune_part(settings, iterations: int) -> None:
    print("| setting | policy | with the prunings (median / mean) | without | same plans |")
    print("|---|---|---|---|---|")
    for setting in settings:
        costs, pool = bs.costs_for(setting), bs.corpus(setting.workload, setting.context)
        for policy in ("hydraulis", "homogeneous"):
            options, _ = bs.prepare(strategy_policies()[policy][1], pool, costs, setting.context)
            on, off, same = [], [], 0
            for i in range(iterations):
                batch = bs.token_batch(pool, setting.tokens, 1000 + i)
                a, ta = timed(policy, batch, costs, options)
                b, tb = timed(policy, batch, costs, dataclasses.replace(options, prune=False))
                on.append(ta)
                off.append(tb)
                same += a.describe() == b.describe() and a.stats["iteration_time_s"] == b.stats["iteration_time_s"]
            cells = [f"{statistics.median(x):.3f} / {statistics.mean(x):.3f} s" for x in (on, off)]
            print(f"| {setting.name} | {policy} | {cells[0]} | {cells[1]} | {same} / {iterations} |", flush=True)


def every_part(settings, iterations: int) -> None:
    print("| setting | same iteration time | defaults slower by (per batch) |")
    print("|---|---|---|")
    for setting in settings:
        costs, pool = bs.costs_for(setting), bs.corpus(setting.workload, setting.context)
        options, _ = bs.prepare(strategy_policies()["hydraulis"][1], pool, costs, setting.context)
        every = dataclasses.replace(
            options, pack_top=10**6, simulate_top=10**6, simulate_margin=1e9, homogeneous_top=10**6
        )
        loss = []
        for i in range(iterations):
            batch = bs.token_batch(pool, setting.tokens, 1000 + i)
            a = plan_strategy("hydraulis", batch, costs, options).stats["iteration_time_s"]
            b = plan_strategy("hydraulis", batch, costs, every).stats["iteration_time_s"]
            loss.append(a / b - 1)
        same = sum(x <= 1e-12 for x in loss)
        print(f"| {setting.name} | {same} / {iterations} | {', '.join(f'{100 * x:.2f} %' for x in loss)} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="a800-ib200", help="settings whose name matches this regex")
    ap.add_argument("--parts", default="prune,every")
    ap.add_argument("--iterations", type=int, default=12, help="batches per setting (prune)")
    ap.add_argument("--every_iterations", type=int, default=4, help="batches per setting (every)")
    args = ap.parse_args()
    settings = [s for s in bs.settings(False) if re.search(args.only, s.name)]
    if not settings:
        print(f"no setting matches {args.only!r}")
        return 1
    parts = args.parts.split(",")
    if "prune" in parts:
        prune_part(settings, args.iterations)
    if "every" in parts:
        print()
        every_part(settings, args.every_iterations)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
