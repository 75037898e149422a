"""Predicted vs XLA-reported activation memory of the real decoder (cost-model memory check).

For held-out chunk programs (shapes and recomputation counts the profiler's memory grid did
not use) the script compiles — does not run — the forward+backward of the profiler's layer
slice (all ``L`` layers of the default model, the first ``l`` recomputed) and of the whole
model's chunk step, reads ``compile().memory_analysis()`` and compares ``temp_size_in_bytes``
with the cost model's :meth:`CostModel.peak_memory` (Eq. 10 stored activations + working
memory of the backward in flight). It also prints, per chunk, the per-layer slope XLA shows
(temp(4 layers) − temp(2 layers)) / 2 next to the bytes autodiff saves per layer
(``jax.eval_shape`` of one layer's VJP residuals) and the profile's ``m_token``.

``--refit_profile`` first measures the profiler's memory grid
(:func:`jvarlen.profile.measure.measure_memory`), stores it in the profile's report
(``*.report.json``) and refits the profile from that report (time coefficients are refitted
from the same saved timings, i.e. unchanged).

Usage: ``python scripts/validate_cost_memory.py --profile jvarlen/profiles/measured/<key>.json
[--refit_profile] [--out runs/validate_cost_memory.json]``. CPU: ~6 s of compilation per case here.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def held_out_cases(num_layers: int):
    """Chunks that fill their token/context buckets exactly (the harness pads to buckets; the
    cost model's memory is per real token), none of them a memory-grid shape."""
    from jvarlen.plan.chunk import ChunkShape
    from jvarlen.profile.memory import MemoryCase

    L = num_layers
    t768, t1536 = ChunkShape(0, (768,)), ChunkShape(0, (1536,))
    split = ChunkShape(1024, (768,), tail=False)
    packed = ChunkShape(0, (300, 200, 268))
    long_ctx = ChunkShape(2048, (256,), tail=False)
    cases = [MemoryCase(t768, L, r) for r in range(L + 1)]
    cases += [MemoryCase(t1536, L, 0), MemoryCase(t1536, L, L)]
    cases += [MemoryCase(split, L, r) for r in (0, L // 2, L)]
    cases += [MemoryCase(packed, L, 0), MemoryCase(long_ctx, L, 0), MemoryCase(long_ctx, L, L)]
    cases += [
        MemoryCase(t768, L, 0, head=True),
        MemoryCase(t768, L, L, head=True),
        MemoryCase(split, L, L // 2, head=True),
    ]
    return cases


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="profile JSON (its *.report.json next to it with --refit_profile)")
    ap.add_argument("--config", help="run YAML whose model is used (default: ModelConfig())")
    ap.add_argument(
        "--refit_profile", action="store_true", help="measure the memory grid, store it in the report, refit"
    )
    ap.add_argument("--out", default="runs/validate_cost_memory.json")
    args = ap.parse_args(argv)

    import numpy as np

    from jvarlen.config import ModelConfig, load_config
    from jvarlen.plan.chunk import ChunkShape
    from jvarlen.plan.cost import CostCoefficients, ModelShape
    from jvarlen.profile.fit import refit_profile, report_residual_policy
    from jvarlen.profile.harness import ChunkHarness
    from jvarlen.profile.measure import ProfileGrid, measure_memory, program_memory
    from jvarlen.profile.memory import layer_residual_bytes, memory_check

    model_cfg = load_config(args.config).model if args.config else ModelConfig()
    shape = ModelShape.from_config(model_cfg)
    t0 = time.time()
    if args.refit_profile:
        grid = ProfileGrid()
        report_path = args.profile.replace(".json", ".report.json")
        with open(report_path) as f:
            report = json.load(f)
        grid_harness = ChunkHarness(
            model_cfg,
            token_buckets=grid.token_buckets,
            context_buckets=grid.context_buckets,
            residual=report_residual_policy(report),
        )
        report["memory"] = measure_memory(grid_harness, grid.token_buckets)
        with open(report_path, "w") as f:
            json.dump(report, f, indent=1)
        coeffs = refit_profile(report_path, model_cfg, args.profile)
        print(f"memory grid: {len(report['memory'])} programs [{time.time() - t0:.0f}s]; profile refitted", flush=True)
    else:
        coeffs = CostCoefficients.load(args.profile)
    if coeffs.meta.model_key != shape.key():
        raise SystemExit(f"profile {args.profile} is for {coeffs.meta.model_key}, model is {shape.key()}")
    # the profile's layers: what its memory coefficients were measured on (older profiles: plain autodiff)
    harness = ChunkHarness(
        model_cfg,
        token_buckets=(256, 768, 1536),
        context_buckets=(0, 1024, 2048),
        residual=coeffs.meta.profiled_residual_policy,
    )

    # Per-layer slopes: XLA (two differences averaged) vs autodiff residuals vs the profile.
    slopes = []
    L = model_cfg.num_layers
    for chunk in (ChunkShape(0, (768,)), ChunkShape(1024, (768,), tail=False), ChunkShape(2048, (256,), tail=False)):
        batch = harness.layer_inputs(chunk)
        temps = {
            n: program_memory(harness.layers_program(n, "fwdbwd", 0), harness.params, batch)["temp"] for n in (2, L)
        }
        xla = (temps[L] - temps[2]) / (L - 2)
        residual = layer_residual_bytes(harness, chunk)
        model = coeffs.m_token * chunk.tokens + coeffs.m_context_token * chunk.context
        slopes.append(
            {
                "context": chunk.context,
                "tokens": chunk.tokens,
                "xla_per_layer": xla,
                "residual_per_layer": residual,
                "model_per_layer": model,
            }
        )
        print(
            f"per layer C={chunk.context:4d} T={chunk.tokens:4d}: XLA {xla / chunk.tokens:8.0f} B/tok  autodiff residuals "
            f"{residual / chunk.tokens:8.0f} B/tok  cost model {model / chunk.tokens:8.0f} B/tok  "
            f"(model/XLA {model / xla - 1:+.1%}) [{time.time() - t0:.0f}s]",
            flush=True,
        )

    rows = memory_check(harness, coeffs, held_out_cases(L))
    print(
        "\n| program | C | slices | recomputed layers | XLA temp (MB) | Eq. 10 (MB) | + working (MB) | predicted peak (MB) | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        kind = "whole model chunk step" if r["head"] else f"{r['layers']}-layer slice"
        print(
            f"| {kind} | {r['context']} | {'+'.join(map(str, r['slices']))} | {r['remat']} | {r['measured_temp'] / 1e6:.2f} | "
            f"{r['predicted_eq10'] / 1e6:.2f} | {r['predicted_work'] / 1e6:.2f} | {r['predicted_peak'] / 1e6:.2f} | {100 * r['rel_err']:+.1f} % |"
        )
    errs = np.abs([r["rel_err"] for r in rows])
    summary = {
        "profile": args.profile,
        "cases": len(rows),
        "median_abs_rel_err": float(np.median(errs)),
        "p90_abs_rel_err": float(np.percentile(errs, 90)),
        "max_abs_rel_err": float(errs.max()),
        "seconds": time.time() - t0,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "slopes": slopes, "cases": rows}, f, indent=1)
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
