"""Times the Pallas attention kernels' launch configurations on this GPU.

    python scripts/tune_kernel_tiles.py --out runs/tiles [--layout one-32K --layout long-tail-16K]

``kernels/gpu_config._TABLE`` holds, per GPU class, the largest tiles that compile without
spills (deviceless compiles). This script measures candidates around them on a real GPU, one
kernel at a time with the other two at the table's choice: the forward alone for the forward
kernel, forward + backward for the dq and dk/dv kernels. Every candidate's output and
gradients are checked against the table's configuration on the same inputs: a launch whose
results differ from the table's by more than ``WRONG`` (largest relative norm error) is reported
as a wrong result and not timed. Writes ``tiles.json`` and prints
a table per layout, fastest first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jvarlen import kernels
from jvarlen.kernels import testing as kt
from jvarlen.kernels.gpu_config import KernelTiles, current_target, kernel_config

LAYOUTS = {
    "one-32K": [32768],
    "long-tail-16K": [8192, 4096, 2048, 1024, 512, 256, 128, 128, 64, 64, 32, 32, 16, 16, 8, 8],
    "uniform-4x4K": [4096] * 4,
}
# (block_q, block_kv, warps, stages) around the bf16 D = 128 Hopper row
CANDIDATES = {
    "fwd": [(128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 4, 2), (128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3),
            (64, 128, 4, 2), (64, 64, 4, 3)],
    "dq": [(128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 4, 3), (64, 128, 4, 2), (64, 128, 8, 2), (64, 64, 4, 3)],
    "dkv": [(128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 2), (64, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3)],
}  # fmt: skip


WRONG = 1e-2  # two tilings of one bf16 computation differ by summation order only (~1e-3)
CPU_SHRINK = 256  # --allow_cpu: every document of a layout this many times shorter (interpret mode)


def _median_time(fn, *args, repeats: int) -> tuple[float, float, float]:
    times = kt.call_seconds(fn, *args, repeats=repeats)
    return statistics.median(times), min(times), max(times)


def tune_layout(name, lengths, heads, kv_heads, head_dim, dtype, repeats, deadline) -> list[dict]:
    total = sum(lengths)
    seg = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(lengths)])
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    flops = 4.0 * head_dim * heads * pairs
    kq, kk, kv, kc = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(kq, (total, heads, head_dim), dtype)
    k = jax.random.normal(kk, (total, kv_heads, head_dim), dtype)
    v = jax.random.normal(kv, (total, kv_heads, head_dim), dtype)
    ct = jax.random.normal(kc, (total, heads, head_dim), dtype)
    info = kernels.block_info_for(seg, seg, pos, pos)
    table = kernel_config(dtype, head_dim, current_target())

    def runners(config):
        def f(q, k, v):
            return kernels.varlen_attention(
                q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos,
                block_info=info, implementation="pallas", kernel_config=config,
            )  # fmt: skip

        def fwd_bwd(q, k, v, ct):
            out, vjp = jax.vjp(f, q, k, v)
            return (out, *vjp(ct))

        return jax.jit(f), jax.jit(fwd_bwd)

    _, ref_fn = runners(table)
    ref = jax.block_until_ready(ref_fn(q, k, v, ct))
    rows = []
    for kernel, cands in CANDIDATES.items():
        for bq, bk, warps, stages in cands:
            row = {"layout": name, "kernel": kernel, "tiles": [bq, bk, warps, stages]}
            if time.perf_counter() > deadline:
                row["skipped"] = "time budget"
                rows.append(row)
                continue
            config = dataclasses.replace(table, **{kernel: KernelTiles(bq, bk, warps, stages)})
            row["table"] = config == table
            try:
                fwd, fwd_bwd = runners(config)
                got = jax.block_until_ready(fwd_bwd(q, k, v, ct))
                row["max_rel_err_vs_table"] = err = max(kt.rel_norm_err(a, b) for a, b in zip(got, ref))
                if not err <= WRONG:  # NaN too
                    row["error"] = f"wrong result: {err:.1e} from the table's configuration (> {WRONG:g})"
                else:
                    fn, inputs, work = (fwd, (q, k, v), 1.0) if kernel == "fwd" else (fwd_bwd, (q, k, v, ct), 3.5)
                    ms, lo, hi = (1e3 * x for x in _median_time(fn, *inputs, repeats=repeats))
                    row.update(ms=ms, tflops=work * flops / ms / 1e9, ms_spread=[lo, hi])
            except Exception as e:  # a candidate the compiler refuses (shared memory, registers)
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print("[tiles]", row, flush=True)
    return rows


def report(rows: list[dict]) -> str:
    lines = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        lines += [
            "",
            f"### {layout}",
            "",
            "| kernel | (bq, bk, warps, stages) | ms (min-max) | TFLOP/s | rel. diff vs table |",
        ]
        lines.append("|---|---|---|---|---|")
        for kernel in CANDIDATES:
            sel = [r for r in rows if r["layout"] == layout and r["kernel"] == kernel]
            sel.sort(key=lambda r: r.get("ms", float("inf")))
            for r in sel:
                tiles = tuple(r["tiles"])
                mark = " (table)" if r.get("table") else ""
                if "ms" in r:
                    lo, hi = r["ms_spread"]
                    lines.append(
                        f"| {kernel} | {tiles}{mark} | {r['ms']:.2f} ({lo:.2f}-{hi:.2f}) | {r['tflops']:.0f} | "
                        f"{r['max_rel_err_vs_table']:.1e} |"
                    )
                else:
                    lines.append(f"| {kernel} | {tiles}{mark} | {r.get('error') or r.get('skipped')} | | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/tiles")
    ap.add_argument("--layout", action="append", choices=sorted(LAYOUTS), default=None)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv_heads", type=int, default=8)
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--budget_s", type=float, default=600.0, help="stop timing new candidates after this")
    ap.add_argument(
        "--allow_cpu", action="store_true", help=f"dry run in interpret mode, documents {CPU_SHRINK}x shorter"
    )
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.allow_cpu:
        print("tune_kernel_tiles needs a GPU", file=sys.stderr)
        return 2
    deadline = time.perf_counter() + args.budget_s
    rows = []
    shrink = CPU_SHRINK if jax.default_backend() != "gpu" else 1
    for name in args.layout or ["one-32K", "long-tail-16K"]:
        lengths = [max(8, n // shrink) for n in LAYOUTS[name]]
        rows += tune_layout(
            name, lengths, args.heads, args.kv_heads, args.head_dim, jnp.bfloat16, args.repeats, deadline
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tiles.json"), "w", encoding="utf-8") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)
    text = f"## Kernel tiles on {jax.devices()[0].device_kind} (jax {jax.__version__})\n" + report(rows)
    with open(os.path.join(args.out, "tiles.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
