"""One-command check for whoever has a GPU node (never run by this project: it has no GPU).

    pip install -e '.[cuda12,test]' && python scripts/gpu_check.py --out runs/gpu_check

Writes to ``--out``: ``attention.json`` (varlen kernel vs ``jax.nn.dot_product_attention``
with cuDNN on the same documents), ``memory.json`` (compiled step's ``memory_analysis()``
vs the allocator's measured peak after running it), ``pipeline/`` (one EPP and one Seq1F1B
run of the real executor through ``python -m jvarlen.train``, when there are >= 2 GPUs),
``profile/`` (the cost-model profile fitted on this GPU by ``python -m jvarlen.profile``),
and ``summary.md``: the table to paste into docs/benchmarks.md. Each part is independent:
a failure is recorded in the summary and the next part runs.

Attention layouts: documents of the given lengths, packed into one row for the varlen
kernel (segment ids, causal) and one document per row for cuDNN (``query_seq_lengths``,
``is_causal``): the same visible (query, key) pairs. TFLOP/s count only those pairs
(4 · D · H per pair forward, 2.5x that for forward + backward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = {  # document lengths (tokens)
    "uniform-4x4K": [4096] * 4,
    "long-tail-16K": [8192, 4096, 2048, 1024, 512, 256, 128, 128, 64, 64, 32, 32, 16, 16, 8, 8],
    "one-32K": [32768],
}


def _time(fn, *args, repeats: int = 10) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_part(heads: int, kv_heads: int, head_dim: int, dtype) -> list[dict]:
    from jvarlen import kernels

    rows = []
    for name, lengths in LAYOUTS.items():
        total, longest, n = sum(lengths), max(lengths), len(lengths)
        seg = np.concatenate([np.full(L, i + 1, np.int32) for i, L in enumerate(lengths)])
        pos = np.concatenate([np.arange(L, dtype=np.int32) for L in lengths])
        pairs = sum(L * (L + 1) // 2 for L in lengths)
        key = jax.random.key(0)
        q = jax.random.normal(key, (total, heads, head_dim), dtype)
        k = jax.random.normal(key, (total, kv_heads, head_dim), dtype)
        info = kernels.block_info_for(seg, seg, pos, pos)

        def varlen(q, k, v, seg=seg, pos=pos, info=info):
            return kernels.varlen_attention(
                q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos, block_info=info
            )

        # the same documents, one per row, padded to the longest (cuDNN masks the padding)
        starts = np.cumsum([0] + lengths[:-1])
        idx = np.minimum(starts[:, None] + np.arange(longest)[None], total - 1)
        lens = jnp.asarray(lengths, jnp.int32)

        def cudnn(qb, kb, vb, lens=lens):
            return jax.nn.dot_product_attention(
                qb,
                kb,
                vb,
                is_causal=True,
                query_seq_lengths=lens,
                key_value_seq_lengths=lens,
                implementation="cudnn",
            )

        flops = 4.0 * head_dim * heads * pairs
        # padded [documents, longest, heads, D] copies for cuDNN, gathered once outside the timing
        qb, kb = q[idx], k[idx]
        for impl, fn, args in (("varlen", varlen, (q, k, k)), ("cudnn", cudnn, (qb, kb, kb))):
            row = {"layout": name, "implementation": impl, "tokens": total, "documents": n}
            try:
                fwd = jax.jit(fn)
                grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(jnp.float32).sum(), (0, 1, 2)))
                row["fwd_s"] = _time(fwd, *args)
                row["fwd_bwd_s"] = _time(grad, *args)
                row["fwd_tflops"] = flops / row["fwd_s"] / 1e12
                row["fwd_bwd_tflops"] = 3.5 * flops / row["fwd_bwd_s"] / 1e12
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print("[gpu_check] attention", row, flush=True)
    return rows


def memory_part(config_path: str) -> dict:
    """Compiles the data-parallel step on this node's GPUs, compares memory_analysis() with
    the allocator's peak after two steps on random tokens."""
    from jvarlen.api import Session
    from jvarlen.config import load_config
    from jvarlen.layout import Layout
    from jvarlen.parallel.sharding import place_global
    from jvarlen.runtime.memory_fit import check_fit
    from jvarlen.runtime.step import BATCH_KEYS

    config = load_config(config_path, **{"parallel.pp": "1"})
    session = Session.from_config(config)
    state = session.state
    rows = max(jax.device_count(), config.data.tokens_per_batch // config.data.seq_len)
    rng = np.random.default_rng(0)
    batch = {
        "tokens": rng.integers(0, config.model.vocab_size, (rows, config.data.seq_len), dtype=np.int32),
        "segment_ids": np.ones((rows, config.data.seq_len), np.int32),
        "positions": np.tile(np.arange(config.data.seq_len, dtype=np.int32), (rows, 1)),
        "loss_mask": np.ones((rows, config.data.seq_len), np.float32),
    }
    batch["targets"] = np.roll(batch["tokens"], -1, axis=1)
    step = session.layout_step(Layout(dp=jax.device_count()), rows, config.data.seq_len)
    step_exe = step.compiled(step.from_arrays({k: batch[k] for k in BATCH_KEYS}))
    placed = place_global({k: batch[k] for k in BATCH_KEYS}, step_exe.batch_shardings)
    compiled = step_exe.compiled
    fit = check_fit(compiled, jax.local_devices()[0])
    for _ in range(2):
        state, metrics = compiled(state, placed)
    jax.block_until_ready(metrics)
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {
        "config": config_path,
        "devices": jax.device_count(),
        "compiled_need_bytes": fit.need_bytes,
        "allocator_limit_bytes": fit.limit_bytes,
        "measured_peak_bytes": peak,
        "error_of_compiled_figure": None if not peak else (fit.need_bytes - peak) / peak,
        "fit_message": fit.message,
    }


def pipeline_part(out: str, steps: int) -> list[dict]:
    """One EPP and one Seq1F1B run of the real executor (python -m jvarlen.train, pp = 2)."""
    if jax.device_count() < 2:
        return [{"skipped": "needs >= 2 GPUs for pp = 2"}]
    rows = []
    for policy in ("epp", "seq1f1b"):
        run_dir = os.path.join(out, "pipeline", policy)
        cmd = [sys.executable, "-m", "jvarlen.train", "--config", "configs/default.yaml", "--parallel.pp=2"]
        cmd += [f"--plan.policy={policy}", f"--train.steps={steps}", f"--logging.run_dir={run_dir}"]
        cmd += ["--plan.wait=true"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        row = {"policy": policy, "returncode": proc.returncode}
        path = os.path.join(run_dir, "metrics.jsonl")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                recs = [json.loads(line) for line in f if line.strip()]
            warm = [r for r in recs[2:] if "step_time_s" in r] or recs
            row["median_step_s"] = statistics.median(r.get("step_time_s", float("nan")) for r in warm)
            row["tokens_per_s"] = statistics.median(r.get("tokens_per_s", float("nan")) for r in warm)
        else:
            row["stderr_tail"] = proc.stderr[-2000:]
        rows.append(row)
        print("[gpu_check] pipeline", row, flush=True)
    return rows


def profile_part(out: str) -> dict:
    cmd = [sys.executable, "-m", "jvarlen.profile", "--config", "configs/default.yaml"]
    cmd += ["--out_dir", os.path.join(out, "profile"), "--force", "true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    files = sorted(os.listdir(os.path.join(out, "profile"))) if os.path.isdir(os.path.join(out, "profile")) else []
    return {"returncode": proc.returncode, "files": files, "stdout_tail": proc.stdout[-1500:]}


def summary(results: dict) -> str:
    dev = results["device"]
    lines = [f"## GPU check: {dev['kind']} x {dev['count']} (jax {jax.__version__})", ""]
    lines += [
        "| layout | implementation | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results.get("attention", []):
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['implementation']} | error: {r['error'][:80]} | | | |")
        else:
            lines.append(
                f"| {r['layout']} | {r['implementation']} | {1e3 * r['fwd_s']:.2f} | {r['fwd_tflops']:.0f} | "
                f"{1e3 * r['fwd_bwd_s']:.2f} | {r['fwd_bwd_tflops']:.0f} |"
            )
    mem = results.get("memory", {})
    if "compiled_need_bytes" in mem:
        peak = mem["measured_peak_bytes"]
        lines += [
            "",
            f"Compiled step ({mem['config']}): memory_analysis {mem['compiled_need_bytes'] / 2**30:.2f} GiB per device, "
            f"measured peak {peak / 2**30 if peak else float('nan'):.2f} GiB ({mem['error_of_compiled_figure']}).",
        ]
    for r in results.get("pipeline", []):
        lines.append(f"- pipeline: {r}")
    lines.append(f"- profile: {results.get('profile', {}).get('files')}")
    for part, err in results.get("errors", {}).items():
        lines.append(f"- {part} failed: {err.splitlines()[-1] if err else ''}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/gpu_check")
    ap.add_argument("--config", default="configs/default.yaml", help="config whose step memory is checked")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv_heads", type=int, default=8)
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--pipeline_steps", type=int, default=8)
    ap.add_argument("--skip", action="append", default=[], choices=["attention", "memory", "pipeline", "profile"])
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("gpu_check needs a GPU (jax.default_backend() is %r)" % jax.default_backend(), file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    results = {"device": {"kind": jax.devices()[0].device_kind, "count": jax.device_count()}, "errors": {}}
    parts = {
        "attention": lambda: attention_part(args.heads, args.kv_heads, args.head_dim, jnp.bfloat16),
        "memory": lambda: memory_part(args.config),
        "pipeline": lambda: pipeline_part(args.out, args.pipeline_steps),
        "profile": lambda: profile_part(args.out),
    }
    for name, run in parts.items():
        if name in args.skip:
            continue
        try:
            results[name] = run()
        except Exception:
            results["errors"][name] = traceback.format_exc()
        with open(os.path.join(args.out, f"{name}.json"), "w", encoding="utf-8") as f:
            json.dump(results.get(name, {"error": results["errors"].get(name)}), f, indent=1, default=str)
    text = summary(results)
    with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
