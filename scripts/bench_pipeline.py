"""Pipeline executor benchmark on CPU.

1. ``overhead``: the executor (pp = 1, one chunk) over the plain jitted loss+grad step.
2. ``ticks``: per-tick time and compile time versus the number of chunks (pp = 2, 1F1B).
3. ``recompute``: step time versus the number of recomputed layers per stage (one compile).
4. ``order``: 1F1B versus GPipe op order, paired ticks (the executor's) and one op per tick
   (same executable, interleaved).
5. ``policies``: EPP, Seq1F1B, DAPPLE (1F1B) and GPipe plans of the same long-tailed batches
   (document lengths from a shipped workload, scaled to CPU size) through the real executor,
   train step included: measured against predicted step time, peak activations. ``--processes``
   runs one process per stage, each pinned to its own core (jax.distributed on CPU), so a stage's
   idle time is real idle time; without it, one process with pp fake devices, whose programs share
   one thread pool (bubbles then cost almost nothing: that measures compute volume and executor
   overhead, not the schedule).
6. ``overheads``: the ``policies`` runs on calibration batches, and the executor's own costs
   fitted on them (``CostCoefficients.tick_overhead``, ``tick_token_overhead``,
   ``tick_context_overhead``, ``tick_recompute_factor``: the last only from steps that recompute,
   e.g. batches planned under a tight ``--budget-mb``), written into a copy of the profile;
   ``--runs A.spec.json,B.spec.json`` fits on earlier runs' steps instead. The profile's per-bucket
   token factors (``bucket_token_scale``, from whole-model steps) are kept on the executor's chunks
   or dropped (``executor_bucket_scale``), whichever fits the steps better (``--executor-buckets``).
7. ``predict``: ``--profile``'s prediction error on the steps of earlier runs (``--runs``).
8. ``retime``: the plans of earlier runs (``--runs``) timed again on today's executor, one run
   per input under the directory ``--out``: a refit after an executor change on the same steps.
   With ``--profile`` the steps are converted to and predicted by that profile instead of the one
   the runs were planned with (a refit for a re-measured profile; ``overheads`` and ``predict``
   refuse runs on another profile's clock).

In 5, 6 and 8, when the profile carries a reference reading (CPU profiles, :mod:`jvarlen.profile.clock`),
worker 0 times the reference probe as many times as the profile's reading is the minimum over
(the calibration's rounds, spread over the rounds) and the measured steps are converted to the
profile's clock (the machine's speed changes by 20-30 % within an hour here).

Parts 1-4 are ``scripts/pipeline_micro.py``'s; the policies' planning and timing helpers are
``scripts/pipeline_policies.py``'s.

    python scripts/bench_pipeline.py [--tokens 512] [--d-model 128] [--repeats 10] [--parts order]
    python scripts/bench_pipeline.py --parts policies --processes [--seeds 0,1,2] [--out runs/policies.json]
    python scripts/bench_pipeline.py --parts overheads --processes --seeds 100,101 --profile-out runs/p.json
    python scripts/bench_pipeline.py --parts overheads --runs runs/a.spec.json,runs/b.spec.json --profile-out runs/p.json
    python scripts/bench_pipeline.py --parts predict --runs runs/c.spec.json --profile runs/p.json
    python scripts/bench_pipeline.py --parts retime --processes --runs runs/a.spec.json --out runs/again/ [--profile P]

Prints a Markdown table per part (pasted into docs/benchmarks.md, section "Pipeline").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time


def _worker_setup() -> None:
    """A ``--worker RANK`` process of ``--parts policies --processes``: pinned to core RANK with one
    CPU device, before JAX starts (XLA sizes its thread pool from the affinity mask)."""
    if "--worker" not in sys.argv:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
        return
    rank = int(sys.argv[sys.argv.index("--worker") + 1])
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"


_worker_setup()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from pipeline_micro import order, overhead, per_tick, recompute  # noqa: E402
from pipeline_policies import (  # noqa: E402
    POLICIES_RUN,
    REFERENCE_KEY,
    RESIDUAL_POLICY,
    add_recompute_variants,
    adopt_profile,
    batch_documents,
    check_units,
    load_runs,
    long_tailed_batch,
    plan_policies,
    policy_cost,
    profile_clock_scale,
    reference_matches,
    timed_steps,
)

from jvarlen.config import ModelConfig  # noqa: E402
from jvarlen.layout import Layout  # noqa: E402
from jvarlen.model import build_model  # noqa: E402
from jvarlen.plan.buffers import SLOT_COUNTS  # noqa: E402
from jvarlen.runtime.memory_fit import need_bytes  # noqa: E402
from jvarlen.runtime.state import split_model  # noqa: E402

# --------------------------------------------------------------------------- policies, real executor


def run_policies(spec: dict, devices, say) -> dict:
    """Times every (batch, policy) of ``spec`` as one train step on ``devices`` (one per stage),
    interleaved round by round; -> {key: {"times": [...], "compile_s", "temp_bytes", ...}}."""
    from jvarlen.api import Session
    from jvarlen.config import Config, OptimizerConfig
    from jvarlen.plan.plan import Plan
    from jvarlen.runtime.feed import Iteration

    cfg = ModelConfig(**spec["model"])
    session = Session.from_config(Config(model=cfg, optimizer=OptimizerConfig(warmup_steps=0)), devices=devices)
    layout = Layout(1, spec["pp"], 1)
    step = session.plan_step(layout, chunk_multiple=1, residual_policy=spec["residual_policy"])
    entries, out = {}, {}
    for b in spec["batches"]:
        docs = batch_documents(b["lengths"], cfg.vocab_size, b["seed"])
        pieces = [p for p in __import__("jvarlen.api", fromlist=["as_pieces"]).as_pieces(docs)]
        for (policy, plan_json), table in [(pj, tb) for pj in b["plans"].items() for tb in spec["tables"]]:
            plan = Plan.from_json(plan_json)
            it = Iteration(0, pieces, np.zeros(len(pieces), np.int64), {}, groups=[pieces], plans=[plan])
            step.strategy.paired = table == "paired"
            prepared = step.strategy.prepare(it, ())  # the plan's own (rounded) signature
            key = f"{b['seed']}/{policy}/{table}"
            t0 = time.perf_counter()
            compiled = step.compiled(prepared)
            mem = compiled.memory_analysis()
            out[key] = {
                "compile_s": time.perf_counter() - t0,
                "temp_bytes": int(mem.temp_size_in_bytes) if mem is not None else None,
                # what the step needs per device: arguments + outputs + temporaries - donated
                "need_bytes": need_bytes(mem) if mem is not None else None,
                "signature": {k: getattr(prepared.key, k) for k in ("bucket", "n_chunks", "n_ticks", "context")}
                | {k: getattr(prepared.key, k) for k in SLOT_COUNTS + ("fused",)},
                "times": [],
            }
            entries[key] = prepared
            say(f"compiled {key}: {out[key]['compile_s']:.1f} s")
    probe, calls = None, [0] * spec["repeats"]
    if spec.get("reference_s"):  # the profile's reference probe, before the rounds (jvarlen.profile.clock)
        from jvarlen.profile.clock import calls_per_round
        from jvarlen.profile.harness import ChunkHarness, reference_probe

        probe = reference_probe(ChunkHarness(cfg, residual=spec.get("probe_residual_policy", "all")))
        # as many calls as the profile's reading is the minimum over (one per round where unknown)
        calls = calls_per_round(spec.get("probe_calls") or spec["repeats"], spec["repeats"])
        out[REFERENCE_KEY] = []
    state = session.state
    for prepared in entries.values():  # warm-up
        state, metrics = step(state, prepared)
        jax.block_until_ready(metrics)
    keys = list(entries)
    for r in range(spec["repeats"]):
        for _ in range(calls[r]):
            out[REFERENCE_KEY].append(probe())
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:  # rotate the order every round
            t0 = time.perf_counter()
            state, metrics = step(state, entries[key])
            jax.block_until_ready(metrics)
            out[key]["times"].append(time.perf_counter() - t0)
        say(f"round {r + 1}/{spec['repeats']}")
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def policy_worker(args) -> None:
    """One stage's process (``--worker RANK``, pinned by :func:`_worker_setup`)."""
    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.pp, process_id=args.worker)
    with open(args.spec) as f:
        spec = json.load(f)
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    say = (lambda m: print(f"[worker 0] {m}", flush=True)) if args.worker == 0 else (lambda m: None)
    out = run_policies(spec, devices, say)
    if args.worker == 0:
        with open(spec["result"], "w") as f:
            json.dump(out, f)
    jax.distributed.shutdown()


def policies(cfg, args) -> None:
    """Plans every policy on the same batches, runs them on the executor, prints the table."""
    spec, times = measure_policies(cfg, args)
    report_policies(spec, times, args.out)


def overheads(cfg, args) -> None:
    """Fits the executor's own costs (``CostCoefficients.tick_overhead``, ``tick_token_overhead``
    per token of the step's bucket, ``tick_context_overhead`` per token of its context bucket and
    ``tick_recompute_factor`` forwards per recomputed layer) on
    the steps of calibration batches (``--seeds``: keep them apart from the seeds you validate on),
    or on the steps of earlier runs (``--runs``: their ``.spec.json`` files, the ``.times.json``
    beside them), and writes the profile with it to ``--profile-out``. Validate with ``--parts
    policies --profile <it>``."""
    import datetime

    from jvarlen.plan.cost_fit import EXECUTOR_TERMS, fit_tick_overhead, tick_overhead_terms
    from jvarlen.profile.clock import calibration_rounds

    runs = load_runs(args.runs) if args.runs else [measure_policies(cfg, args)]
    cost, path = policy_cost(args, cfg)
    check_units(runs, cost, path)
    scales = [profile_clock_scale(spec, times) for spec, times in runs]
    steps = list(timed_steps(runs))
    fit_terms = [t for t in args.fit_terms.split(",") if t]

    def fit_with(bucket_scale: bool):
        """The executor terms fitted with or without the profile's bucket factors on the executor's
        chunks: (cost model, fit, rows, median relative error on the steps)."""
        model = cost.replace(coeffs=cost.coeffs.replace(executor_bucket_scale=bucket_scale))
        rows = []
        for key, plan, table, measured in steps:
            sim = "paired" if table == "paired" else "ticks"
            terms = tick_overhead_terms(plan.schedule, plan.chunk_shapes(), np.asarray(plan.ckpt_layers), model, sim)
            rows.append((key, terms, measured))
        fit = fit_tick_overhead([t for _, t, _ in rows], [m for _, _, m in rows], fit=fit_terms)
        errors = [abs(t[0] + float(np.dot(fit, t[1:])) - m) / m for _, t, m in rows]
        return model, fit, rows, float(np.median(errors))

    choices = {"in-situ": [True], "flat": [False], "auto": [True, False]}[args.executor_buckets]
    fits = [fit_with(choice) for choice in choices]
    for choice, (_, f, _, err) in zip(choices, fits):
        print(
            f"executor chunks {'with' if choice else 'without'} the profile's bucket factors: median |error| "
            f"{100 * err:.1f} % ({f[0] * 1e3:.2f} ms, {f[1] * 1e6:.2f} us, {f[2] * 1e6:.2f} us, {f[3]:.3f})"
        )
    cost, fit, rows, _ = min(fits, key=lambda x: x[3])
    tick, per_token, per_context, recompute = fit
    print(
        f"\ntick overhead {tick * 1e3:.2f} ms + {per_token * 1e6:.2f} us per bucket token + {per_context * 1e6:.2f} us "
        f"per context token; a recomputed layer costs {recompute:.3f} forwards more; executor chunks "
        f"{'with' if cost.coeffs.executor_bucket_scale else 'without'} the profile's bucket factors; fitted on "
        f"{len(rows)} steps; profile {os.path.basename(path)}; measured x {', '.join(f'{s:.3f}' for s in scales)} "
        "(reference probe)"
    )
    print(
        "| step | ticks on the critical path | bucket | context | recomputed forward s | measured s "
        "| predicted s before | after | error before | after |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, (base, ticks, tick_tokens, tick_context, recomputed), m in rows:
        after = base + float(np.dot(fit, (ticks, tick_tokens, tick_context, recomputed)))
        bucket, context = (tick_tokens / ticks, tick_context / ticks) if ticks else (0, 0)
        print(
            f"| {key} | {ticks:.0f} | {bucket:.0f} | {context:.0f} | {recomputed:.3f} | {m:.3f} | {base:.3f} "
            f"| {after:.3f} | {100 * (base / m - 1):+.1f} % | {100 * (after / m - 1):+.1f} % |"
        )
    mode = "one process per stage, each pinned to its own core" if args.processes else "one process"
    meta = dataclasses.replace(
        cost.coeffs.meta,
        source=f"{cost.coeffs.meta.source}; executor terms (tick overheads, recomputation) fitted by scripts/bench_pipeline.py --parts overheads "
        + (
            f"(seeds {args.seeds}, {len(rows)} steps, {mode})"
            if not args.runs
            else f"(--runs {', '.join(_short(s) for s in args.runs.split(','))}, {len(rows)} steps)"
        )
        + ("" if set(fit_terms) == set(EXECUTOR_TERMS) else f", fitted: {', '.join(fit_terms)}")
        + ("" if cost.coeffs.executor_bucket_scale else ", executor chunks at one per-token cost"),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        reference_calls=calibration_rounds(path) or 0,  # the meta's, else the report's beside it
    )
    fitted = dict(zip(EXECUTOR_TERMS, fit))
    cost.coeffs.replace(**fitted, meta=meta).save(args.profile_out)  # executor_bucket_scale: the chosen
    print(f"wrote {args.profile_out}")


def _short(path: str) -> str:
    """A run's spec file as ``directory/file``: runs of one batch set sit in different directories."""
    return os.path.join(os.path.basename(os.path.dirname(os.path.abspath(path))), os.path.basename(path))


def predict(cfg, args) -> None:
    """``--profile``'s error on every paired step of earlier runs (``--runs``), each plan as it was
    planned then: how a refitted profile does on steps it was not fitted on, without timing again."""
    from jvarlen.plan.assemble import simulate

    cost, path = policy_cost(args, cfg)
    print(f"\nprofile {os.path.basename(path)}: |predicted - measured| / measured per step (profile clock)")
    print("| run | steps | median | max |")
    print("|---|---|---|---|")
    everything, runs = [], load_runs(args.runs)
    check_units(runs, cost, path)
    for name, run in zip(args.runs.split(","), runs):
        errors = []
        for _, plan, table, measured in timed_steps([run]):
            if table == "paired":
                predicted = simulate(plan, cost, "paired").iteration_time
                errors.append(abs(predicted - measured) / measured)
        everything += errors
        print(
            f"| {os.path.basename(name)} | {len(errors)} | {100 * np.median(errors):.1f} % | {100 * max(errors):.1f} % |"
        )
    print(
        f"all {len(everything)} steps: median {100 * np.median(everything):.1f} %, "
        f"p90 {100 * np.percentile(everything, 90):.1f} %, max {100 * max(everything):.1f} %"
    )


def measure_policies(cfg, args) -> tuple[dict, dict]:
    """Plans ``--policies`` on the batches of ``--seeds`` and times every plan on the executor:
    (spec, times) as :func:`run_policies` returns them."""
    cost, profile = policy_cost(args, cfg)
    names = [p for p in args.policies.split(",") if p]
    spec = {
        "model": dataclasses.asdict(cfg),
        "pp": args.pp,
        "repeats": args.repeats,
        "residual_policy": RESIDUAL_POLICY,
        "batches": [],
        "profile": profile,
        "processes": args.processes,
        "tables": [t for t in args.tables.split(",") if t],
        # the probe only means something for the profile's own model and probe
        "reference_s": cost.coeffs.meta.reference_s if reference_matches(cost) else 0.0,
        # the probe's layers keep what the profile's did (older profiles: plain autodiff)
        "probe_residual_policy": cost.coeffs.meta.profiled_residual_policy,
    }
    for seed in [int(x) for x in args.seeds.split(",")]:
        lengths = long_tailed_batch(seed, args.workload, args.batch_tokens, args.context, args.scale)
        plans = plan_policies(lengths, cost, args, names)
        spec["batches"].append({"seed": seed, "lengths": lengths, "plans": {k: p.to_json() for k, p in plans.items()}})
        print(f"seed {seed}: {len(lengths)} documents, {sum(lengths)} tokens, longest {max(lengths)}", flush=True)
    return spec, time_spec(spec, args.out, args)


def retime(cfg, args) -> None:
    """Times the very plans of earlier runs (``--runs``) again on today's executor, each written
    beside ``--out`` under its own name (``--out`` a directory): a refit of the executor terms
    after an executor change then sees the same steps as the fit before it."""
    os.makedirs(args.out, exist_ok=True)
    for spec_path, (spec, _) in zip(args.runs.split(","), load_runs(args.runs)):
        spec["retimed_from"] = os.path.basename(spec_path)
        spec["repeats"] = args.repeats
        spec["processes"] = args.processes
        if args.profile:  # the plans as planned, their steps converted to and predicted by --profile
            adopt_profile(spec, args.profile)
        if args.recompute_variants:
            add_recompute_variants(spec)
        out = os.path.join(args.out, os.path.basename(spec_path).replace(".spec.json", ".json"))
        print(f"retiming {spec_path} -> {out}", flush=True)
        report_policies(spec, time_spec(spec, out, args), out)


def time_spec(spec: dict, out: str, args) -> dict:
    """Writes ``spec`` beside ``out`` and times its plans, one process per stage with
    ``--processes``: the times, as :func:`run_policies` returns them."""
    from jvarlen.profile.clock import calibration_rounds

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    spec["result"] = out.replace(".json", ".times.json")
    if spec.get("reference_s"):
        spec["probe_calls"] = calibration_rounds(spec["profile"]) if os.path.exists(spec["profile"]) else None
        if not spec["probe_calls"]:
            print(f"{spec['profile']}: its reading's probe calls are not recorded; one call per round", flush=True)
    spec_path = out.replace(".json", ".spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    if args.processes:
        port = _free_port()
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--spec",
            spec_path,
            "--port",
            str(port),
            "--pp",
            str(spec["pp"]),
        ]
        procs = [subprocess.Popen(cmd + ["--worker", str(r)]) for r in range(spec["pp"])]
        if any(p.wait() for p in procs):
            raise SystemExit("a worker failed")
        with open(spec["result"]) as f:
            return json.load(f)
    return run_policies(spec, jax.devices()[: spec["pp"]], lambda m: print(m, flush=True))


def _need(row: dict) -> str:
    """The step's whole need against the plan's budget, e.g. ``91 (of 120, fits)``."""
    if not row["executor_need_mb"]:
        return "not read"
    if not row["budget_mb"]:
        return f"{row['executor_need_mb']:.0f}"
    verdict = "fits" if row["executor_need_mb"] <= row["budget_mb"] else "OVER"
    return f"{row['executor_need_mb']:.0f} (of {row['budget_mb']:.0f}, {verdict})"


def report_policies(spec: dict, times: dict, out: str) -> None:
    """Markdown table + JSON: per batch and policy, measured (min, median) vs predicted step time."""
    from jvarlen.plan.plan import Plan

    rows = []
    scale = profile_clock_scale(spec, times)
    for b in spec["batches"]:
        for (policy, plan_json), table in [(pj, tb) for pj in b["plans"].items() for tb in spec["tables"]]:
            plan = Plan.from_json(plan_json)
            key = f"{b['seed']}/{policy}/{table}"
            t = np.asarray(times[key]["times"]) * scale
            st = plan.stats
            if table != "paired":  # the plan's prediction is for paired ticks: the single-op table's
                from jvarlen.plan.assemble import simulate

                ns = argparse.Namespace(profile=spec["profile"], budget_mb=0, pp=spec["pp"])
                cost, _ = policy_cost(ns, ModelConfig(**spec["model"]))
                st = dict(st, iteration_time_s=simulate(plan, cost, "ticks").iteration_time)
            rows.append(
                dict(
                    seed=b["seed"],
                    policy=policy,
                    table=table,
                    chunks=plan.n_chunks,
                    recomputed=int(np.asarray(plan.ckpt_layers).sum()),
                    measured_min_s=float(t.min()),
                    measured_median_s=float(np.median(t)),
                    measured_max_s=float(t.max()),
                    predicted_s=float(st["iteration_time_s"]),
                    bubble=float(st["bubble_ratio"]),
                    predicted_peak_mb=float(max(st["peak_memory_bytes"])) / 1e6,
                    fits=bool(st.get("fits_memory", True)),
                    executor_temp_mb=(times[key]["temp_bytes"] or 0) / 1e6,
                    executor_need_mb=(times[key].get("need_bytes") or 0) / 1e6,  # 0: an earlier run's
                    budget_mb=float(st.get("memory_budget_bytes", 0)) / 1e6,
                    signature=times[key]["signature"],
                )
            )
    mode = "one process per stage, each pinned to its own core" if spec["processes"] else "one process, fake devices"
    units = f"profile seconds (reference probe: measured x {scale:.3f})" if scale != 1.0 else "seconds"
    print(f"\n{mode}; profile {os.path.basename(spec['profile'])}; {spec['repeats']} interleaved rounds; {units}")
    print(
        "| seed | policy | tick table | chunks | recomputed layers | measured s (min / median / max) | predicted s | "
        "measured / predicted | predicted bubble | predicted peak MB | executor temp MB | executor needs MB "
        "(of the budget) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['seed']} | {r['policy']} | {r['table']} | {r['chunks']} | {r['recomputed']} | {r['measured_min_s']:.3f} / "
            f"{r['measured_median_s']:.3f} / {r['measured_max_s']:.3f} | {r['predicted_s']:.3f} | "
            f"{r['measured_median_s'] / r['predicted_s']:.2f} | {r['bubble']:.2f} | {r['predicted_peak_mb']:.0f}"
            f"{'' if r['fits'] else ' (over budget)'} | {r['executor_temp_mb']:.0f} | "
            f"{_need(r)} |"
        )
    by = {}
    for r in rows:
        by.setdefault(r["policy"] if r["table"] == "paired" else f"{r['policy']} ({r['table']})", []).append(r)
    print("\n| policy | mean measured s (median per batch) | mean predicted s | epp speedup (measured / predicted) |")
    print("|---|---|---|---|")
    epp = {r["seed"]: r for r in by.get("epp", [])}
    for policy, rs in by.items():
        m, p = np.mean([r["measured_median_s"] for r in rs]), np.mean([r["predicted_s"] for r in rs])
        both = [r for r in rs if r["seed"] in epp]  # a policy that could not plan a batch: the others'
        speed = ""
        if both:
            e = [epp[r["seed"]] for r in both]
            ratio = {
                k: np.mean([r[k] for r in both]) / np.mean([r[k] for r in e])
                for k in ("measured_median_s", "predicted_s")
            }
            speed = f"{ratio['measured_median_s']:.2f}x / {ratio['predicted_s']:.2f}x"
            if len(both) < len(rs) or len(both) < len(epp):
                speed += f" ({len(both)} batches both planned)"
        print(f"| {policy} | {m:.3f} | {p:.3f} | {speed} |")
    errs = [abs(r["measured_median_s"] - r["predicted_s"]) / r["measured_median_s"] for r in rows]
    print(f"\nmedian |measured - predicted| / measured: {100 * np.median(errs):.1f} % over {len(errs)} runs")
    with open(out, "w") as f:
        json.dump({"mode": mode, "profile": spec["profile"], "profile_clock_scale": scale, "rows": rows}, f, indent=1)


PARTS = ("overhead", "ticks", "recompute", "order", "policies", "overheads", "retime", "predict")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--attention", default="xla")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--chunks", type=int, default=1, help="--parts overhead: chunks (rows of the plain step)")
    parser.add_argument("--parts", default="overhead,ticks,recompute,order")
    # --parts policies
    parser.add_argument("--processes", action="store_true", help="one process per stage, pinned to its own core")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tables", default="paired", help="tick tables to run each plan in: paired,single")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--policies", default=",".join(POLICIES_RUN))
    parser.add_argument("--workload", default="github")
    parser.add_argument("--scale", type=int, default=16, help="workload lengths are divided by this")
    parser.add_argument("--context", type=int, default=4096, help="documents are truncated to this")
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--min-slice", type=int, default=256)
    parser.add_argument("--seq1f1b-chunk", type=int, default=512)
    parser.add_argument("--reference-context", type=int, default=6144)
    parser.add_argument("--budget-mb", type=float, default=0.0, help="memory budget per device (0: the profile's)")
    parser.add_argument("--profile", help="cost profile (default: the shipped CPU profile of the model)")
    parser.add_argument("--out", default="runs/bench_policies.json")
    parser.add_argument("--profile-out", default="runs/profile_tick_overhead.json", help="--parts overheads: output")
    parser.add_argument(
        "--runs",
        help="earlier runs' .spec.json files: --parts overheads fits on them instead of timing, --parts predict "
        "reports --profile's error on them",
    )
    parser.add_argument(
        "--recompute-variants",
        action="store_true",
        help="--parts retime: also time each plan that recomputes nothing with every layer recomputed",
    )
    parser.add_argument(
        "--fit-terms",
        default="tick_overhead,tick_token_overhead,tick_context_overhead,tick_recompute_factor",
        help="--parts overheads: the executor terms fitted (the others 0)",
    )
    parser.add_argument(
        "--executor-buckets",
        choices=("auto", "in-situ", "flat"),
        default="auto",
        help="--parts overheads: the executor's chunks with the profile's per-bucket token factors (in-situ), "
        "at one per-token cost (flat), or whichever fits the steps better (auto)",
    )
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return policy_worker(args)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    cfg = ModelConfig(
        d_model=args.d_model,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=3 * args.d_model,
        compute_dtype="float32",
        attention=args.attention,
    )
    graphdef, params = split_model(build_model(cfg))
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, d_model={cfg.d_model}, layers={cfg.num_layers}, "
        f"attention={cfg.attention}, best of {args.repeats}"
    )
    parts = args.parts.split(",")
    if "overhead" in parts:
        overhead(graphdef, cfg, params, args.tokens, args.repeats, args.chunks)
    if "ticks" in parts:
        per_tick(graphdef, cfg, params, args.tokens, args.repeats)
    if "recompute" in parts:
        recompute(graphdef, cfg, params, args.tokens, args.repeats)
    if "order" in parts:
        order(graphdef, cfg, params, args.tokens, args.repeats, profile=args.profile)
    if "policies" in parts:
        policies(cfg, args)
    if "overheads" in parts:
        overheads(cfg, args)
    if "retime" in parts:
        if not args.runs:
            parser.error("--parts retime needs --runs")
        retime(cfg, args)
    if "predict" in parts:
        if not args.runs:
            parser.error("--parts predict needs --runs")
        predict(cfg, args)


if __name__ == "__main__":
    main()
