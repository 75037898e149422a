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
run separately. The settings and batches are ``scripts/strategy_settings.py``'s, the ``auto`` parts
``scripts/bench_auto.py``'s.
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_auto import (  # noqa: E402
    auto_cpu_part,
    auto_cpu_table,
    auto_part,
    auto_table,
    bounds_part,
    bounds_table,
    service_part,
)
from strategy_settings import (  # noqa: E402
    ROOT,
    K,
    Setting,
    corpus,
    costs_for,
    prepare,
    run_plan,
    settings,
    token_batch,
)

from jvarlen.plan.hydraulis import HomogeneousOptions, homogeneous_strategies, scheme_space  # noqa: E402
from jvarlen.plan.strategy import strategy_policies  # noqa: E402
from jvarlen.plan.workloads import MIXTURES  # noqa: E402


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
