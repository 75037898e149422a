"""What ``parallel.stage_weights`` does to ``auto`` on the strategies benchmark's settings: the same
batches (seeds 1000, 1001, ... as ``bench_strategies.py --parts compare``) planned with the
stage weights replicated and sharded, which is the choice ``parallel.stage_weights=auto`` makes
once per run (jvarlen.runtime.strategies.groups.choose_stage_weights), and, per batch, the faster
of the two (what ``parallel.stage_weights=per_iteration`` plans, jvarlen.plan.stage_weights.plan_each,
which first ranks a plan that fits memory by the planner's account). Prints a
markdown table; with ``--per_batch``, then a table of every batch (its longest document, both
predictions, strategies and planning CPU seconds, and what ``per_iteration`` plans for it:
:func:`jvarlen.plan.stage_weights.plan_each`, whose planning is both), which shows what decides the choice.

    python scripts/stage_weights_choice.py --only '13B' --iterations 6
    python scripts/stage_weights_choice.py --only 'commoncrawl 32B.*64 dev' --per_batch
    python scripts/stage_weights_choice.py --only '32B.*64 dev' --per_batch --per_group

``--per_group`` adds what a choice per group could gain with ``per_iteration``'s dispatch kept
(:func:`_per_group`).
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
import strategy_settings  # noqa: E402

from jvarlen.plan.options import PlanningError  # noqa: E402
from jvarlen.plan.stage_weights import CHOICES, plan_each  # noqa: E402
from jvarlen.plan.strategy import strategy_policies  # noqa: E402


def _plan_each(policy, lengths, variants, per_group: bool = False) -> str:
    """What ``parallel.stage_weights=per_iteration`` runs for a batch: its choice, prediction and
    planning CPU seconds (both variants, the second bounded by the first); with ``per_group``, then
    :func:`_per_group`."""
    start = time.process_time()
    try:
        plan = plan_each(policy, lengths, variants)
    except PlanningError:
        return "no plan"
    cpu = time.process_time() - start
    text = f"{plan.stage_weights} {plan.stats['iteration_time_s']:.3f} s ({cpu:.2f} s CPU)"
    return text + (f"; per group: {_per_group(plan, lengths, variants)}" if per_group else "")


def _per_group(plan, lengths, variants) -> str:
    """What choosing the stage weights per group could gain on ``per_iteration``'s plan, its dispatch
    kept: every group re-planned under the other choice (EPP pipelines' groups: an EPP plan of the
    group's documents on its scheme), the slowest group's time taking each group's faster plan that
    fits, against the plan's own slowest group."""
    from jvarlen.plan.api import plan_iteration
    from jvarlen.plan.auto import EPPPipelinesOptions

    if plan.stats.get("policy_chosen", plan.policy) != "epp-pipelines":
        return f"n/a ({plan.stats.get('policy_chosen', plan.policy)})"
    other = variants[CHOICES[1 - CHOICES.index(plan.stage_weights)]][0]
    own, best = [], []
    for g in plan.groups:
        t = g.plan.stats["iteration_time_s"]
        try:
            docs = [lengths[j] for j in g.documents]
            alt = plan_iteration(docs, cost=other.cost(g.scheme), policy="epp", options=EPPPipelinesOptions().planner)
            t_alt = alt.stats["iteration_time_s"] if alt.stats.get("fits_memory", True) else float("inf")
        except PlanningError:
            t_alt = float("inf")
        own.append(t)
        best.append(min(t, t_alt))
    return f"{max(own) / max(best):.3f}× ({sum(b < o for o, b in zip(own, best))} of {len(own)} groups faster)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="13B", help="settings whose name matches this regex")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--per_batch", action="store_true", help="also a table of every batch of every setting")
    ap.add_argument(
        "--per_group", action="store_true", help="with --per_batch: what choosing per group could gain (_per_group)"
    )
    args = ap.parse_args()
    _, options_type = strategy_policies()[args.policy]
    print(
        f"| setting | {args.policy} replicated s | sharded s | replicated / sharded | either per batch s "
        "| per run / per batch | strategies sharded (first batches) |"
    )
    print("|---|---|---|---|---|---|---|")
    batches = []  # (setting, seed, longest document, documents, replicated run, sharded run, per_iteration)
    for setting in [s for s in strategy_settings.settings(False) if re.search(args.only, s.name)]:
        row, variants = {}, {}
        for sharded in (False, True):
            variant = dataclasses.replace(setting, sharded_stage_weights=sharded)
            costs, pool = (
                strategy_settings.costs_for(variant),
                strategy_settings.corpus(variant.workload, variant.context),
            )
            options, _ = strategy_settings.prepare(options_type, pool, costs, variant.context)
            variants[CHOICES[sharded]] = (costs, options)
            docs = [strategy_settings.token_batch(pool, variant.tokens, 1000 + i) for i in range(args.iterations)]
            runs = [strategy_settings.run_plan(args.policy, d, costs, options) for d in docs]
            times = [r["iter_s"] for r in runs if "error" not in r]
            row[sharded] = (statistics.fmean(times) if len(times) == len(runs) else None, runs)
        for i, (d, a, b) in enumerate(zip(docs, row[False][1], row[True][1])):
            each = _plan_each(args.policy, d, variants, args.per_group) if args.per_batch else None
            batches.append((setting.name, 1000 + i, max(d), len(d), a, b, each))
        per_batch = zip(*([None if "error" in r else r["iter_s"] for r in row[s][1]] for s in (False, True)))
        best = [min(t for t in ts if t is not None) for ts in per_batch if any(t is not None for t in ts)]
        either = statistics.fmean(best) if len(best) == args.iterations else None

        def cell(t):
            return "no plan" if t is None else f"{t:.3f}"

        (rep, _), (sha, runs) = row[False], row[True]
        ratio = f"{rep / sha:.3f}×" if rep and sha else "n/a"
        per_run = min((t for t in (rep, sha) if t is not None), default=None)  # what auto keeps
        gain = f"{per_run / either:.3f}×" if per_run and either else "n/a"
        shown = ", ".join(r.get("strategy", "no plan") for r in runs[:3])
        print(
            f"| {setting.name} | {cell(rep)} | {cell(sha)} | {ratio} | {cell(either)} | {gain} | {shown} |", flush=True
        )
    if args.per_batch:
        print(
            "\n| setting | seed | longest document | documents | replicated s | sharded s | replicated | sharded "
            "| planning CPU s (replicated, sharded) | per_iteration |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, seed, longest, n, a, b, each in batches:
            times = [("no plan" if "error" in r else f"{r['iter_s']:.3f}") for r in (a, b)]
            shown = [r.get("strategy", "no plan") for r in (a, b)]
            cpu = ", ".join("n/a" if "error" in r else f"{r['cpu_s']:.2f}" for r in (a, b))
            print(
                f"| {name} | {seed} | {longest:,} | {n} | {times[0]} | {times[1]} | {shown[0]} | {shown[1]} "
                f"| {cpu} | {each} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
