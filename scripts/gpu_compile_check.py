"""Deviceless GPU compile check: does every attention configuration and train step compile
for an H100 / A100, and what does it need?

    pip install -e '.[gpu-aot]'          # the CUDA plugin + ptxas; no GPU, no cuDNN needed
    python scripts/gpu_compile_check.py --target h100 --target a100 [--part attention|steps|pipeline]

Attention: Pallas forward + backward for dtypes {bf16, f16, f32} x head dims {64, 80, 96,
128, 256} x {gqa, context} (``jvarlen.gpu_aot.ATTENTION_CASES``). Train steps: the
data-parallel step of configs/default.yaml, configs/epp-cpu.yaml and configs/llama-7b.yaml
(real shapes: 8 GPUs, 16 rows x 32K tokens) with its remat policy. Pipeline: llama-7b's elastic
pipeline step on 8 GPUs, (dp, pp, sp) in {(1,2,4), (2,2,2), (4,2,1)} (or ``--layout``, ``--chunks``,
``--bucket``, ``--layers``, ``--split``: one document cut into the chunks, ``--recompute``: every
layer recomputed, ``--recompute_layers K``: K of each stage's layers), stage weights
replicated and sharded over dp x sp, with the weight gathers the compiled schedule overlaps with
compute. Every row either compiles or is refused by the project (``kernels.UnsupportedError``); a
failure inside XLA/Triton is printed as FAILED and makes the exit status 1. Prints a markdown table:
status, largest shared memory of the Pallas kernels, register spill bytes (ptxas), peak
memory per device (arguments + outputs + temporaries - donated), attention forwards per
layer. ``--search`` instead compiles candidate tiles per (target, dtype size, head dim)
and prints the largest that fit without spills (rows for ``kernels/gpu_config._TABLE``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from typing import Optional

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jvarlen import (
    gpu_aot,  # first: lets the CUDA plugin register without cuDNN
    kernels,  # noqa: E402
)
from jvarlen.config import load_config  # noqa: E402
from jvarlen.runtime.memory_fit import check_fit  # noqa: E402

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
HEAD_DIMS = (64, 80, 96, 128, 256)
# config file, devices, overrides (the llama-7b row is the shape of the issue: 8 GPUs, 16 x 32K)
STEPS = {
    "default": ("configs/default.yaml", 2, {}),
    "default-f32": ("configs/default.yaml", 2, {"model.compute_dtype": "float32"}),
    "epp-cpu": ("configs/epp-cpu.yaml", 8, {"model.attention": "auto"}),
    "llama-7b": ("configs/llama-7b.yaml", 8, {}),
}
# the elastic pipeline's step of llama-7b on 8 GPUs, (dp, pp, sp), both stage-weight placements:
# 4 one-document chunks of 8K tokens per pipeline, 1F1B, nothing recomputed
PIPELINE_LAYOUTS = ((1, 2, 4), (2, 2, 2), (4, 2, 1))
PIPELINE_CHUNKS, PIPELINE_BUCKET = 4, 8192
GiB = 2**30


@dataclasses.dataclass
class Row:
    target: str
    what: str
    status: str  # compiled | refused | FAILED
    detail: str = ""
    shared_memory: int = 0
    spill_bytes: Optional[int] = 0  # None: ptxas did not tell
    peak_gib: float = 0.0
    attention_fwd_per_layer: str = ""
    seconds: float = 0.0
    kernels: list = dataclasses.field(default_factory=list)


def _run(target, what, lower):
    t0 = time.perf_counter()
    try:
        report = gpu_aot.compile_report(lower())
    except kernels.UnsupportedError as e:
        return Row(target, what, "refused", str(e), seconds=time.perf_counter() - t0), None
    except Exception as e:  # anything else failed inside JAX/XLA/Triton: the bar says none may
        msg = " ".join(str(e).split())[:300]
        return Row(target, what, "FAILED", f"{type(e).__name__}: {msg}", seconds=time.perf_counter() - t0), None
    row = Row(
        target,
        what,
        "compiled",
        shared_memory=report.max_shared_memory,
        spill_bytes=report.spill_bytes,
        peak_gib=report.peak_bytes / GiB,
        seconds=time.perf_counter() - t0,
        kernels=[dataclasses.asdict(k) for k in report.kernels],
    )
    return row, report


def attention_rows(target: str, dtypes, head_dims, cases):
    device = gpu_aot.abstract_devices(target, 1)[0]
    tgt = gpu_aot.gpu_target(target)
    for dname in dtypes:
        for d in head_dims:
            for case in cases:
                what = f"attention {dname} d={d} {case}"
                lower = lambda dt=DTYPES[dname], d=d, case=case: gpu_aot.lower_attention(
                    device, dt, d, case, target=tgt
                )  # noqa: E731
                row, _ = _run(target, what, lower)
                yield row


def step_rows(target: str, names, layers=None):
    tgt = gpu_aot.gpu_target(target)
    for name in names:
        path, n, overrides = STEPS[name]
        extra = {} if layers is None else {"model.num_layers": str(layers)}
        config = load_config(path, **{"parallel.pp": "1", **overrides, **extra})
        devices = gpu_aot.abstract_devices(target, n)

        def lower(config=config, devices=devices):
            with kernels.compile_for(tgt):
                return gpu_aot.lower_train_step(config, devices)

        rows = config.data.tokens_per_batch // config.data.seq_len
        what = f"step {name} ({n} GPUs, {rows}x{config.data.seq_len}, remat={config.model.remat}"
        what += f", {layers} layers)" if layers is not None else ")"
        row, report = _run(target, what, lower)
        if report is not None:
            fwd = report.count("varlen_flash_fwd")
            row.attention_fwd_per_layer = f"{fwd} (dq {report.count('varlen_flash_dq')})"
            fit = check_fit(report.memory, device_bytes=tgt.memory_bytes, env={})
            row.detail = fit.message
            if name == "llama-7b":
                pred = cost_model_memory(config, n, target)
                m = report.memory
                row.detail += (
                    f"; cost model (analytic {target}): peak {pred['peak'] / GiB:.1f} GiB "
                    f"({(pred['peak'] - report.peak_bytes) / report.peak_bytes:+.0%}), model states "
                    f"{pred['model_state'] / GiB:.1f} GiB vs XLA arguments {m['argument_size_in_bytes'] / GiB:.1f} GiB, "
                    f"activations+working {(pred['activations'] + pred['working']) / GiB:.1f} GiB vs XLA temporaries "
                    f"{m['temp_size_in_bytes'] / GiB:.1f} GiB; planner budget {pred['budget'] / GiB:.1f} GiB"
                )
        yield row


def pipeline_rows(
    target: str,
    layouts=PIPELINE_LAYOUTS,
    chunks=PIPELINE_CHUNKS,
    bucket=PIPELINE_BUCKET,
    layers=None,
    split=False,
    recompute=False,
    vocab=None,
):
    """llama-7b's pipeline step (``layers``: that many decoder layers instead; ``vocab``: that vocabulary,
    which sizes the embedding and head) per layout, ``chunks``
    one-document chunks of ``bucket`` tokens per pipeline (``split``: one document cut into ``chunks``
    slices, with context buffers; ``recompute``: every layer recomputed), stage weights replicated and sharded
    over dp x sp (ZeRO-3): compiled memory per device, the stage layers' copy (compute dtype) +
    gradient accumulator (parameter dtype) one device holds by design, and the weight gathers."""
    from jvarlen.layout import Layout
    from jvarlen.plan.cost import ModelShape

    tgt = gpu_aot.gpu_target(target)
    overrides = {"model.num_layers": layers, "model.vocab_size": vocab}
    config = load_config("configs/llama-7b.yaml", **{k: str(v) for k, v in overrides.items() if v})
    shape = ModelShape.from_config(config.model)
    for dp, pp, sp in layouts:
        layout = Layout(dp=dp, pp=pp, sp=sp)
        devices = gpu_aot.abstract_devices(target, layout.num_devices)
        for mode in ("replicated", "sharded"):

            def lower(layout=layout, devices=devices, mode=mode):
                with kernels.compile_for(tgt):
                    return gpu_aot.lower_pipeline_step(
                        config,
                        devices,
                        layout,
                        chunks=chunks,
                        bucket=bucket,
                        stage_weights=mode,
                        split=split,
                        recompute=recompute,
                    )

            what = (
                f"pipeline llama-7b{f' ({shape.num_layers} layers)' if layers else ''}"
                f"{f' (vocabulary {shape.vocab_size})' if vocab else ''} (dp, pp, sp) = "
                f"({dp}, {pp}, {sp}), stage weights {mode} ({chunks} x {bucket / 1024:g}K tokens per pipeline"
                f"{', one document' if split else ''}{_recompute_words(recompute)})"
            )
            row, report = _run(target, what, lower)
            if report is not None:
                m = report.memory
                stage_params = shape.num_layers // pp * shape.layer_params
                # the stage's copy (compute dtype) and gradient accumulator (parameter dtype)
                per_param = (
                    jnp.dtype(config.model.compute_dtype).itemsize + jnp.dtype(config.model.param_dtype).itemsize
                )
                stage = per_param * stage_params / (dp * sp if mode == "sharded" else 1)
                overlapped, gathers = report.overlapped()
                in_loops, loop_gathers = report.overlapped(loops_only=True)
                rs_loops, loop_rs = report.overlapped("reduce-scatter", loops_only=True)
                fwd = report.count("varlen_flash_fwd")
                row.attention_fwd_per_layer = f"{fwd} (dq {report.count('varlen_flash_dq')})"
                row.detail = (
                    f"arguments {m['argument_size_in_bytes'] / GiB:.2f} GiB, temporaries "
                    f"{m['temp_size_in_bytes'] / GiB:.2f} GiB; the stage layers' copy + gradients "
                    f"{stage / GiB:.2f} GiB per device; {gathers} async all-gathers "
                    f"({overlapped} with a kernel, conditional or loop between start and done; in the "
                    f"passes over the layers {in_loops} of {loop_gathers}), "
                    f"{len(re.findall(r' reduce-scatter(?:-start)?[(]', report.hlo))} reduce-scatters in the HLO "
                    f"({rs_loops} of the {loop_rs} async ones in the passes overlapped)"
                )
                pred = pipeline_cost_memory(
                    shape, layout, target, chunks, bucket, mode == "sharded", split, recompute, config=config
                )
                row.detail += (
                    f"; the planner's executor account (analytic {target}) {pred['account'] / GiB:.2f} GiB "
                    f"({(pred['account'] - report.peak_bytes) / report.peak_bytes:+.1%}); its Eq. 10 time line: "
                    f"peak {pred['peak'] / GiB:.2f} GiB "
                    f"({(pred['peak'] - report.peak_bytes) / report.peak_bytes:+.0%}): model states "
                    f"{pred['model_state'] / GiB:.2f}, activations {pred['activations'] / GiB:.2f}, working "
                    f"{pred['working'] / GiB:.2f}, a backward's layer gradients {pred['layer_gradients'] / GiB:.2f} GiB"
                )
            yield row


def _recompute_words(recompute) -> str:
    if recompute is True:
        return ", every layer recomputed"
    return f", {recompute} layers of each stage recomputed" if recompute else ""


def pipeline_cost_memory(
    shape, layout, target: str, chunks: int, bucket: int, sharded: bool, split=False, recompute=False, config=None
) -> dict:
    """What the planner's cost model predicts for :func:`gpu_aot.lower_pipeline_step`'s plan (``chunks``
    one-document chunks of ``bucket`` tokens, 1F1B, or with ``split`` the slices of one document in
    token-level 1F1B; nothing recomputed, or with ``recompute`` every layer), bytes per device of the
    stage that needs most: model states, the stored activations at the peak and the working memory
    of the backward running then (of the largest backward: with ``split`` the slices' differ), with
    the layer gradients it returns (``jvarlen.plan.plan.replay_peaks``); and ``account``, the
    planner's account of what the executor's compiled step holds for the plan, which it fits plans
    to (``jvarlen.plan.executor_memory``). With ``config``, a stored layer keeps what its
    ``parallel.residual_policy`` saves, as the runtime's cost model charges it."""
    from jvarlen.plan import schedule
    from jvarlen.plan.chunk import ChunkShape
    from jvarlen.plan.cost import CostModel
    from jvarlen.plan.executor_memory import executor_memory
    from jvarlen.plan.plan import Plan, replay_peaks
    from jvarlen.runtime.strategies.pipeline import with_stored_bytes

    coeffs = _analytic(shape, target)
    if config is not None:
        coeffs = with_stored_bytes(coeffs, config)
    cost = CostModel(shape, layout, coeffs, stage_weights_sharded=sharded)
    if split:
        shapes = [ChunkShape(i * bucket, (bucket,), tail=i == chunks - 1) for i in range(chunks)]
        sched = schedule.token_level_1f1b([-1] + list(range(chunks - 1)), layout.pp)
    else:
        shapes = [ChunkShape(0, (bucket,))] * chunks
        sched = schedule.one_f_one_b(chunks, layout.pp)
    ckpt = gpu_aot.recomputed_layers(recompute, cost.layers_per_stage)
    table = np.full((chunks, layout.pp), ckpt, np.int32)
    peaks = replay_peaks(shapes, sched, table, cost)
    p = int(np.argmax(peaks))
    state = cost.model_state_memory(p)
    work, grads = max(cost.working_memory(c, ckpt) for c in shapes), cost.layer_gradient_memory()
    if split:
        lengths, pieces = (chunks * bucket,), tuple(((0, i * bucket, bucket),) for i in range(chunks))
    else:
        lengths, pieces = (bucket,) * chunks, tuple(((i, 0, bucket),) for i in range(chunks))
    plan = Plan("given", layout, shape.num_layers, lengths, pieces, (chunks,), sched, table, cost.memory_budget)
    return {
        "model_state": state,
        "activations": peaks[p] - state - work - grads,
        "working": work,
        "layer_gradients": grads,
        "peak": peaks[p],
        "account": executor_memory(plan, cost).total,
    }


def _analytic(shape, target: str):
    """The analytic cost coefficients of ``target``'s GPU (the A100 is priced as the A800)."""
    from jvarlen.plan.hardware import analytic_coefficients

    return analytic_coefficients(shape, "h100" if target == "h100" else "a800")


def cost_model_memory(config, devices: int, target: str) -> dict:
    """What the planner's cost model predicts for the same data-parallel step, bytes per device:
    model states + Eq. 10 activations (all layers checkpointed when model.remat, else each keeping
    what ``parallel.residual_policy`` saves, as the runtime's cost model charges a stored layer) +
    working memory, and its memory budget; with the analytic profile of the target's GPU."""
    from jvarlen.layout import Layout
    from jvarlen.plan.chunk import ChunkShape
    from jvarlen.plan.cost import CostModel, ModelShape
    from jvarlen.runtime.strategies.pipeline import with_stored_bytes

    shape = ModelShape.from_config(config.model)
    layout = Layout(dp=devices)
    cost = CostModel(shape, layout, with_stored_bytes(_analytic(shape, target), config))
    rows = config.data.tokens_per_batch // config.data.seq_len // devices
    chunk = ChunkShape(0, (config.data.seq_len,) * rows)
    ckpt = shape.num_layers if config.model.remat else 0
    state = cost.model_state_memory(0)
    return {
        "model_state": state,
        "activations": cost.activation_memory(chunk, ckpt, 0),
        "working": cost.working_memory(chunk, ckpt),
        "peak": state + cost.peak_memory(chunk, ckpt, 0),
        "budget": cost.memory_budget,
    }


def markdown(rows) -> str:
    out = [
        "| target | configuration | status | max shared memory (B) | spills (B) | peak / device (GiB) | attention fwd kernels | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        status = r.status if r.status == "compiled" else f"{r.status}: {r.detail[:160]}"
        smem = f"{r.shared_memory:,}" if r.status == "compiled" else ""
        spills = ("unknown" if r.spill_bytes is None else f"{r.spill_bytes:,}") if r.status == "compiled" else ""
        peak = f"{r.peak_gib:.2f}" if r.status == "compiled" else ""
        out.append(
            f"| {r.target} | {r.what} | {status} | {smem} | {spills} | {peak} | {r.attention_fwd_per_layer} | {r.seconds:.0f} |"
        )
    return "\n".join(out)


# --search: candidate tiles per kernel, preferred first (bigger tiles = fewer passes).
def _candidates(d: int):
    warps = 4 if d <= 64 else 8
    sizes = [(128, 128), (128, 64), (64, 128), (64, 64), (64, 32), (32, 64), (32, 32), (32, 16), (16, 16)]
    return [kernels.KernelTiles(bq, bk, warps, 2) for bq, bk in sizes]


def search(target: str, dtype_names, head_dims):
    """Per kernel, the first candidate whose compile fits shared memory with no spills."""
    device = gpu_aot.abstract_devices(target, 1)[0]
    tgt = gpu_aot.gpu_target(target)
    for dname in dtype_names:
        for d in head_dims:
            chosen, best_spill, unknown = {}, {}, set()
            for cand in _candidates(d):
                todo = [k for k in ("fwd", "dq", "dkv") if k not in chosen]
                if not todo:
                    break
                cfg = kernels.KernelConfig(cand, cand, cand)
                try:
                    report = gpu_aot.compile_report(
                        gpu_aot.lower_attention(device, DTYPES[dname], d, "gqa", kernel_config=cfg, target=tgt)
                    )
                except Exception as e:
                    print(f"  {target} {dname} d={d} {cand}: {type(e).__name__} {str(e)[:120]}", flush=True)
                    continue
                stats = {k.name.removeprefix("varlen_flash_"): k for k in report.kernels}
                for k in todo:
                    ks = stats.get(k)
                    if ks is None:
                        continue
                    print(
                        f"  {target} {dname} d={d} {k} {cand}: smem {ks.shared_memory} spill {ks.spill_stores}",
                        flush=True,
                    )
                    if ks.spill_stores is None:
                        unknown.add(k)  # no ptxas: a tile is not chosen on spills nobody counted
                    elif ks.spill_stores == 0:
                        chosen[k] = cand
                    elif k not in best_spill or ks.spill_stores < best_spill[k][0]:
                        best_spill[k] = (ks.spill_stores, cand)
            for k in ("fwd", "dq", "dkv"):
                if k not in chosen and k in best_spill:
                    chosen[k] = best_spill[k][1]
            if unknown - set(chosen):
                print(
                    f"{target} {dname} d={d}: spills of {sorted(unknown - set(chosen))} unknown (no ptxas)", flush=True
                )
            line = ", ".join(f"{k}=({c.block_q}, {c.block_kv}, {c.num_warps})" for k, c in chosen.items())
            print(f"{target} {dname} d={d}: {line}", flush=True)


def _layout(text: str) -> tuple:
    try:
        dp, pp, sp = (int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected dp,pp,sp (three integers), got {text!r}") from None
    return dp, pp, sp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", choices=sorted(gpu_aot.TARGETS), help="repeatable; default both")
    ap.add_argument("--part", choices=("all", "attention", "steps", "pipeline"), default="all")
    ap.add_argument("--dtype", action="append", choices=sorted(DTYPES))
    ap.add_argument("--head_dim", action="append", type=int)
    ap.add_argument("--case", action="append", choices=sorted(gpu_aot.ATTENTION_CASES))
    ap.add_argument("--step", action="append", choices=sorted(STEPS))
    ap.add_argument(
        "--layout", action="append", type=_layout, help=f"pipeline: dp,pp,sp (repeatable; default {PIPELINE_LAYOUTS})"
    )
    ap.add_argument("--chunks", type=int, default=PIPELINE_CHUNKS, help="pipeline: chunks per pipeline")
    ap.add_argument("--bucket", type=int, default=PIPELINE_BUCKET, help="pipeline: tokens per chunk")
    ap.add_argument("--split", action="store_true", help="pipeline: one document cut into the chunks (context buffers)")
    ap.add_argument("--recompute", action="store_true", help="pipeline: every layer of every chunk recomputed")
    ap.add_argument("--recompute_layers", type=int, help="pipeline: that many of each stage's layers recomputed")
    ap.add_argument("--layers", type=int, help="steps and pipeline: decoder layers (default: the config's)")
    ap.add_argument("--vocab", type=int, help="pipeline: vocabulary size (default: llama-7b's 32,000)")
    ap.add_argument("--json", help="also write the rows (with per-kernel figures) here")
    ap.add_argument("--search", action="store_true", help="search kernel tiles instead (slow)")
    args = ap.parse_args(argv)
    reason = gpu_aot.unavailable_reason()
    if reason:
        print(f"deviceless GPU compilation unavailable: {reason}", file=sys.stderr)
        return 2
    targets = args.target or ["h100", "a100"]
    dtypes, head_dims = args.dtype or list(DTYPES), args.head_dim or list(HEAD_DIMS)
    if args.search:
        for target in targets:
            search(target, args.dtype or ["bf16", "f32"], args.head_dim or [64, 128, 256])
        return 0
    t0, rows = time.perf_counter(), []
    for target in targets:
        if args.part in ("all", "attention"):
            for row in attention_rows(target, dtypes, head_dims, args.case or list(gpu_aot.ATTENTION_CASES)):
                rows.append(row)
                print(f"{row.target} {row.what}: {row.status} {row.detail[:200]} ({row.seconds:.0f} s)", flush=True)
        if args.part in ("all", "steps"):
            for row in step_rows(target, args.step or list(STEPS), args.layers):
                rows.append(row)
                print(f"{row.target} {row.what}: {row.status} {row.detail[:200]} ({row.seconds:.0f} s)", flush=True)
        if args.part in ("all", "pipeline"):
            for row in pipeline_rows(
                target,
                args.layout or PIPELINE_LAYOUTS,
                args.chunks,
                args.bucket,
                args.layers,
                args.split,
                True if args.recompute else (args.recompute_layers or False),
                args.vocab,
            ):
                rows.append(row)
                print(f"{row.target} {row.what}: {row.status} {row.detail[:400]} ({row.seconds:.0f} s)", flush=True)
    print()
    print(markdown(rows))
    counts = {s: sum(r.status == s for r in rows) for s in ("compiled", "refused", "FAILED")}
    print(
        f"\n{counts['compiled']} compiled, {counts['refused']} refused, {counts['FAILED']} failed inside XLA; "
        f"{time.perf_counter() - t0:.0f} s"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
