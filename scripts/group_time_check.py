"""The strategy policies' group plans made in one execution model, timed in another (planner only).

    python scripts/group_time_check.py [--plan-in ticks] [--time-in paired] [--seeds 3000,3001] [--only REGEX]

On the 64-device settings of ``scripts/bench_strategies.py`` (pull/push overlapped, the ones
``auto`` is measured on), plans each batch with every policy of ``AUTO_POLICIES`` in ``--plan-in``
(every policy's ``simulation``; Hydraulis with its corpus proposal made under the same options)
and re-simulates each group's plan in ``--time-in``. Prints per batch and policy the slowest
group's time in the planning model, in the other, and their ratio, then the median and maximum
ratio per policy. ``"paired"`` is the executor's model (paired tick table, every chunk of a
group's step padded to one bucket); ``"ticks"`` is the model the policies used before 2026-11-28
(one op per tick, no padding): docs/design/heterogeneous.md, "Group plans in the executor's model".
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import strategy_settings  # noqa: E402

from jvarlen.plan.api import SIMULATIONS, PlanningError  # noqa: E402
from jvarlen.plan.assemble import simulate  # noqa: E402
from jvarlen.plan.auto import AUTO_POLICIES  # noqa: E402
from jvarlen.plan.strategy import plan_strategy, strategy_policies  # noqa: E402


def options_in(policy: str, mode: str, pool, costs, context: int):
    """``policy``'s default options with its group plans simulated in ``mode``."""
    options = strategy_policies()[policy][1]()
    if policy == "epp-pipelines":
        return dataclasses.replace(options, planner=dataclasses.replace(options.planner, simulation=mode))
    options = dataclasses.replace(options, simulation=mode)
    return options.for_corpus(pool, costs, context) if policy == "hydraulis" else options


def slowest_group(plan, costs, mode: str) -> float:
    return max(simulate(g.plan, costs.cost(g.scheme), mode, timeline=False).iteration_time for g in plan.groups)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan-in", default="ticks", choices=SIMULATIONS)
    ap.add_argument("--time-in", default="paired", choices=SIMULATIONS)
    ap.add_argument("--seeds", default="3000,3001")
    ap.add_argument("--only", default="", help="settings whose name matches this regex")
    args = ap.parse_args()
    ratios: dict[str, list[float]] = {p: [] for p in AUTO_POLICIES}
    for setting in strategy_settings.auto_settings():
        if not re.search(args.only, setting.name):
            continue
        costs, pool = strategy_settings.costs_for(setting), strategy_settings.corpus(setting.workload, setting.context)
        options = {p: options_in(p, args.plan_in, pool, costs, setting.context) for p in AUTO_POLICIES}
        for seed in (int(s) for s in args.seeds.split(",")):
            batch = strategy_settings.token_batch(pool, setting.tokens, seed)
            cells = []
            for policy in AUTO_POLICIES:
                try:
                    plan = plan_strategy(policy, batch, costs, options[policy])
                except PlanningError:
                    cells.append(f"{policy} no plan")
                    continue
                planned, timed = slowest_group(plan, costs, args.plan_in), slowest_group(plan, costs, args.time_in)
                ratios[policy].append(timed / planned)
                cells.append(f"{policy} {planned:.3f} -> {timed:.3f} ({timed / planned:.2f}x)")
            print(f"{setting.name}, batch {seed}: " + "; ".join(cells), flush=True)
    print(f"\n{args.time_in} time / {args.plan_in} time of the slowest group, per policy:")
    for policy, r in ratios.items():
        if r:
            print(f"  {policy}: median {statistics.median(r):.2f}, max {max(r):.2f} ({len(r)} batches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
