"""Strategy-policy benchmark (issue 15): every registered strategy policy against the homogeneous layouts.

For each setting (workload, model, cluster, devices, tokens per iteration, context) a corpus of
100K documents is drawn from the workload (truncated to the context), each policy is prepared
on it once (``options.for_corpus``: Hydraulis' Eq. 4 proposal, timed) and K batches of
``tokens`` tokens (documents drawn until the batch holds that many) are planned with
every policy of :func:`jvarlen.plan.strategy.strategy_policies` and with every static homogeneous
layout ``d × P``. Reported per policy: mean simulated iteration time (the slowest group's, its step
overhead with the parameter pull and gradient push included; the executor's paired model), speedup over the best *static* homogeneous layout (one scheme for every
batch, the best on average that fits every batch) and over the best homogeneous layout *per
iteration*, propagation-only speedup (slowest group, no pull/push), imbalance between groups,
bubble, solve time (CPU seconds of one process), memory headroom. Speedups are ratios of mean
times over the batches.

Parts: ``compare`` (the table), ``timing`` (planning time at 64 devices and 200K tokens per
iteration, the issue's bar ≤ 0.3 s on one core), ``gap`` (App. D.3: Alg. 1 against the exact
Eq. 3 optimum on small random instances); also ``auto`` (against each policy it chooses from),
``service`` (``auto`` in the planning service), ``bounds`` and ``bounds_epp`` (EPP's bounded search
against the exhaustive one inside ``auto`` and in ``epp-pipelines`` alone), ``auto_cpu`` (``auto``'s
CPU, choice and plan per batch: run it at two commits, each with its own ``--json``, then
``--parts "" --auto_cpu_compare BEFORE AFTER [BEFORE AFTER ...] --no_write`` prints the comparison),
run separately.
Writes the "## Strategies" section of docs/benchmarks.md and a JSON file with every record.
Parts run in parallel processes write their own JSON files; ``--merge`` combines them into
``--json`` (the ``compare`` records in the settings' order, every other part from the file that has
it) before the section is written.

    python scripts/bench_strategies.py [--iterations 6] [--parts compare,timing,gap] [--quick]
    python scripts/bench_strategies.py --parts compare --only '64 dev' --json a.json --no_write &
    python scripts/bench_strategies.py --parts compare --only '^(?!.*64 dev)' --json b.json --no_write
    python scripts/bench_strategies.py --parts "" --merge a.json b.json --no_write
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jvarlen.config import load_config  # noqa: E402
from jvarlen.layout import Layout  # noqa: E402
from jvarlen.plan.api import PlanningError, make_cost  # noqa: E402
from jvarlen.plan.cost import CostModel, ModelShape  # noqa: E402
from jvarlen.plan.hardware import CLUSTERS  # noqa: E402
from jvarlen.plan.hydraulis import HomogeneousOptions, homogeneous_strategies, scheme_space  # noqa: E402
from jvarlen.plan.strategy import SchemeCosts, plan_strategy, strategy_policies  # noqa: E402
from jvarlen.plan.workloads import MIXTURES, stdlib_lengths  # noqa: E402

K = 1024
# LLaMA-33B-like shape for Hydraulis' 32B runs (the paper does not give its shape): 60 layers, 52 heads
LLAMA_32B = ModelShape(60, 6656, 52, 52, 128, 17920, 32000, tie_embeddings=False)
# Hydraulis §8.1: 8 x A800 per node, NVLink 400 GB/s, InfiniBand 200 GB/s per node
A800_HYDRAULIS = dataclasses.replace(CLUSTERS["a800"], name="a800-ib200", network_bandwidth_per_node=200e9)


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    workload: str
    model: str
    cluster: str
    devices: int
    tokens: int
    context: int
    half_rows: float = 0.0
    overlap: bool = False  # pull/push hidden behind propagation (Hydraulis §5.3 subgraph scheduling): no sync cost
    # decoder layers sharded over each stage's devices (parallel.stage_weights="sharded"); replicated,
    # a 32B stage of 64 A800s (pp <= 4: 60 layers) needs 68.5 GiB before any token, over the 67 GiB budget
    sharded_stage_weights: bool = False


def shape(model: str) -> ModelShape:
    if model == "llama-32b":
        return LLAMA_32B
    return ModelShape.from_config(load_config(ROOT / "configs" / f"{model}.yaml").model)


def costs_for(s: Setting) -> SchemeCosts:
    spec = A800_HYDRAULIS if s.cluster == "a800-ib200" else CLUSTERS[s.cluster]
    spec = dataclasses.replace(spec, gemm_half_rows=s.half_rows)
    base = make_cost(shape(s.model), spec, Layout(s.devices, 1, 1))
    coeffs = base.coeffs.replace(sync_bytes_per_param=0.0) if s.overlap else base.coeffs
    base = CostModel(base.model, base.layout, coeffs, stage_weights_sharded=s.sharded_stage_weights)
    return SchemeCosts(base, s.devices)


def corpus(workload: str, context: int, n: int = 100_000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if workload == "stdlib":
        pool = np.asarray(stdlib_lengths())
        x = pool[rng.integers(0, pool.size, n)]
    else:
        x = MIXTURES[workload].sample(n, rng)
    return np.minimum(x, context).astype(np.int64)


def token_batch(pool: np.ndarray, tokens: int, seed: int) -> list[int]:
    """Documents drawn from ``pool`` until the batch holds ``tokens`` tokens (Hydraulis §2.1)."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < tokens:
        x = int(pool[rng.integers(pool.size)])
        out.append(x)
        total += x
    return out


def run_plan(policy: str, lengths, costs, options) -> dict:
    """Plans one batch; the metrics come from the groups, so that every strategy policy reports alike."""
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        plan = plan_strategy(policy, lengths, costs, options)
    except PlanningError as e:
        return {"error": str(e)}
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    summary = plan.group_summary()
    return {
        "iter_s": plan.stats["iteration_time_s"],
        "prop_s": summary["propagation_s"],
        "imbalance": summary["imbalance"],
        "bubble": summary["bubble_ratio"],
        "headroom": 1 - summary["peak_memory_fraction"],
        "fits": summary["fits_memory"],
        "cpu_s": cpu,
        "wall_s": wall,
        "strategy": plan.describe(),
    }


def prepare(options_type, pool, costs, context):
    options = options_type()
    t0 = time.process_time()
    if hasattr(options, "for_corpus"):
        options = options.for_corpus(pool, costs, context)
    return options, time.process_time() - t0


def compare(setting: Setting, iterations: int, quiet: bool) -> dict:
    costs = costs_for(setting)
    pool = corpus(setting.workload, setting.context)
    batches = [token_batch(pool, setting.tokens, 1000 + i) for i in range(iterations)]
    out = {"setting": dataclasses.asdict(setting), "policies": {}, "static": {}}
    for name, (_, options_type) in sorted(strategy_policies().items()):
        options, prep = prepare(options_type, pool, costs, setting.context)
        out["policies"][name] = {"prepare_cpu_s": prep, "runs": [run_plan(name, b, costs, options) for b in batches]}
    out["static_fixed"] = {}
    for strategy in homogeneous_strategies(costs, scheme_space(costs, HomogeneousOptions())):
        for key, packing in (("static", "balanced"), ("static_fixed", "fixed")):
            options = HomogeneousOptions(scheme=strategy[0], packing=packing)
            runs = [run_plan("homogeneous", b, costs, options) for b in batches]
            if all("error" not in r and r["fits"] for r in runs):
                out[key][f"{len(strategy)}×{strategy[0]}"] = runs
    if not quiet:
        print(
            f"{setting.name}: "
            + ", ".join(f"{p} {mean_of(v['runs'], 'iter_s'):.3f}s" for p, v in out["policies"].items())
            + f", best static {best_static(out)[1]:.3f}s, fixed packing {best_static(out, 'static_fixed')[1]:.3f}s",
            flush=True,
        )
    return out


def mean_of(runs, key):
    xs = [r[key] for r in runs if "error" not in r]
    return sum(xs) / len(xs) if len(xs) == len(runs) else float("nan")


def best_static(result, key: str = "static") -> tuple[str, float]:
    if not result.get(key):
        return "none fits", float("nan")
    name = min(result[key], key=lambda k: mean_of(result[key][k], "iter_s"))
    return name, mean_of(result[key][name], "iter_s")


def compare_table(results) -> str:
    head = (
        "| setting | policy | iter s | × static | × per-iter homog. | × fixed packing | prop. × static | imbalance "
        "| bubble | solve CPU s (median / max) | headroom | strategies |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for res in results:
        s = res["setting"]
        static_name, static_t = best_static(res)
        fixed_name, fixed_t = best_static(res, "static_fixed")
        static_prop = mean_of(res["static"][static_name], "prop_s") if static_name in res["static"] else float("nan")
        homog = mean_of(res["policies"]["homogeneous"]["runs"], "iter_s")
        label = (
            f"{s['name']}<br>best static {static_name}: {static_t:.3f} s; fixed packing {fixed_name}: {fixed_t:.3f} s"
        )
        for policy, v in res["policies"].items():
            runs = v["runs"]
            t, p = mean_of(runs, "iter_s"), mean_of(runs, "prop_s")
            ok = [r for r in runs if "error" not in r]
            if len(ok) < len(runs):
                error = next(r["error"] for r in runs if "error" in r)
                lines.append(f"| {label} | {policy} | no plan for {len(runs) - len(ok)} of {len(runs)} batches: "
                             f"{error[:90]} |" + " |" * 9)  # fmt: skip
                label = ""
                continue
            cpu = [r["cpu_s"] for r in ok]
            lines.append(
                f"| {label} | {policy} | {t:.3f} | {static_t / t:.2f} | {homog / t:.2f} | {fixed_t / t:.2f} "
                f"| {static_prop / p:.2f} "
                f"| {mean_of(runs, 'imbalance'):.1%} | {mean_of(runs, 'bubble'):.1%} "
                f"| {statistics.median(cpu) if cpu else float('nan'):.3f} / {max(cpu, default=float('nan')):.3f} "
                f"| {min((r['headroom'] for r in ok), default=float('nan')):.0%} | {len({r['strategy'] for r in ok})} |"
            )
            label = ""
    return "\n".join(lines)


def timing(iterations: int, cluster: str = "h100", model: str = "llama-7b", workload: str = "commoncrawl") -> dict:
    """Planning time of one iteration, 64 devices, 200K tokens per iteration (issue bar: ≤ 0.3 s, one core)."""
    from jvarlen.plan.hydraulis import HydraulisOptions

    setting = Setting("timing", workload, model, cluster, 64, 200_000, 32 * K)
    costs = costs_for(setting)
    pool = corpus(workload, setting.context)
    t0 = time.process_time()
    options = HydraulisOptions().for_corpus(pool, costs, setting.context)
    proposal = time.process_time() - t0
    runs = []
    for i in range(iterations + 1):
        r = run_plan("hydraulis", token_batch(pool, setting.tokens, 2000 + i), costs, options)
        if i:  # the first call builds the cached scheme tables: reported apart (first_cpu_s)
            runs.append(r)
        else:
            first = r
    cpu = sorted(r["cpu_s"] for r in runs)
    wall = sorted(r["wall_s"] for r in runs)
    return {
        "cluster": cluster,
        "model": model,
        "workload": workload,
        "candidates": len(options.candidates),
        "proposal_cpu_s": proposal,
        "first_cpu_s": first["cpu_s"],
        "cpu_median_s": statistics.median(cpu),
        "cpu_max_s": cpu[-1],
        "wall_median_s": statistics.median(wall),
        "iterations": len(runs),
    }


def gap(instances: int, seed: int = 0) -> dict:
    """Alg. 1 (32 trials; 1 trial; the paper's all-random trials) against Eq. 3 solved exactly by CP-SAT."""
    from jvarlen.plan.hydraulis_costs import scheme_tables
    from jvarlen.plan.hydraulis_dispatch import DispatchProblem, exact_dispatch, greedy_dispatch, local_search

    setting = Setting("gap", "commoncrawl", "llama-7b", "h100", 16, 0, 32 * K)
    costs = costs_for(setting)
    schemes = [s for s in scheme_space(costs, HomogeneousOptions()) if s.num_devices <= 8]
    tables = scheme_tables(costs, schemes, simulation="ticks")
    rng = np.random.default_rng(seed)
    ratios = {"greedy-32+ls": [], "greedy-32": [], "greedy-1": [], "paper-32": []}
    unsolved = 0
    for _ in range(instances):
        strategy, left = [], 16
        while left > 0 and len(strategy) < 5:
            s = schemes[int(rng.integers(len(schemes)))]
            if s.num_devices <= left:
                strategy.append(s)
                left -= s.num_devices
        n = int(rng.integers(8, 16))
        dist = MIXTURES["commoncrawl"] if rng.random() < 0.5 else None
        lengths = dist.sample(n, rng) if dist is not None else rng.integers(256, 8192, n)
        top = max(tables[s].max_len for s in strategy)
        lengths = [int(x) for x in np.minimum(lengths, min(top, 32 * K))]
        problem = DispatchProblem.build(lengths, [tables[s] for s in strategy])
        # Eq. 3 itself: without the groups' step overheads (constants that would dilute the ratios)
        problem = dataclasses.replace(problem, fixed=np.zeros_like(problem.fixed))
        exact = exact_dispatch(problem, time_limit_s=20.0, deterministic_time=60.0)
        if exact.source != "cp-sat":
            unsolved += 1
            continue
        for key, trials, lpt in (("greedy-32", 32, True), ("greedy-1", 1, True), ("paper-32", 32, False)):
            res = greedy_dispatch(problem, trials, seed=7, lpt_trial=lpt)
            ratios[key].append(res.objective_s / exact.objective_s)
            if key == "greedy-32":
                ratios["greedy-32+ls"].append(local_search(problem, res.assign).objective_s / exact.objective_s)
    summary = {}
    for key, xs in ratios.items():
        xs = np.sort(np.asarray(xs))
        summary[key] = {
            "n": int(xs.size),
            "optimal": float(np.mean(xs <= 1 + 1e-9)),
            "median": float(np.median(xs)),
            "p90": float(np.quantile(xs, 0.9)),
            "max": float(xs.max()),
        }
    summary["unsolved"] = unsolved
    return summary


def summary(results) -> str:
    """One line per policy: its speedup ranges over the settings (charged and overlapped pull/push apart)."""
    lines = []
    policies = sorted({p for r in results for p in r["policies"]})
    for policy in policies:
        for overlap in (False, True):
            rs = [
                r
                for r in results
                if r["setting"].get("overlap", False) == overlap
                and policy in r["policies"]
                and np.isfinite(mean_of(r["policies"][policy]["runs"], "iter_s"))
            ]
            if not rs:
                continue
            t = [mean_of(r["policies"][policy]["runs"], "iter_s") for r in rs]
            ratios = {
                "× static": [best_static(r)[1] / x for r, x in zip(rs, t)],
                "× fixed packing": [best_static(r, "static_fixed")[1] / x for r, x in zip(rs, t)],
            }
            text = "; ".join(
                f"{k} {min(v):.2f}-{max(v):.2f} (median {statistics.median(v):.2f})" for k, v in ratios.items()
            )
            tag = "pull/push overlapped" if overlap else "pull/push charged"
            planned = sum(1 for r in results if r["setting"].get("overlap", False) == overlap)
            lines.append(f"- `{policy}`, {tag} ({len(rs)} of {planned} settings planned): {text}")
    return "\n".join(lines)


def gap_table(g) -> str:
    lines = ["| greedy | instances | optimal | median | p90 | max |", "|---|---|---|---|---|---|"]
    for key in ("greedy-32+ls", "greedy-32", "greedy-1", "paper-32"):
        v = g[key]
        lines.append(f"| {key} | {v['n']} | {v['optimal']:.0%} | {v['median']:.4f} | {v['p90']:.4f} | {v['max']:.4f} |")
    return "\n".join(lines)


def auto_settings() -> list[Setting]:
    """The 64-device settings with pull/push overlapped, where ``auto`` is measured."""
    return [s for s in settings(False) if s.overlap and s.devices == 64]


def auto_setup(setting: Setting):
    """(costs, corpus, per-policy options) of ``setting``: Hydraulis with its corpus proposal."""
    from jvarlen.plan.hydraulis import HydraulisOptions

    costs = costs_for(setting)
    pool = corpus(setting.workload, setting.context)
    return costs, pool, {"hydraulis": HydraulisOptions().for_corpus(pool, costs, setting.context)}


def auto_part(iterations: int, quick: bool) -> list[dict]:
    """``auto`` against every policy it plans with, per batch, on the 64-device settings with
    pull/push overlapped: its estimate must be the best of theirs, and its planning time (all of
    them, one after another) is the planning service's per-iteration cost."""
    from jvarlen.plan.auto import AUTO_POLICIES, AutoOptions

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


def plan_record(plan) -> str:
    """The plan as JSON without what the searches record about themselves (candidates simulated or
    skipped, solve times, events): equal records are the same plan."""
    data = plan.to_json()
    for g in data["groups"]:
        g["plan"]["stats"] = {k: v for k, v in g["plan"]["stats"].items() if k == "iteration_time_s"}
        g["plan"]["events"] = []
    return json.dumps(data["groups"], sort_keys=True, default=str)


def bounds_part(iterations: int, quick: bool, policy: str = "auto") -> list[dict]:
    """``policy`` (``auto`` or ``epp-pipelines``) with EPP's bounded search (the default: lower bounds
    per candidate chunking; each later pipeline scheme, and under ``auto`` ``epp-pipelines`` itself,
    under a ceiling) against the exhaustive search (``PlannerOptions.prune=False``), on the batches
    of :func:`auto_part`: CPU seconds of each call (the two interleaved, alternating which runs
    first) and whether they chose the same plan."""
    import dataclasses

    from jvarlen.plan.auto import AutoOptions, EPPPipelinesOptions

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
    import hashlib

    from jvarlen.plan.auto import AutoOptions

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
    import functools

    from jvarlen.plan.auto import AutoOptions
    from jvarlen.plan.service import PlanningService

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


def settings(quick: bool) -> list[Setting]:
    out = []
    for overlap in (False, True):  # the 64 devices / 200K tokens on the shipped workloads
        for wl in ("github", "commoncrawl", "stdlib"):
            for cl in ("h100", "a800"):
                tag = ", pull/push overlapped" if overlap else ""
                out.append(
                    Setting(
                        f"{wl} 7B {cl} 64 dev 200K tok 32K ctx{tag}",
                        wl,
                        "llama-7b",
                        cl,
                        64,
                        200_000,
                        32 * K,
                        0.0,
                        overlap,
                    )
                )
    for wl in ("commoncrawl", "github"):  # Hydraulis §8.2 (F2/F3: 32K context, 100K tokens per iteration)
        for model, devs in (("llama-7b", (8, 16)), ("llama-13b", (16, 32)), ("llama-32b", (32, 64))):
            for n in devs:
                sharded = model == "llama-32b"
                name = f"{wl} {model[6:].upper()} a800-ib200 {n} dev 100K tok 32K ctx, overlapped"
                name += ", sharded stage weights" if sharded else ""
                out.append(Setting(name, wl, model, "a800-ib200", n, 100_000, 32 * K, 0.0, True, sharded))
    # sensitivity: small GEMMs slower (jvarlen.plan.hardware, Hockney m_half); a longer context
    out.append(
        Setting(
            "commoncrawl 7B h100 64 dev 200K tok, m_half 256, overlapped",
            "commoncrawl",
            "llama-7b",
            "h100",
            64,
            200_000,
            32 * K,
            256.0,
            True,
        )
    )
    out.append(
        Setting(
            "github 7B h100 64 dev 400K tok 128K ctx, overlapped",
            "github",
            "llama-7b",
            "h100",
            64,
            400_000,
            128 * K,
            0.0,
            True,
        )
    )
    return out[:2] if quick else out


def write_section(text: str, path: pathlib.Path = ROOT / "docs" / "benchmarks.md") -> None:
    """Replaces (or appends) the "## Strategies" section, leaving every other section alone."""
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    section = "## Strategies\n\n" + text.strip() + "\n"
    pattern = re.compile(r"^## Strategies\n.*?(?=^## |\Z)", re.S | re.M)
    new = pattern.sub(lambda _: section + "\n", old) if pattern.search(old) else old.rstrip() + "\n\n" + section
    path.write_text(new)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--parts", default="compare,timing,gap")
    ap.add_argument("--gap_instances", type=int, default=100)
    ap.add_argument("--auto_iterations", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=str(ROOT / "runs" / "bench_strategies.json"))
    ap.add_argument("--no_write", action="store_true", help="print the section instead of writing docs/benchmarks.md")
    ap.add_argument("--only", default="", help="--parts compare: only the settings whose name matches this regex")
    ap.add_argument(
        "--auto_cpu_compare",
        nargs="+",
        default=(),
        help="JSON files of --parts auto_cpu as BEFORE AFTER [BEFORE AFTER ...] (a pair per run): print the comparison",
    )
    ap.add_argument("--merge", nargs="+", default=(), help="JSON files of parts run separately, merged into --json")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]  # --parts "": rewrite the section from the JSON file
    path = pathlib.Path(args.json)
    record = json.loads(path.read_text()) if path.exists() and not args.quick else {}
    if args.merge:
        record = merge_records([record] + [json.loads(pathlib.Path(f).read_text()) for f in args.merge])
    if "compare" in parts:
        chosen = [s for s in settings(args.quick) if re.search(args.only, s.name)]
        record["compare"] = [compare(s, args.iterations, False) for s in chosen]
    if "timing" in parts:
        record["timing"] = [timing(10, cl) for cl in ("h100", "a800")]
        for t in record["timing"]:
            print(t, flush=True)
    if "auto" in parts:
        record["auto"] = auto_part(args.auto_iterations, args.quick)
    if "service" in parts:
        record["service"] = service_part(args.auto_iterations)
    if "bounds" in parts:
        record["bounds"] = bounds_part(args.auto_iterations, args.quick)
    if "auto_cpu" in parts:
        record["auto_cpu"] = auto_cpu_part(args.auto_iterations, args.quick)
    if args.auto_cpu_compare:
        files = [json.loads(pathlib.Path(f).read_text())["auto_cpu"] for f in args.auto_cpu_compare]
        if len(files) % 2:
            ap.error("--auto_cpu_compare takes BEFORE AFTER pairs")
        print(auto_cpu_table(list(zip(files[::2], files[1::2]))))
    if "bounds_epp" in parts:
        record["bounds_epp"] = bounds_part(args.auto_iterations, args.quick, "epp-pipelines")
    if "gap" in parts:
        record["gap"] = gap(args.gap_instances)
        print(record["gap"], flush=True)
    if not args.quick:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, default=str))
    body = section(record, args)
    print(body)
    if not args.no_write and all(p in record for p in ("compare", "timing", "gap")) and not args.quick:
        write_section(body)  # parts run separately are merged through the JSON file
    return 0


def merge_records(records: list) -> dict:
    """One record of several: the ``compare`` entries of all of them (a later file's entry replaces
    an earlier one of the same setting), in the settings' order; every other part from the last
    record that has it."""
    order = [s.name for s in settings(False)]
    merged, compared = {}, {}
    for record in records:
        for key, value in record.items():
            if key == "compare":
                compared.update({entry["setting"]["name"]: entry for entry in value})
            else:
                merged[key] = value
    if compared:
        known = {name: i for i, name in enumerate(order)}
        merged["compare"] = sorted(compared.values(), key=lambda e: known.get(e["setting"]["name"], len(order)))
    return merged


def section(record, args) -> str:
    out = [
        "Strategy policies (device groups of different schemes in one iteration; issue 15) against the "
        "homogeneous layouts, all on analytic profiles (`jvarlen.plan.hardware`), simulated in the executor's "
        "model (paired ticks, every chunk of a group's step padded to one bucket; the policies' default "
        f"since 2026-11-28). `python scripts/bench_strategies.py --iterations {args.iterations}` "
        "(2-core CPU machine shared with other jobs; timing with `taskset -c 1 python "
        "scripts/bench_strategies.py --parts timing`). Design and reading of the results: "
        '`docs/design/heterogeneous.md`, "Hydraulis policy". "pull/push overlapped": the per-iteration '
        "parameter pull and gradient push (the sync in each group's step overhead, `sync_bytes_per_param`) hidden "
        "behind propagation, as "
        "Hydraulis' subgraph scheduling does (§5.3, Table 1); otherwise charged in full."
    ]
    if "timing" in record:
        rows = [
            "### Planning time (issue bar: ≤ 0.3 s per iteration on one core, 64 devices, 200K tokens)\n",
            "| cluster | model | workload | candidates | proposal (once, 100K docs) CPU s "
            "| plan CPU s median | max | wall median | first call CPU s (builds the cached scheme tables; not in the median) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for t in record["timing"]:
            rows.append(
                f"| {t['cluster']} | {t['model']} | {t['workload']} | {t['candidates']} | {t['proposal_cpu_s']:.2f} "
                f"| {t['cpu_median_s']:.3f} | {t['cpu_max_s']:.3f} | {t['wall_median_s']:.3f} "
                f"| {t['first_cpu_s']:.3f} |"
            )
        out.append("\n".join(rows))
    if "gap" in record:
        g = record["gap"]
        out.append(
            "### Greedy dispatch (App. D Alg. 1) against the exact Eq. 3 optimum\n\n"
            f"{g['greedy-32']['n']} random instances (8-15 documents from CommonCrawl-like or uniform 256-8K "
            "lengths, 2-5 pipelines of random schemes on 16 devices, LLaMA-7B on H100), Eq. 3 solved to "
            f"optimality by CP-SAT ({g['unsolved']} instances where it did not prove optimality are left out; "
            "the groups' step overheads left out of the loads, which would only dilute the ratios); "
            "ratio = greedy objective / optimum. `greedy-32`: our default (trial 0 longest-first, 31 seeded "
            "random orders, ties to the least-loaded pipeline); `greedy-1`: the longest-first trial alone; "
            "`paper-32`: 32 random orders only; `+ls`: then the local search of "
            "`hydraulis_dispatch.local_search` (moves and swaps off the slowest pipeline; the planner's default).\n\n"
            + gap_table(g)
        )
    if "auto" in record:
        out.append(
            "### `auto` against the policies it chooses from\n\n"
            "Per batch, `auto` plans with every policy of `jvarlen.plan.auto.AUTO_POLICIES` (Hydraulis with its "
            "corpus proposal) and keeps the fastest estimate; each policy is also planned on its own. "
            f"`python scripts/bench_strategies.py --parts auto --auto_iterations {args.auto_iterations}`; "
            "CPU s: process time of the whole `auto` call (every policy, one after another).\n\n"
            + auto_table(record["auto"])
        )
    if "bounds" in record:
        out.append(
            "EPP's bounded search against the exhaustive one inside `auto` (`python scripts/bench_strategies.py "
            f"--parts bounds --auto_iterations {args.auto_iterations}`, one core; the same batches as the table "
            "above; CPU s: process time of the whole `auto` call; same plan: every group's chunks, schedule, "
            "recomputation and time equal):\n\n" + bounds_table(record["bounds"])
        )
    if "bounds_epp" in record:
        out.append(
            "The same for `epp-pipelines` planned on its own (`--parts bounds_epp`; no ceiling from the other "
            "policies, only from its own best scheme):\n\n" + bounds_table(record["bounds_epp"])
        )
    if "service" in record:
        rows = [
            "`auto` in the planning service, all batches queued at once (`python scripts/bench_strategies.py "
            "--parts service`; wall seconds per planned iteration):\n",
            "| setting | plan.workers | iterations | wall s per iteration |",
            "|---|---|---|---|",
        ]
        for r in record["service"]:
            rows.append(f"| {r['setting']} | {r['workers']} | {r['iterations']} | {r['wall_per_iteration_s']:.2f} |")
        out.append("\n".join(rows))
    if "compare" in record:
        out.append(
            "### Simulated iteration time against the best homogeneous layout\n\n"
            "iter s: mean predicted iteration time (the slowest group's simulated time, its step overhead "
            "included: optimizer update, parameter pull and gradient push); × static: speedup over the best single homogeneous layout d × P "
            "for all batches; × per-iter homog.: over the best homogeneous layout chosen per batch with the same "
            "dispatch and packing (the `homogeneous` policy); × fixed packing: over the best static layout with "
            "fixed-length packing and even dispatch of the packed sequences (Megatron-LM / DeepSpeed practice, "
            "the baselines of Hydraulis §8: `HomogeneousOptions(packing='fixed')`); prop. × static: the same ratio "
            "as × static on the slowest "
            "group's makespan alone (no step overhead); imbalance: (slowest − fastest group) / slowest; bubble: largest group "
            "bubble; headroom: 1 − the largest peak memory / budget over the batches; strategies: distinct "
            "strategies chosen.\n\n" + summary(record["compare"]) + "\n\n" + compare_table(record["compare"])
        )
    return "\n\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
