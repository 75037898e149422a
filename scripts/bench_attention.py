"""Varlen attention benchmark on packed stdlib documents (issue 3).

Packs real document lengths (the stdlib corpus, ``jvarlen.plan.workloads``) into
rows of N tokens and times ``varlen_attention`` (implementation "auto": Pallas on
GPU, blockwise XLA elsewhere) forward and forward+backward, against
``jax.nn.dot_product_attention`` with a dense mask (XLA, and cuDNN when on GPU and
it accepts the case) and the dense-masked reference. Effective TFLOP/s count only
visible (q, k) pairs: 4*D flops per pair and head forward, 14*D forward+backward
(2 + 5 matmuls). Prints a markdown table and writes every record as JSON.

    python scripts/bench_attention.py                       # GPU: 16K/64K/128K, D 64/128, GQA 1/4
    python scripts/bench_attention.py --tokens 2048 4096 --hidden 512 --doc-scale 0.0625  # CPU
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jvarlen.kernels import BlockSizes, block_info_for, reference_attention, varlen_attention  # noqa: E402
from jvarlen.kernels import testing as kt  # noqa: E402
from jvarlen.plan.workloads import sample_batch  # noqa: E402


def packed_row(tokens: int, seed: int, doc_scale: float = 1.0):
    """One row of ``tokens`` tokens packed from stdlib document lengths (truncated).

    ``doc_scale`` < 1 shrinks every document (keeping the length distribution's shape)
    so that small CPU-sized rows hold several documents as a long GPU row would.
    """
    lengths = sample_batch("stdlib", 64 + tokens // 256, context=round(tokens / doc_scale), seed=seed)
    lengths = [max(1, round(n * doc_scale)) for n in lengths]
    return kt.pack_documents(lengths, tokens)


def visible_pair_count(seg: np.ndarray, pos: np.ndarray) -> int:
    """Causal self-attention pairs of one row, without a T x S matrix."""
    total = 0
    for s in np.unique(seg[seg != 0]):
        p = np.sort(pos[seg == s])
        total += int(np.searchsorted(p, p, side="right").sum())
    return total


def timed(fn, *args, iters: int) -> float:
    """Median seconds of ``fn(*args)`` after one warm-up (compile) call."""
    return statistics.median(kt.call_seconds(fn, *args, repeats=iters))


def make_fns(name, ids, causal=True, block_sizes=None, info=None):
    """-> (forward(q, k, v), forward+backward(q, k, v, ct)) jitted for one implementation."""
    q_seg, q_pos = ids

    if name == "varlen":

        def attn(q, k, v):
            return varlen_attention(
                q,
                k,
                v,
                q_segment_ids=q_seg,
                kv_segment_ids=q_seg,
                q_positions=q_pos,
                kv_positions=q_pos,
                causal=causal,
                block_sizes=block_sizes,
                block_info=info,
            )
    elif name == "reference":

        def attn(q, k, v):
            scale = q.shape[-1] ** -0.5
            return reference_attention(q, k, v, q_seg, q_seg, q_pos, q_pos, causal=causal, sm_scale=scale)
    else:  # "xla" / "cudnn": jax.nn.dot_product_attention with a dense [B, 1, T, S] mask
        impl = name

        def attn(q, k, v):
            m = (q_seg[:, :, None] == q_seg[:, None, :]) & (q_seg[:, :, None] != 0)
            m &= q_pos[:, None, :] <= q_pos[:, :, None]
            return jax.nn.dot_product_attention(q, k, v, mask=m[:, None], implementation=impl)

    def fwd_bwd(q, k, v, ct):
        out, vjp = jax.vjp(attn, q, k, v)
        return vjp(ct)

    return jax.jit(attn), jax.jit(fwd_bwd)


def run(args):
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu else "float32"))
    max_dense = args.max_dense_tokens or (16384 if on_gpu else 4096)
    baselines = ["xla", "reference"] + (["cudnn"] if on_gpu else [])
    records = []
    for tokens in args.tokens:
        seg, pos = packed_row(tokens, args.seed, args.doc_scale)
        pairs = visible_pair_count(seg, pos) * args.batch
        ids = (jnp.asarray(np.tile(seg, (args.batch, 1))), jnp.asarray(np.tile(pos, (args.batch, 1))))
        n_docs = len(np.unique(seg[seg != 0]))
        for d in args.head_dims:
            h = args.hidden // d
            for gqa in args.gqa:
                if h % gqa:
                    continue
                rng = np.random.default_rng(0)
                q, ct = (jnp.asarray(rng.normal(size=(args.batch, tokens, h, d)), dtype) for _ in range(2))
                k, v = (jnp.asarray(rng.normal(size=(args.batch, tokens, h // gqa, d)), dtype) for _ in range(2))
                bs = BlockSizes(args.block_q, args.block_kv)
                info_fn = jax.jit(lambda a, b, bs=bs: block_info_for(a, a, b, b, causal=True, block_sizes=bs))
                sched_s = timed(info_fn, *ids, iters=args.iters)
                info = info_fn(*ids)
                visited = int(info.fwd_counts.sum())
                tiles_total = args.batch * info.fwd_counts.shape[1] * info.bwd_counts.shape[1]
                for name in ["varlen"] + baselines:
                    rec = dict(
                        device=device.device_kind,
                        platform=device.platform,
                        impl=name,
                        tokens=tokens,
                        batch=args.batch,
                        heads=h,
                        kv_heads=h // gqa,
                        head_dim=d,
                        dtype=str(dtype),
                        docs=n_docs,
                        visible_pairs=pairs,
                        tile_fraction=visited / tiles_total,
                        schedule_ms=sched_s * 1e3,
                    )
                    if name != "varlen" and tokens > max_dense:
                        rec["skipped"] = f"dense baseline above --max-dense-tokens={max_dense}"
                        records.append(rec)
                        continue
                    fwd, fwd_bwd = make_fns(name, ids, block_sizes=bs, info=info if name == "varlen" else None)
                    try:
                        t_f = timed(fwd, q, k, v, iters=args.iters)
                        t_fb = timed(fwd_bwd, q, k, v, ct, iters=args.iters)
                    except Exception as e:  # noqa: BLE001 - a baseline may not support the case (cuDNN)
                        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                        records.append(rec)
                        continue
                    flops_f = 4 * pairs * d * h
                    rec.update(
                        fwd_ms=t_f * 1e3,
                        fwd_bwd_ms=t_fb * 1e3,
                        fwd_tflops=flops_f / t_f / 1e12,
                        fwd_bwd_tflops=3.5 * flops_f / t_fb / 1e12,
                    )
                    records.append(rec)
                    print(fmt_row(rec), flush=True)
    return records


HEADER = (
    "| impl | tokens | H/Hkv | D | docs | tiles visited | fwd ms | fwd TFLOP/s | "
    "fwd+bwd ms | fwd+bwd TFLOP/s |\n|---|---|---|---|---|---|---|---|---|---|"
)


def fmt_row(r):
    head = (
        f"| {r['impl']} | {r['tokens']} | {r['heads']}/{r['kv_heads']} | {r['head_dim']} | "
        f"{r['docs']} | {100 * r['tile_fraction']:.1f}% |"
    )
    if "fwd_ms" not in r:
        return head + f" {r.get('skipped') or r.get('error')} | | | |"
    return head + (f" {r['fwd_ms']:.2f} | {r['fwd_tflops']:.4f} | {r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_tflops']:.4f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536, 131072])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--gqa", type=int, nargs="+", default=[1, 4], help="H / Hkv ratios")
    p.add_argument("--hidden", type=int, default=2048, help="H * D")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--block-q", type=int, default=128)
    p.add_argument("--block-kv", type=int, default=128)
    p.add_argument("--dtype", default=None, help="default bfloat16 on GPU, float32 elsewhere")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--doc-scale", type=float, default=1.0, help="multiply document lengths (e.g. 1/16 for CPU-sized rows)"
    )
    p.add_argument(
        "--max-dense-tokens",
        type=int,
        default=None,
        help="skip dense baselines above this (default 16384 GPU, 4096 CPU)",
    )
    p.add_argument("--out", default="bench_attention.json")
    args = p.parse_args()
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print(HEADER)
    t0 = time.perf_counter()
    records = run(args)
    pathlib.Path(args.out).write_text(json.dumps(records, indent=1))
    print("\n" + HEADER)
    for r in records:
        print(fmt_row(r))
    print(f"\nwrote {args.out}; wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
