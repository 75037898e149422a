"""Predicted vs measured step time of held-out real plans (the cost-model accuracy bar).

Plans: documents drawn from the stdlib corpus (real file lengths, byte tokens, capped at
``max_doc`` tokens), chunked with a per-plan chunk capacity: long documents split into
slices (split chunks, the last slice packed with short documents into a hybrid chunk),
short documents packed first-fit-decreasing (batched chunks); recomputation per chunk
drawn from {0, L/2, L} layers. None of these chunk shapes is a profiling shape.

Each plan is run by :func:`jvarlen.profile.harness.run_plan` (real decoder, every chunk
forward + backward with its recomputation, gradients accumulated, AdamW update; pp = 1,
Ulysses degree ``--sp``) and timed (min of ``--repeats``; on CPU process CPU time of this process pinned to one core (``--core``,
:mod:`jvarlen.profile.clock`, the profiler's clock), divided by sp for sp > 1 because the fake
devices are threads of this process (:func:`jvarlen.profile.harness.per_device_divisor`); wall
time is recorded too). On CPU the reference probe (:func:`jvarlen.profile.harness.reference_probe`)
runs before every repeat, and the measurement is converted to the profile's clock with the probe
readings of both (:func:`jvarlen.profile.clock.to_profile_clock`; this machine's speed drifts by
20-30 % within an hour); the raw error is reported beside it (``--no_reference``: no probe). The
reading beside a plan is the same statistic as the profile's (each probe chunk's minimum over as
many calls as the calibration had rounds, ``--probe_calls``): the plan's own calls and those of
the plans measured next to it (:func:`jvarlen.profile.clock.nearest_probe_reading`); the error
with the plan's own calls alone is reported beside it (``own_probe``). The
prediction is the simulator's iteration time (InfiniPipe Eq. 4-11 via the cost model) with the
profile's coefficients for that sp. Chunk shapes that the profile's report timed are counted and
reported (``profiled_shapes_in_plans``; 0 means every plan is held out).

``--also_measurements`` adds plans measured by earlier runs (any sp; old files without an ``sp``
field are sp = 1) to the same summary: per sp and over all plans, all predicted with the one
profile given.

Usage: ``python scripts/validate_cost_model.py --profile PATH [--sp 2] [--plans 36]
[--measurements M.json] [--also_measurements OLD.json ...] [--out runs/validate.json]``
(without ``--profile`` the profile is measured first with ``python -m jvarlen.profile``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

MIN_MED_MAX = (("min", 0), ("median", 50), ("max", 100))


def make_plan(rng, pool, capacity: int, max_doc: int, budget: int, num_layers: int):
    """-> (chunk shapes, chunk_prev, ckpt layers, doc ids) of one plan of ~``budget`` tokens."""
    from jvarlen.plan.chunk import ChunkShape

    docs, total = [], 0
    while total < budget:
        n = int(min(pool[rng.integers(pool.size)], max_doc))
        docs.append(n)
        total += n
    shapes, prev, owners = [], [], []
    tails, shorts = [], []
    for d, n in enumerate(docs):
        if n <= capacity:
            shorts.append((n, d))
            continue
        start, last = 0, -1
        while n - start > capacity:
            shapes.append(ChunkShape(start, (capacity,), tail=False))
            prev.append(last)
            owners.append((d,))
            last = len(shapes) - 1
            start += capacity
        tails.append((start, n - start, d, last))
    bins = [[ctx, [s], [d], last] for ctx, s, d, last in tails]  # hybrid candidates: tail first
    for n, d in sorted(shorts, reverse=True):
        for b in bins:
            if sum(b[1]) + n <= capacity:
                b[1].append(n)
                b[2].append(d)
                break
        else:
            bins.append([0, [n], [d], -1])
    for ctx, sl, ds, last in bins:
        shapes.append(ChunkShape(ctx, tuple(sl), tail=True))
        prev.append(last)
        owners.append(tuple(ds))
    # order: every chunk after the one it continues
    order = sorted(range(len(shapes)), key=lambda k: (shapes[k].context, k))
    pos = {k: i for i, k in enumerate(order)}
    shapes = [shapes[k] for k in order]
    prev = [pos[prev[k]] if prev[k] >= 0 else -1 for k in order]
    owners = [owners[k] for k in order]
    ckpt = rng.choice([0, num_layers // 2, num_layers], size=len(shapes))
    return shapes, prev, ckpt, owners


def measure_plans(args, model_cfg, shape) -> list[dict]:
    """Generates ``args.plans`` plans (deterministic in ``args.seed``) and times each one."""
    import jax

    from jvarlen.plan.workloads import stdlib_lengths
    from jvarlen.profile.harness import (
        REFERENCE_PROBE,
        ChunkHarness,
        clock_name,
        per_device_divisor,
        reference_probe,
        run_plan,
    )
    from jvarlen.profile.measure import ProfileGrid

    grid = ProfileGrid()
    buckets = dict(token_buckets=grid.token_buckets, context_buckets=grid.context_buckets)
    harness = ChunkHarness(model_cfg, sp=args.sp, residual=args.residual_policy, **buckets)
    probe = None
    if not args.no_reference and jax.default_backend() == "cpu":
        sp1 = harness if args.sp == 1 else ChunkHarness(model_cfg, sp=1, residual=args.residual_policy, **buckets)
        probe = reference_probe(sp1)
    capacities = [c for c in (512, 768, 1024, 1536, 2048) if c <= max(grid.token_buckets)]
    pool = np.asarray(stdlib_lengths())
    rng = np.random.default_rng(args.seed)
    rows, t_start = [], time.time()
    for i in range(args.plans):
        capacity = int(rng.choice(capacities))
        cap_doc = min(args.max_doc, args.max_context + capacity)
        budget = int(rng.integers(args.min_tokens, args.max_tokens))
        shapes, prev, ckpt, owners = make_plan(rng, pool, capacity, cap_doc, budget, shape.num_layers)
        times = run_plan(harness, shapes, ckpt, repeats=args.repeats, probe=probe)
        kinds = sorted({"split" if not s.tail else ("hybrid" if s.context else "batched") for s in shapes})
        rows.append(
            {
                "plan": i,
                "capacity": capacity,
                "chunks": [[s.context, list(s.slices), s.tail] for s in shapes],
                "chunk_prev": prev,
                "chunk_docs": [list(o) for o in owners],
                "ckpt": [int(k) for k in ckpt],
                "kinds": kinds,
                "tokens": int(sum(s.tokens for s in shapes)),
                "sp": args.sp,
                "clock_divisor": per_device_divisor(args.sp),
                "measured_cpu_s": times["cpu"],
                "measured_wall_s": times["wall"],
                "clock": clock_name(),
                "reference_cpu_s": times.get("reference"),
                "reference_probe": REFERENCE_PROBE if probe else None,
                "reference_runs": times.get("reference_runs"),
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        )
        ref = f"  probe {times['reference'] * 1e3:6.1f} ms" if probe else ""
        print(
            f"plan {i:2d}: {len(shapes):2d} chunks {rows[-1]['tokens']:5d} tok cap {capacity:4d} {'/'.join(kinds):20s} "
            f"cpu {times['cpu'] * 1e3:8.1f} ms  wall {times['wall'] * 1e3:8.1f} ms{ref}  [{time.time() - t_start:5.0f}s]",
            flush=True,
        )
    return rows


def check_measurements(saved: dict, path: str, model: str, backend: str, residual: str) -> None:
    """Measurements of another model, backend or residual policy than the profile's are refused
    (they would be scored against the wrong profile). Files from before the policy was recorded
    timed plain-autodiff layers."""
    theirs = (saved.get("model", model), saved.get("backend", backend), saved.get("residual_policy", "all"))
    if theirs != (model, backend, residual):
        sys.exit(
            f"validate_cost_model: {path} holds measurements of {theirs[0]} on {theirs[1]} with residual_policy "
            f"{theirs[2]!r}, not of this {model} on {backend} with {residual!r}"
        )


def error_summary(rows: list[dict], key: str = "rel_err") -> dict:
    """|predicted − measured| / measured (``r[key]``) over ``rows``: median, p90, max, mean signed,
    bar met."""
    errs = np.abs([r[key] for r in rows])
    return {
        "plans": len(rows),
        "median_abs_rel_err": float(np.median(errs)),
        "p90_abs_rel_err": float(np.percentile(errs, 90)),
        "max_abs_rel_err": float(errs.max()),
        "mean_signed_rel_err": float(np.mean([r[key] for r in rows])),
        "passes": bool(np.median(errs) <= 0.05 and np.percentile(errs, 90) <= 0.10),
    }


def pool_probe_readings(rows: list[dict], probe_name: str, calls: int) -> None:
    """Sets ``reference_pooled_s`` of every row timed with the probe ``probe_name``:
    :func:`~jvarlen.profile.clock.nearest_probe_reading` over the rows of the same measurement run
    (``source``, sp), in measurement order."""
    from jvarlen.profile.clock import nearest_probe_reading

    runs: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("reference_runs") and r.get("reference_probe") == probe_name:
            runs.setdefault((r.get("source", ""), int(r.get("sp", 1))), []).append(r)
    for run in runs.values():
        run.sort(key=lambda r: r["plan"])
        calls_per_plan = [r["reference_runs"] for r in run]
        for i, r in enumerate(run):
            r["reference_pooled_s"] = nearest_probe_reading(calls_per_plan, i, calls)


def profiled_shapes(profile: str) -> dict[int, set[str]]:
    """Chunk shapes (``str(ChunkShape)``) timed by the profile's report, per sp: the layer-program
    grid and the calibration chunks. Empty when the report is not next to the profile."""
    from jvarlen.plan.chunk import ChunkShape

    path = profile.replace(".json", ".report.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        report = json.load(f)
    out = {}
    for sp, sub in [(1, report)] + [(int(k), v) for k, v in report.get("sp_reports", {}).items()]:
        keys = set(sub["raw"])
        keys |= {str(ChunkShape(c, tuple(s), bool(t))) for (c, s, t), _ in sub.get("calibration", [])}
        out[sp] = keys
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="profile JSON (default: measure one now)")
    ap.add_argument(
        "--config",
        help="run YAML whose model (and, without --profile, residual policy) is used (default: Config())",
    )
    ap.add_argument("--plans", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max_doc", type=int, default=8192, help="documents are truncated to this many tokens")
    ap.add_argument("--max_context", type=int, default=2048, help="largest context of a split chunk (<= 6144)")
    ap.add_argument("--min_tokens", type=int, default=2000, help="plan token budget is drawn from [min, max)")
    ap.add_argument("--max_tokens", type=int, default=4500)
    ap.add_argument("--measurements", help="JSON of timed plans: reused if it exists, else written")
    ap.add_argument("--measure_only", action="store_true", help="time the plans and stop (no profile needed)")
    ap.add_argument("--out", default="runs/validate_cost_model.json")
    ap.add_argument("--gantt", help="write the Gantt chart of the first plan here (PNG)")
    ap.add_argument("--single_thread_flag", action="store_true", help="also pass XLA's single-thread flag")
    ap.add_argument("--no_pin", action="store_true", help="do not pin the process to one core (old clock)")
    ap.add_argument("--core", type=int, help="core to pin to (default: $JVARLEN_CPU_CORE or the first allowed)")
    ap.add_argument("--no_reference", action="store_true", help="CPU: no reference probe (plain seconds)")
    ap.add_argument(
        "--probe_calls",
        type=int,
        help="probe calls per reading beside a plan (default: the profile's calibration rounds; 0: the plan's own)",
    )
    ap.add_argument("--sp", type=int, default=1, help="Ulysses degree of the measured plans (fake CPU devices)")
    ap.add_argument("--also_measurements", nargs="*", default=[], help="measured-plan JSONs of earlier runs to include")
    ap.add_argument(
        "--no_per_sp", action="store_true", help="baseline: drop the per-sp coefficients (ideal 1/sp scaling of sp = 1)"
    )
    args = ap.parse_args(argv)
    if args.sp > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # before JAX starts
        os.environ["XLA_FLAGS"] = (
            f"--xla_force_host_platform_device_count={args.sp} " + os.environ.get("XLA_FLAGS", "")
        ).strip()
    if args.single_thread_flag:
        from jvarlen.profile import SINGLE_THREAD_XLA_FLAGS

        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + SINGLE_THREAD_XLA_FLAGS).strip()
    from jvarlen.profile.clock import cpu_backend_expected, pin_one_core

    if not args.no_pin and cpu_backend_expected():  # the profiler's clock, before JAX starts
        pin_one_core(args.core)

    import jax

    from jvarlen.config import Config, load_config
    from jvarlen.layout import Layout
    from jvarlen.plan.chunk import ChunkShape
    from jvarlen.plan.cost import CostCoefficients, CostModel, ModelShape
    from jvarlen.plan.schedule import one_f_one_b
    from jvarlen.plan.simulator import simulate
    from jvarlen.profile.clock import calibration_rounds, to_profile_clock
    from jvarlen.runtime.compile_cache import enable_persistent_cache as enable_compilation_cache

    enable_compilation_cache(os.path.join(os.path.expanduser("~"), ".cache", "jvarlen", "xla"))
    run_cfg = load_config(args.config) if args.config else Config()
    model_cfg = run_cfg.model
    shape = ModelShape.from_config(model_cfg)
    # the plans' layers keep what the profile's layers kept (profiles before the field: plain autodiff)
    if args.profile:
        args.residual_policy = CostCoefficients.load(args.profile).meta.profiled_residual_policy
    else:
        args.residual_policy = run_cfg.parallel.residual_policy
    if args.measurements and os.path.exists(args.measurements):
        with open(args.measurements) as f:
            saved = json.load(f)
        check_measurements(saved, args.measurements, shape.key(), jax.default_backend(), args.residual_policy)
        rows = saved["plans"]
    else:
        rows = measure_plans(args, model_cfg, shape)
        if args.measurements:
            os.makedirs(os.path.dirname(os.path.abspath(args.measurements)), exist_ok=True)
            with open(args.measurements, "w") as f:
                saved = {"backend": jax.default_backend(), "model": shape.key(), "sp": args.sp}
                json.dump(dict(saved, residual_policy=args.residual_policy, plans=rows), f, indent=1)
    for path in args.also_measurements:
        with open(path) as f:
            saved = json.load(f)
        check_measurements(saved, path, shape.key(), jax.default_backend(), args.residual_policy)
        rows = rows + [dict(r, source=path) for r in saved["plans"]]
    if args.measure_only:
        return None
    if args.profile is None:
        from jvarlen.profile import main as profile_main

        args.profile = profile_main([] if args.config is None else ["--config", args.config])
    coeffs = CostCoefficients.load(args.profile)
    if coeffs.meta.model_key != shape.key():
        raise SystemExit(f"profile {args.profile} is for {coeffs.meta.model_key}, model is {shape.key()}")
    if args.no_per_sp:
        # the in-situ bucket factors of sp > 1 were fitted on top of the per-sp terms: drop them too
        coeffs = coeffs.replace(
            per_sp={},
            recompute_per_sp={},
            head_per_sp={},
            step_overhead_per_sp={},
            bucket_token_scale={k: v for k, v in coeffs.bucket_token_scale.items() if k == 1},
        )
    cpu = jax.default_backend() == "cpu"
    profiled = profiled_shapes(args.profile)
    ref_profile, probe_name = coeffs.meta.reference_s, coeffs.meta.reference_probe
    probe_calls = args.probe_calls if args.probe_calls is not None else calibration_rounds(args.profile) or 0
    if cpu and ref_profile > 0 and probe_calls:
        pool_probe_readings(rows, probe_name, probe_calls)
    for r in rows:
        sp = int(r.get("sp", 1))
        cost = CostModel(shape, Layout(1, 1, sp), coeffs)
        shapes = [ChunkShape(c, tuple(s), bool(t)) for c, s, t in r["chunks"]]
        sched = one_f_one_b(len(shapes), 1, chunk_docs=r["chunk_docs"])
        result = simulate(sched, shapes, np.asarray(r["ckpt"])[:, None], cost)
        raw = r["measured_cpu_s"] / r.get("clock_divisor", 1) if cpu else r["measured_wall_s"]
        measured = raw
        if cpu and ref_profile > 0 and r.get("reference_cpu_s") and r.get("reference_probe") == probe_name:
            reading = r.get("reference_pooled_s", r["reference_cpu_s"])
            measured = to_profile_clock(raw, reading, ref_profile)
            r["speed_vs_profile"] = ref_profile / reading
            own = to_profile_clock(raw, r["reference_cpu_s"], ref_profile)
            r["rel_err_own_probe"] = (result.iteration_time - own) / own
        r["sp"] = sp
        r["profiled_shapes"] = sum(str(c) in profiled.get(sp, set()) for c in shapes)
        r["predicted_s"] = result.iteration_time
        r["measured_raw_s"] = raw
        r["measured_s"] = measured
        r["rel_err"] = (result.iteration_time - measured) / measured
        r["rel_err_raw"] = (result.iteration_time - raw) / raw
        print(
            f"sp {sp} plan {r['plan']:2d}: {len(shapes):2d} chunks {r['tokens']:5d} tok {'/'.join(r['kinds']):20s} "
            f"pred {r['predicted_s'] * 1e3:8.1f} ms  meas {measured * 1e3:8.1f} ms  err {100 * r['rel_err']:+6.1f}%"
            f"  (raw {raw * 1e3:8.1f} ms, {100 * r['rel_err_raw']:+6.1f}%)"
        )
        if r["plan"] == 0 and args.gantt and sp == args.sp:
            from jvarlen.plan.gantt import draw_gantt

            draw_gantt(result, sched, args.gantt)
    normalized = [r for r in rows if "speed_vs_profile" in r]
    summary = {
        "profile": args.profile,
        "residual_policy": args.residual_policy,
        "reference": (
            f"{len(normalized)} of {len(rows)} plans converted to the profile's clock by the reference probe "
            f"(profile reading {ref_profile * 1e3:.1f} ms; probe {probe_name}; "
            + (
                f"each reading the minimum over the {probe_calls} probe calls nearest the plan)"
                if probe_calls
                else "each reading the plan's own probe calls)"
            )
            if normalized
            else "none (plain seconds)"
        ),
        "own_probe": error_summary(normalized, "rel_err_own_probe") if normalized else None,
        "speed_vs_profile": (
            {q: float(np.percentile([r["speed_vs_profile"] for r in normalized], p)) for q, p in MIN_MED_MAX}
            if normalized
            else None
        ),
        "raw": error_summary(rows, "rel_err_raw"),
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "clock": (sorted({r.get("clock", "process CPU time (old, unpinned)") for r in rows}) if cpu else "wall"),
        "median_cpu_over_wall": float(np.median([r["measured_cpu_s"] / r["measured_wall_s"] for r in rows])),
        **error_summary(rows),
        "per_sp": {
            str(sp): error_summary([r for r in rows if r["sp"] == sp]) for sp in sorted({r["sp"] for r in rows})
        },
        "profiled_shapes_in_plans": int(sum(r["profiled_shapes"] for r in rows)),
        "median_abs_rel_err_vs_wall": float(
            np.median([abs(r["predicted_s"] - r["measured_wall_s"]) / r["measured_wall_s"] for r in rows])
        ),
        "bar": "median <= 5 %, p90 <= 10 %",
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "plans": rows}, f, indent=1)
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
