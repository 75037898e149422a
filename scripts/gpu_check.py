"""One-command check for whoever has a GPU node.

    pip install -e '.[cuda12,test]' && python scripts/gpu_check.py --out runs/gpu_check \
        --step configs/default.yaml --step configs/llama-7b.yaml,model.num_layers=8,data.tokens_per_batch=65536

Writes to ``--out`` one JSON file per part, and ``summary.md``: the tables to paste into
docs/benchmarks.md. Each part is independent: a failure is recorded and the next part runs.

- ``step``: each ``--step CONFIG[,key=value,...]``'s data-parallel step compiled for one batch
  of packed long-tailed documents and run: XLA's ``memory_analysis()`` against the allocator's
  measured peak, step time, tokens/s, model TFLOP/s, losses.
- ``attention``: the varlen kernel and cuDNN (``jax.nn.dot_product_attention``) on the same
  documents, timed, and both checked against a float32 reference (output, dq, dk, dv).
- ``train``: the main job, ``python -m jvarlen.train`` on its embedded default.
- ``tests``: the kernel tests run on the GPU (compiled Triton instead of interpret mode).
- ``pipeline``: one EPP and one Seq1F1B run of the real executor (>= 2 GPUs).
- ``profile``: the cost-model profile fitted on this GPU by ``python -m jvarlen.profile``.

Attention layouts: documents of the given lengths, packed into one row for the varlen
kernel (segment ids, causal) and one document per row for cuDNN (``query_seq_lengths``,
``is_causal``): the same visible (query, key) pairs. TFLOP/s count only those pairs
(4 · D · H per pair forward, 3.5x that for forward + backward).

Exit status 1 when anything failed (:func:`failures`): a part, a step, an attention row (an
error, a non-finite value, or a relative error above ``WRONG``), the kernel tests, the main job
or a pipeline run.
"""

from __future__ import annotations

import argparse
import functools
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


def attention_part(heads: int, kv_heads: int, head_dim: int, dtype) -> list[dict]:
    """Per layout: the varlen kernel and cuDNN timed (forward, forward + backward) and both checked
    against a float32 reference (the XLA blockwise path on the same inputs upcast, matmuls at
    HIGHEST precision): output and dq, dk, dv for one random cotangent, fresh inputs per layout.
    The kernel in float32 is checked too (its dots' precision on the GPU)."""
    from jvarlen import kernels
    from jvarlen.kernels import testing as kt

    rows = []
    for li, (name, lengths) in enumerate(LAYOUTS.items()):
        total, longest, n = sum(lengths), max(lengths), len(lengths)
        seg = np.concatenate([np.full(L, i + 1, np.int32) for i, L in enumerate(lengths)])
        pos = np.concatenate([np.arange(L, dtype=np.int32) for L in lengths])
        pairs = sum(L * (L + 1) // 2 for L in lengths)
        kq, kk, kv, kc = jax.random.split(jax.random.key(100 + li), 4)
        q32 = jax.random.normal(kq, (total, heads, head_dim), jnp.float32)
        k32 = jax.random.normal(kk, (total, kv_heads, head_dim), jnp.float32)
        v32 = jax.random.normal(kv, (total, kv_heads, head_dim), jnp.float32)
        ct32 = jax.random.normal(kc, (total, heads, head_dim), jnp.float32)
        q, k, v, ct = (x.astype(dtype) for x in (q32, k32, v32, ct32))
        info = kernels.block_info_for(seg, seg, pos, pos)

        def varlen(q, k, v, impl="pallas", seg=seg, pos=pos, info=info):
            return kernels.varlen_attention(
                q,
                k,
                v,
                q_segment_ids=seg,
                kv_segment_ids=seg,
                q_positions=pos,
                kv_positions=pos,
                block_info=info,
                implementation=impl,
            )

        # the same documents, one per row, padded to the longest (cuDNN masks the padding)
        starts = np.cumsum([0] + lengths[:-1])
        idx = np.minimum(starts[:, None] + np.arange(longest)[None], total - 1)
        keep = np.arange(longest)[None] < np.asarray(lengths)[:, None]
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

        def unpad(x, keep=keep):  # [documents, longest, ...] -> the packed [total, ...] rows
            return np.asarray(x, np.float32)[keep]

        with jax.default_matmul_precision("highest"):
            ref = _fwd_vjp(
                functools.partial(varlen, impl="xla"),
                q.astype(jnp.float32),
                k.astype(jnp.float32),
                v.astype(jnp.float32),
                ct.astype(jnp.float32),
            )
            ref32 = _fwd_vjp(functools.partial(varlen, impl="xla"), q32, k32, v32, ct32)
        flops = 4.0 * head_dim * heads * pairs
        cases = (
            ("varlen", varlen, (q, k, v), ct, ref, lambda x: np.asarray(x, np.float32)),
            ("cudnn", cudnn, (q[idx], k[idx], v[idx]), ct[idx], ref, unpad),
            ("varlen-f32", varlen, (q32, k32, v32), ct32, ref32, lambda x: np.asarray(x, np.float32)),
        )
        for impl, fn, args, cot, want, back in cases:
            row = {"layout": name, "implementation": impl, "tokens": total, "documents": n, "dtype": str(args[0].dtype)}
            try:
                got = _fwd_vjp(fn, *args, cot)
                for part, g, w in zip(("out", "dq", "dk", "dv"), got, want):
                    g = back(g)
                    row[f"err_{part}"] = kt.rel_norm_err(g, w)
                    row.setdefault("nonfinite", 0)
                    row["nonfinite"] += int((~np.isfinite(g)).sum())
                fwd = jax.jit(fn)
                grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(jnp.float32).sum(), (0, 1, 2)))
                row["fwd_s"] = statistics.median(kt.call_seconds(fwd, *args, repeats=10))
                row["fwd_bwd_s"] = statistics.median(kt.call_seconds(grad, *args, repeats=10))
                row["fwd_tflops"] = flops / row["fwd_s"] / 1e12
                row["fwd_bwd_tflops"] = 3.5 * flops / row["fwd_bwd_s"] / 1e12
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print("[gpu_check] attention", row, flush=True)
    return rows


def _fwd_vjp(fn, q, k, v, ct):
    """-> (out, dq, dk, dv) of ``fn`` for cotangent ``ct``, jitted."""

    @jax.jit
    def run(q, k, v, ct):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(ct.astype(out.dtype)))

    return jax.block_until_ready(run(q, k, v, ct))


def _packed_rows(rng, rows: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Long-tailed documents packed into ``rows`` rows: log-normal lengths (median 1K tokens,
    a few as long as the row), each row filled to the end. -> (segment ids, positions, the
    visible (query, key) pairs of causal attention)."""
    seg = np.zeros((rows, seq_len), np.int32)
    pos = np.zeros((rows, seq_len), np.int32)
    pairs = 0
    for r in range(rows):
        start, doc = 0, 1
        while start < seq_len:
            n = int(min(seq_len - start, max(16, rng.lognormal(np.log(1024), 1.5))))
            seg[r, start : start + n], pos[r, start : start + n] = doc, np.arange(n)
            pairs += n * (n + 1) // 2
            start, doc = start + n, doc + 1
    return seg, pos, pairs


def step_part(config_path: str, overrides: list[str], steps: int) -> dict:
    """Compiles the data-parallel step of ``config_path`` (+ ``key=value`` overrides) on this
    node's GPUs for one batch of packed long-tailed documents, runs it, and compares XLA's
    memory_analysis() with the allocator's peak; times ``steps`` steps after two warm-ups
    (tokens/s and model TFLOP/s per device: :class:`jvarlen.runtime.model_flops.StepFlops`, what
    the training loop logs, so recomputation not counted)."""
    from jvarlen.api import Session
    from jvarlen.config import load_config
    from jvarlen.layout import Layout
    from jvarlen.parallel.sharding import place_global
    from jvarlen.runtime.memory_fit import check_fit
    from jvarlen.runtime.model_flops import StepFlops
    from jvarlen.runtime.step import BATCH_KEYS

    config = load_config(config_path, **{"parallel.pp": "1", **dict(o.split("=", 1) for o in overrides)})
    session = Session.from_config(config)
    state = session.state
    seq_len, model = config.data.seq_len, config.model
    rows = max(jax.device_count(), config.data.tokens_per_batch // seq_len)
    rng = np.random.default_rng(0)
    seg, pos, _ = _packed_rows(rng, rows, seq_len)
    tokens = rng.integers(0, model.vocab_size, (rows, seq_len), dtype=np.int32)
    batch = {"tokens": tokens, "segment_ids": seg, "positions": pos, "targets": np.roll(tokens, -1, axis=1)}
    batch["loss_mask"] = (np.roll(seg, -1, axis=1) == seg).astype(np.float32)
    step = session.layout_step(Layout(dp=jax.device_count()), rows, seq_len)
    t0 = time.perf_counter()
    step_exe = step.compiled(step.from_arrays({k: batch[k] for k in BATCH_KEYS}))
    compile_s = time.perf_counter() - t0
    placed = place_global({k: batch[k] for k in BATCH_KEYS}, step_exe.batch_shardings)
    compiled = step_exe.compiled
    fit = check_fit(compiled, jax.local_devices()[0])
    losses, times = [], []
    for i in range(2 + steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, placed)
        metrics = jax.device_get(metrics)
        if i >= 2:
            times.append(time.perf_counter() - t0)
        losses.append(float(metrics["loss_sum"] / max(float(metrics["target_tokens"]), 1.0)))
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    step_s = statistics.median(times)
    lengths = [int(n) for row in seg for n in np.bincount(row)[1:] if n]  # the documents: ids from 1 in each row
    flops = StepFlops(model, jax.device_count(), peak=None).model_flops(lengths)
    return {
        "config": config_path,
        "overrides": overrides,
        "devices": jax.device_count(),
        "rows": rows,
        "seq_len": seq_len,
        "documents": int(sum(len(np.unique(r)) for r in seg)),
        "compile_s": compile_s,
        "step_s_median": step_s,
        "step_s_spread": [min(times), max(times)],
        "tokens_per_s": rows * seq_len / step_s,
        "model_tflops_per_s": flops / step_s / 1e12 / jax.device_count(),
        "losses": losses,
        "compiled_need_bytes": fit.need_bytes,
        "allocator_limit_bytes": fit.limit_bytes,
        "measured_peak_bytes": peak,
        "error_of_compiled_figure": None if not peak else (fit.need_bytes - peak) / peak,
        "fit_message": fit.message,
    }


def _child_env(**extra: str) -> dict:
    """A subprocess's environment: this process's JAX holds its GPU memory (75 % preallocated by
    default), so a child that preallocates the default too fails at its first allocation; it gets
    a fifth of the device unless the caller set a fraction."""
    env = {**os.environ, **extra}
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.2")
    return env


def train_part(out: str, steps: int, timeout_s: int = 600) -> dict:
    """The main job, ``python -m jvarlen.train`` on its embedded default (the README's first
    command), for ``steps`` steps on this node: its losses and step times."""
    run_dir = os.path.join(out, "train")
    cmd = [sys.executable, "-m", "jvarlen.train", f"--train.steps={steps}", f"--logging.run_dir={run_dir}"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_child_env(), check=False)
        code, err = proc.returncode, proc.stderr[-1500:]
    except subprocess.TimeoutExpired:
        code, err = "timeout", ""
    row = {"returncode": code, "wall_s": time.perf_counter() - t0, "stderr_tail": err}
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            recs = [json.loads(line) for line in f if line.strip()]
        recs = [r for r in recs if "loss" in r]
        row["losses"] = [r["loss"] for r in recs]
        warm = [r["step_time_s"] for r in recs[2:] if "step_time_s" in r]
        row["median_step_s"] = statistics.median(warm) if warm else None
        mfu = [r["mfu"] for r in recs[2:] if r.get("mfu") is not None]
        row["median_mfu"] = statistics.median(mfu) if mfu else None
    return row


def pipeline_part(out: str, steps: int) -> list[dict]:
    """One EPP and one Seq1F1B run of the real executor (python -m jvarlen.train, pp = 2). The last
    step of each is traced (``logging.trace_steps``: the tick programs, the stages' idle time and
    the collectives on the GPU's timeline, under ``pipeline/<policy>/tensorboard``) and left out
    of the medians, since tracing slows it."""
    if jax.device_count() < 2:
        return [{"skipped": "needs >= 2 GPUs for pp = 2"}]
    rows = []
    for policy in ("epp", "seq1f1b"):
        run_dir = os.path.join(out, "pipeline", policy)
        cmd = [sys.executable, "-m", "jvarlen.train", "--config", "configs/default.yaml", "--parallel.pp=2"]
        cmd += [f"--plan.policy={policy}", f"--train.steps={steps}", f"--logging.run_dir={run_dir}"]
        cmd += ["--plan.wait=true", f"--logging.trace_steps=[{steps},{steps}]"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_child_env(), check=False)
        row = {"policy": policy, "returncode": proc.returncode}
        path = os.path.join(run_dir, "metrics.jsonl")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                recs = [json.loads(line) for line in f if line.strip()]
            warm = [r for r in recs[2:-1] if "step_seconds" in r] or recs
            # the executor's step, not the plan wait (plan.wait) or a compile
            row["median_step_s"] = statistics.median(r.get("step_seconds", float("nan")) for r in warm)
            row["tokens_per_s"] = statistics.median(r.get("tokens_per_s", float("nan")) for r in warm)
            row["mfu"] = statistics.median(r.get("mfu") or float("nan") for r in warm)
        else:
            row["stderr_tail"] = proc.stderr[-2000:]
        rows.append(row)
        print("[gpu_check] pipeline", row, flush=True)
    return rows


def profile_part(out: str) -> dict:
    """The cost-model profile of the default model on this GPU; a failed profiler is an error of
    this part (its stderr's end in the message), not a row with no files."""
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.yaml")
    cmd = [sys.executable, "-m", "jvarlen.profile", "--config", config]
    cmd += ["--out_dir", os.path.join(out, "profile"), "--force", "true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_child_env(), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m jvarlen.profile exited {proc.returncode}: {proc.stderr[-1500:]}")
    files = sorted(os.listdir(os.path.join(out, "profile"))) if os.path.isdir(os.path.join(out, "profile")) else []
    return {"returncode": proc.returncode, "files": files, "stdout_tail": proc.stdout[-1500:]}


def _gib(x) -> str:
    return f"{x / 2**30:.2f}" if x else "?"


KERNEL_TESTS = ["tests/test_kernels_pallas.py", "tests/test_kernels_attention.py", "tests/test_kernels_properties.py"]


def tests_part(out: str, timeout_s: int) -> dict:
    """The kernel tests on this GPU (``JAX_PLATFORMS=cuda``: compiled Triton kernels instead of
    interpret mode, the references at HIGHEST matmul precision), with a wall-clock limit."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", *KERNEL_TESTS]
    env = _child_env(JAX_PLATFORMS="cuda")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text, code = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    with open(os.path.join(out, "tests.log"), "w", encoding="utf-8") as f:
        f.write(text)
    last = [line for line in text.splitlines() if line.strip()][-1:] or [""]
    return {
        "returncode": code,
        "summary": last[0],
        "failures": [x for x in text.splitlines() if x.startswith("FAILED")],
    }


WRONG = 1e-2  # relative error of an attention row that is a wrong kernel, not rounding (bf16: ~2.5e-3)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def failures(results: dict) -> list[str]:
    """What failed, one line each: a part that raised, and every failure the parts recorded."""
    out = [
        f"{part}: {_one_line(err.strip().splitlines()[-1] if err else '')}" for part, err in results["errors"].items()
    ]
    for r in results.get("attention", []):
        what = f"attention {r['layout']} {r['implementation']}"
        worst = max((r[f"err_{p}"] for p in ("out", "dq", "dk", "dv") if f"err_{p}" in r), default=0.0)
        if "error" in r:
            out.append(f"{what}: {_one_line(r['error'])}")
        if r.get("nonfinite"):
            out.append(f"{what}: {r['nonfinite']} non-finite values")
        if not worst <= WRONG:
            out.append(f"{what}: relative error {worst:.1e} > {WRONG:g}")
    for s in results.get("step", []):
        if "error" in s:
            out.append(f"step {s.get('name')}: {_one_line(s['error'].strip().splitlines()[-1])}")
    for name in ("tests", "train"):
        if name in results and results[name].get("returncode") != 0:
            out.append(f"{name}: exit {results[name].get('returncode')}")
    for r in results.get("pipeline", []):
        if "returncode" in r and r["returncode"] != 0:
            out.append(f"pipeline {r['policy']}: exit {r['returncode']}")
    return out


def summary(results: dict) -> str:
    dev = results["device"]
    lines = [f"## GPU check: {dev['kind']} x {dev['count']} (jax {jax.__version__})", ""]
    lines += [
        "| layout | implementation | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | rel. error out / dq / dk / dv |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results.get("attention", []):
        errs = " / ".join(f"{r[f'err_{p}']:.1e}" for p in ("out", "dq", "dk", "dv") if f"err_{p}" in r)
        if r.get("nonfinite"):
            errs += f" ({r['nonfinite']} non-finite)"
        if "fwd_s" not in r:
            lines.append(
                f"| {r['layout']} | {r['implementation']} | error: {_one_line(r.get('error', ''))[:80]} | | | | {errs} |"
            )
        else:
            lines.append(
                f"| {r['layout']} | {r['implementation']} | {1e3 * r['fwd_s']:.2f} | {r['fwd_tflops']:.0f} | "
                f"{1e3 * r['fwd_bwd_s']:.2f} | {r['fwd_bwd_tflops']:.0f} | {errs} |"
            )
    steps = results.get("step", [])
    if steps:
        lines += [
            "",
            "| step | rows × seq | docs | compile s | step ms (min-max) | tokens/s | model TFLOP/s | memory_analysis GiB "
            "| measured peak GiB | losses |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    for s in steps:
        if "step_s_median" not in s:
            lines.append(f"| {s.get('name')} | error: {_one_line(s.get('error', ''))[-120:]} | | | | | | | | |")
            continue
        lo, hi = s["step_s_spread"]
        lines.append(
            f"| {s['name']} | {s['rows']} × {s['seq_len']} | {s['documents']} | {s['compile_s']:.0f} | "
            f"{1e3 * s['step_s_median']:.1f} ({1e3 * lo:.1f}-{1e3 * hi:.1f}) | {s['tokens_per_s']:.0f} | "
            f"{s['model_tflops_per_s']:.0f} | {_gib(s['compiled_need_bytes'])} | {_gib(s['measured_peak_bytes'])} | "
            f"{s['losses'][0]:.4f} → {s['losses'][-1]:.4f} |"
        )
    if "tests" in results:
        t = results["tests"]
        lines += ["", f"Kernel tests on the GPU ({', '.join(KERNEL_TESTS)}): {t['summary']} (exit {t['returncode']})."]
        lines += [f"- {x}" for x in t["failures"][:20]]
    train = results.get("train")
    if train:
        losses = train.get("losses") or [float("nan")]
        lines += [
            "",
            f"Main job (`python -m jvarlen.train`): exit {train['returncode']}, {len(losses)} steps, loss "
            f"{losses[0]:.4f} → {losses[-1]:.4f}, median step {train.get('median_step_s')} s, {train['wall_s']:.0f} s wall.",
        ]
    for r in results.get("pipeline", []):
        lines.append(f"- pipeline: {r}")
    if "profile" in results:
        lines.append(f"- profile: {results['profile'].get('files')}")
    failed = failures(results)
    lines += ["", f"Failures: {len(failed)}", *(f"- {f}" for f in failed)]
    return "\n".join(lines) + "\n"


def _steps(specs: list[str]) -> list[dict]:
    """Each ``CONFIG[,key=value,...]`` spec's step_part, an error recorded per spec."""
    rows = []
    for spec in specs:
        path, *overrides = spec.split(",")
        try:
            row = step_part(path, overrides, steps=5)
        except Exception:
            row = {"error": traceback.format_exc()}
        row["name"] = spec
        rows.append(row)
        print("[gpu_check] step", row, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/gpu_check")
    ap.add_argument(
        "--step",
        action="append",
        default=None,
        help="CONFIG[,key=value,...]: a data-parallel step to compile, run and time (repeatable; "
        "default configs/default.yaml)",
    )
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv_heads", type=int, default=8)
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--train_steps", type=int, default=100)
    ap.add_argument("--pipeline_steps", type=int, default=8)
    ap.add_argument("--tests_timeout", type=int, default=600, help="seconds for the kernel tests on the GPU")
    ap.add_argument(
        "--skip", action="append", default=[], choices=["attention", "step", "train", "tests", "pipeline", "profile"]
    )
    ap.add_argument("--allow_cpu", action="store_true", help="run on a CPU backend too (a dry run of the script)")
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.allow_cpu:
        print("gpu_check needs a GPU (jax.default_backend() is %r)" % jax.default_backend(), file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    results = {"device": {"kind": jax.devices()[0].device_kind, "count": jax.device_count()}, "errors": {}}
    parts = {
        # steps first: the allocator's peak is per process, so each step's figure is read before
        # anything larger ran (give --step specs smallest first)
        "step": lambda: _steps(args.step or ["configs/default.yaml"]),
        "attention": lambda: attention_part(args.heads, args.kv_heads, args.head_dim, jnp.bfloat16),
        "train": lambda: train_part(args.out, args.train_steps),
        "tests": lambda: tests_part(args.out, args.tests_timeout),
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
    return 1 if failures(results) else 0


if __name__ == "__main__":
    sys.exit(main())
