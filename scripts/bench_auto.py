"""The ``auto`` parts of the strategy benchmark (``scripts/bench_strategies.py --parts auto,bounds,
bounds_epp,auto_cpu,service``): ``auto`` against each policy it chooses from, EPP's bounded search
against the exhaustive one, ``auto``'s CPU per batch at two commits and ``auto`` in the planning
service, each with its table. All run on the 64-device settings with pull/push overlapped
(:func:`strategy_settings.auto_settings`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import statistics
import time

from strategy_settings import auto_settings, auto_setup, plan_record, run_plan, token_batch

from jvarlen.plan.auto import AUTO_POLICIES, AutoOptions, EPPPipelinesOptions
from jvarlen.plan.service import PlanningService
from jvarlen.plan.strategy import plan_strategy


def auto_part(iterations: int, quick: bool) -> list[dict]:
    """``auto`` against every policy it plans with, per batch, on the 64-device settings with
    pull/push overlapped: its estimate must be the best of theirs, and its planning time (all of
    them, one after another) is the planning service's per-iteration cost."""
    out = []
    for setting in auto_settings()[: 2 if quick else None]:
        costs, pool, given = auto_setup(setting)
        auto = AutoOptions(options=tuple(given.items()))
        rows = []
        for i in range(iterations):
            batch = token_batch(pool, setting.tokens, 3000 + i)
            planned = run_plan("auto", batch, costs, auto)  # first: what the cost models keep is of earlier batches
            singles = {p: run_plan(p, batch, costs, given.get(p)) for p in AUTO_POLICIES}
            rows.append({"auto": planned, "singles": singles})
        out.append({"setting": setting.name, "batches": rows})
        print(setting.name, [(r["auto"].get("iter_s"), r["auto"].get("cpu_s")) for r in rows], flush=True)
    return out


def bounds_part(iterations: int, quick: bool, policy: str = "auto") -> list[dict]:
    """``policy`` (``auto`` or ``epp-pipelines``) with EPP's bounded search (the default: lower bounds
    per candidate chunking; each later pipeline scheme, and under ``auto`` ``epp-pipelines`` itself,
    under a ceiling) against the exhaustive search (``PlannerOptions.prune=False``), on the batches
    of :func:`auto_part`: CPU seconds of each call (the two interleaved, alternating which runs
    first) and whether they chose the same plan."""
    out = []
    for setting in auto_settings()[: 2 if quick else None]:
        costs, pool, given = auto_setup(setting)
        epp = EPPPipelinesOptions()
        exhaustive = dataclasses.replace(epp, planner=dataclasses.replace(epp.planner, prune=False))
        if policy == "auto":
            variants = {
                "bounded": AutoOptions(options=tuple(given.items())),
                "exhaustive": AutoOptions(options=tuple(given.items()) + (("epp-pipelines", exhaustive),)),
            }
        else:
            variants = {"bounded": epp, "exhaustive": exhaustive}
        plan_strategy(policy, token_batch(pool, setting.tokens, 2999), costs, variants["bounded"])  # warm memos
        rows = []
        for i in range(iterations):
            batch = token_batch(pool, setting.tokens, 3000 + i)
            row = {}
            for name in sorted(variants, reverse=i % 2 == 1):
                c0 = time.process_time()
                plan = plan_strategy(policy, batch, costs, variants[name])
                row[name] = {"cpu_s": time.process_time() - c0, "plan": plan_record(plan)}
                row[name]["chosen"] = plan.stats.get("policy_chosen", plan.describe())
            row["same_plan"] = row["bounded"]["plan"] == row["exhaustive"]["plan"]
            for name in variants:
                del row[name]["plan"]
            rows.append(row)
        out.append({"setting": setting.name, "batches": rows})
        print(
            setting.name, [(r["bounded"]["cpu_s"], r["exhaustive"]["cpu_s"], r["same_plan"]) for r in rows], flush=True
        )
    return out


def auto_cpu_part(iterations: int, quick: bool, repeats: int = 2) -> list[dict]:
    """``auto`` alone on the batches of :func:`auto_part`: per batch its CPU seconds (the least of
    ``repeats`` calls), the policy chosen, the predicted iteration, each policy's wall seconds inside
    the call and a digest of the plan. Run at two commits to compare what a change to the search
    costs and whether it plans the same (``--json`` per commit, then :func:`auto_cpu_table`)."""
    out = []
    for setting in auto_settings()[: 2 if quick else None]:
        costs, pool, given = auto_setup(setting)
        options = AutoOptions(options=tuple(given.items()))
        plan_strategy("auto", token_batch(pool, setting.tokens, 2999), costs, options)  # warm memos
        rows = []
        for i in range(iterations):
            batch = token_batch(pool, setting.tokens, 3000 + i)
            cpu = []
            for _ in range(repeats):
                c0 = time.process_time()
                plan = plan_strategy("auto", batch, costs, options)
                cpu.append(time.process_time() - c0)
            estimates = plan.stats["auto_estimates"]
            rows.append({
                "cpu_s": min(cpu),
                "chosen": plan.stats["policy_chosen"],
                "iteration_time_s": plan.stats["iteration_time_s"],
                "policy_s": {k: v["solve_seconds"] for k, v in estimates.items()},
                "plan": hashlib.sha256(plan_record(plan).encode()).hexdigest()[:16],
            })  # fmt: skip
        out.append({"setting": setting.name, "batches": rows})
        print(setting.name, [(round(r["cpu_s"], 2), r["chosen"]) for r in rows], flush=True)
    return out


def _run_medians(runs, side: int) -> str:
    return " / ".join(f"{statistics.median(r['cpu_s'] for r in run[side]):.2f}" for run in runs)


def auto_cpu_table(pairs: list[tuple[list[dict], list[dict]]], policy: str = "hydraulis") -> str:
    """:func:`auto_cpu_part` records of the same batches at two commits, one ``(before, after)`` pair
    per run (e.g. the two commits at once on separate cores, then swapped): per setting each run's
    median CPU, the median speedup over every batch of every run, ``policy``'s median seconds inside
    the call, and how many batch-runs plan the same and predict the same iteration."""
    lines = [
        "| setting | before: `auto` CPU s, median (per run) | after | median speedup (all batch-runs) "
        f"| {policy} inside `auto`, median s before → after | same plan | same iteration time |",
        "|---|---|---|---|---|---|---|",
    ]
    for per_setting in zip(*(zip(b, a) for b, a in pairs)):
        runs = [(b["batches"], a["batches"]) for b, a in per_setting]
        assert all(b["setting"] == a["setting"] == per_setting[0][0]["setting"] for b, a in per_setting)
        both = [(x, y) for b, a in runs for x, y in zip(b, a)]

        inside = [
            statistics.median(r["policy_s"].get(policy, 0.0) for r, _ in both),
            statistics.median(r["policy_s"].get(policy, 0.0) for _, r in both),
        ]
        lines.append(
            f"| {per_setting[0][0]['setting']} | {_run_medians(runs, 0)} | {_run_medians(runs, 1)} "
            f"| {statistics.median(x['cpu_s'] / y['cpu_s'] for x, y in both):.2f}× "
            f"| {inside[0]:.3f} → {inside[1]:.3f} | {sum(x['plan'] == y['plan'] for x, y in both)} of {len(both)} "
            f"| {sum(x['iteration_time_s'] == y['iteration_time_s'] for x, y in both)} of {len(both)} |"
        )
    return "\n".join(lines)


def bounds_table(records) -> str:
    lines = [
        "| setting | exhaustive CPU s (median / max) | bounded CPU s (median / max) | median speedup | same plan |",
        "|---|---|---|---|---|",
    ]
    for rec in records:
        ex = [b["exhaustive"]["cpu_s"] for b in rec["batches"]]
        bo = [b["bounded"]["cpu_s"] for b in rec["batches"]]
        ratio = statistics.median(e / b for e, b in zip(ex, bo))
        same = sum(b["same_plan"] for b in rec["batches"])
        lines.append(
            f"| {rec['setting']} | {statistics.median(ex):.2f} / {max(ex):.2f} | {statistics.median(bo):.2f} / "
            f"{max(bo):.2f} | {ratio:.2f}× | {same} of {len(rec['batches'])} |"
        )
    return "\n".join(lines)


def service_part(iterations: int, workers: tuple[int, ...] = (1, 2)) -> list[dict]:
    """``auto`` in the planning service (``plan.workers``): wall seconds per planned iteration when
    ``iterations`` batches are queued at once (the loop keeps ``plan.ahead + 1`` queued), on the
    first 64-device overlapped setting. Run it on an otherwise idle machine: throughput scales with
    free cores, at most ``workers``."""

    setting = auto_settings()[0]
    costs, pool, given = auto_setup(setting)
    options = AutoOptions(options=tuple(given.items()))
    solve = functools.partial(plan_strategy, "auto", costs=costs, options=options)
    batches = [token_batch(pool, setting.tokens, 4000 + i) for i in range(iterations)]
    out = []
    for w in workers:
        with PlanningService(None, workers=w, solve=solve, fallback=solve) as service:
            service.submit(-1, batches[0])  # start the workers (spawn + imports) before timing
            service.get(-1, wait=True)
            t0 = time.perf_counter()
            for i, batch in enumerate(batches):
                service.submit(i, batch)
            plans = [service.get(i, wait=True) for i in range(iterations)]
            wall = time.perf_counter() - t0
        out.append(
            {
                "setting": setting.name,
                "workers": w,
                "iterations": iterations,
                "wall_per_iteration_s": wall / iterations,
                "chosen": [p.stats["policy_chosen"] for p in plans],
            }
        )
        print(out[-1], flush=True)
    return out


def auto_table(records) -> str:
    lines = [
        "| setting | auto iter s | best single policy iter s | auto / best single, worst batch "
        "| fastest policies per batch (ties joined by /) | distinct strategies | auto plan CPU s (median / max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for rec in records:
        autos, bests, ratios, chosen, policies = [], [], [], [], []
        for b in rec["batches"]:
            ok = {p: r["iter_s"] for p, r in b["singles"].items() if "error" not in r}
            best = min(ok.values())
            autos.append(b["auto"]["iter_s"])
            bests.append(best)
            ratios.append(b["auto"]["iter_s"] / best)
            chosen.append(b["auto"]["strategy"])
            policies.append("/".join(p for p, t in ok.items() if t == best))
        cpu = [b["auto"]["cpu_s"] for b in rec["batches"]]
        lines.append(
            f"| {rec['setting']} | {statistics.mean(autos):.3f} | {statistics.mean(bests):.3f} | {max(ratios):.4f} "
            f"| {', '.join(policies)} | {len(set(chosen))} | {statistics.median(cpu):.2f} / {max(cpu):.2f} |"
        )
    return "\n".join(lines)
