"""Pipeline executor benchmark on CPU (fake host devices).

1. Overhead of the executor (pp = 1, one chunk) over the plain jitted loss+grad step.
2. Per-tick time and compile time versus the number of chunks (pp = 2, 1F1B).
3. Step time versus the number of recomputed layers per stage (table as data, one compile).
4. 1F1B versus GPipe op order in the lock-step executor (pp = 2, same chunks, interleaved).

    python scripts/bench_pipeline.py [--tokens 512] [--d-model 128] [--repeats 10] [--parts order]

Prints a Markdown table per part (pasted into docs/benchmarks.md, section "Pipeline").
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jvarlen.config import ModelConfig  # noqa: E402
from jvarlen.layout import Layout  # noqa: E402
from jvarlen.model import build_model  # noqa: E402
from jvarlen.parallel import pipeline as pl  # noqa: E402
from jvarlen.parallel.layouts import layout_mesh  # noqa: E402
from jvarlen.parallel.pipeline import pack_chunks  # noqa: E402
from jvarlen.plan import schedule as sch  # noqa: E402
from jvarlen.runtime.state import split_model  # noqa: E402
from jvarlen.runtime.step import loss_and_grads  # noqa: E402


def timed(fn, *args, repeats: int) -> float:
    """Best-of-``repeats`` seconds of one call (after a warm-up call)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def interleaved(runs: dict, params, repeats: int) -> dict:
    """Best-of-``repeats`` seconds of each run, the runs taking turns (fairer on a loaded machine)."""
    for fn, batch in runs.values():
        jax.block_until_ready(fn(params, batch))
    best = {name: float("inf") for name in runs}
    for _ in range(repeats):
        for name, (fn, batch) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(params, batch))
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def documents(n_chunks: int, tokens: int, vocab: int, seed: int = 0):
    """Two documents per chunk filling it: (docs, chunks)."""
    rng = np.random.default_rng(seed)
    docs, chunks = [], []
    for k in range(n_chunks):
        a = int(rng.integers(tokens // 4, 3 * tokens // 4))
        docs += [rng.integers(1, vocab, size=a), rng.integers(1, vocab, size=tokens - a)]
        chunks.append([(2 * k, 0, a), (2 * k + 1, 0, tokens - a)])
    return [d.astype(np.int32) for d in docs], chunks


# what a stored layer keeps: everything / matmul outputs / matmul and attention outputs
POLICIES = (None, "dots_with_no_batch_dims_saveable", "dots_and_attention")


def compile_step(graphdef, cfg, params, layout, packs, scheds, ckpts, policy=None, fuse=True):
    sig, batch = pl.prepare_batch(packs, scheds, ckpts, layout, cfg.num_layers, fuse=fuse)
    fn = jax.jit(
        pl.make_pipeline_grads(
            graphdef, cfg, sig, layout_mesh(layout, jax.devices()[: layout.num_devices]), residual_policy=policy
        )
    )
    start = time.perf_counter()
    compiled = fn.lower(params, batch).compile()
    return sig, batch, compiled, time.perf_counter() - start


def overhead(graphdef, cfg, params, tokens, repeats):
    """pp = 1, one chunk: the executor as it runs such a plan (F and B fused into one tick),
    and with F and B kept in separate ticks — the stored-residual / recompute path every
    stage but the last takes when pp > 1."""
    docs, chunks = documents(1, tokens, cfg.vocab_size)
    pack = pack_chunks(chunks, docs, tokens)
    layout = Layout(1, 1, 1)
    plain_batch = {k: pack.arrays[k] for k in ("tokens", "segment_ids", "positions", "targets", "loss_mask")}
    runs = {"plain jitted loss+grads": (jax.jit(lambda p, b: loss_and_grads(graphdef, p, b)), plain_batch)}
    variants = [("executor, F and B fused in one tick", None, 0, True)]
    for policy in POLICIES:
        for r in (0, cfg.num_layers):
            variants.append(
                (
                    f"executor, F and B in separate ticks, residuals kept: {policy or 'all'}, layers recomputed: {r}",
                    policy,
                    r,
                    False,
                )
            )
    for name, policy, r, fuse in variants:
        _, batch, step, _ = compile_step(
            graphdef, cfg, params, layout, [pack], [sch.gpipe(1, 1)], [np.full((1, 1), r, np.int32)], policy, fuse
        )
        runs[name] = (step, batch)
    best = interleaved(runs, params, repeats)
    plain = best["plain jitted loss+grads"]
    print("\n| step (pp=1, one chunk of %d tokens) | ms | overhead |" % tokens)
    print("|---|---|---|")
    for name, t in best.items():
        print(f"| {name} | {t * 1e3:.2f} | {'' if t == plain else f'{100 * (t / plain - 1):+.1f} %'} |")


def per_tick(graphdef, cfg, params, tokens, repeats, counts=(2, 4, 8, 16)):
    layout = Layout(1, 2, 1)
    print("\n| chunks (pp=2, 1F1B, %d tokens each) | ticks | compile s | step ms | ms per tick |" % tokens)
    print("|---|---|---|---|---|")
    for n in counts:
        docs, chunks = documents(n, tokens, cfg.vocab_size, seed=n)
        pack = pack_chunks(chunks, docs, tokens)
        sig, batch, step, compile_s = compile_step(
            graphdef, cfg, params, layout, [pack], [sch.one_f_one_b(n, 2)], [np.zeros((n, 2), np.int32)]
        )
        t = timed(step, params, batch, repeats=repeats)
        print(f"| {n} | {sig.n_ticks} | {compile_s:.1f} | {t * 1e3:.1f} | {t * 1e3 / sig.n_ticks:.2f} |")


def recompute(graphdef, cfg, params, tokens, repeats, n=4):
    layout = Layout(1, 2, 1)
    ls = cfg.num_layers // 2
    docs, chunks = documents(n, tokens, cfg.vocab_size, seed=99)
    pack = pack_chunks(chunks, docs, tokens)
    sched = sch.one_f_one_b(n, 2)
    print(
        f"\n| residuals kept | layers recomputed per stage (of {ls}; pp=2, {n} chunks, one executable) "
        "| layer forwards per stage | step ms |"
    )
    print("|---|---|---|---|")
    for policy in POLICIES:
        sig, _, step, _ = compile_step(
            graphdef, cfg, params, layout, [pack], [sched], [np.zeros((n, 2), np.int32)], policy
        )
        runs = {}
        for r in range(ls, -1, -1):
            _, batch = pl.prepare_batch(
                [pack], [sched], [np.full((n, 2), r, np.int32)], layout, cfg.num_layers, signature=sig
            )
            runs[r] = (step, batch)
        best = interleaved(runs, params, repeats)
        for r, (fn, batch) in runs.items():
            forwards = np.asarray(fn(params, batch)[2])[0].tolist()
            print(f"| {policy or 'all'} | {r} | {forwards} | {best[r] * 1e3:.1f} |")


def order(graphdef, cfg, params, tokens, repeats, counts=(4, 8)):
    """The executor runs ticks in lock-step: 1F1B pairs a forward with a backward in most ticks
    (each such tick at backward speed), GPipe order pairs like with like but keeps every chunk
    in flight."""
    layout = Layout(1, 2, 1)
    print(f"\n| chunks (pp=2, {tokens} tokens each) | 1F1B ticks | 1F1B ms | GPipe ticks | GPipe ms | GPipe / 1F1B |")
    print("|---|---|---|---|---|---|")
    for n in counts:
        docs, chunks = documents(n, tokens, cfg.vocab_size, seed=7 + n)
        pack = pack_chunks(chunks, docs, tokens)
        runs, ticks = {}, {}
        for name, sched in (("1f1b", sch.one_f_one_b(n, 2)), ("gpipe", sch.gpipe(n, 2))):
            sig, batch, step, _ = compile_step(
                graphdef, cfg, params, layout, [pack], [sched], [np.zeros((n, 2), np.int32)], "dots_and_attention"
            )
            runs[name], ticks[name] = (step, batch), sig.n_ticks
        best = interleaved(runs, params, repeats)
        print(
            f"| {n} | {ticks['1f1b']} | {best['1f1b'] * 1e3:.1f} | {ticks['gpipe']} | {best['gpipe'] * 1e3:.1f} "
            f"| {best['gpipe'] / best['1f1b']:.2f} |"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--attention", default="xla")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--parts", default="overhead,ticks,recompute,order")
    args = parser.parse_args()
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
        overhead(graphdef, cfg, params, args.tokens, args.repeats)
    if "ticks" in parts:
        per_tick(graphdef, cfg, params, args.tokens, args.repeats)
    if "recompute" in parts:
        recompute(graphdef, cfg, params, args.tokens, args.repeats)
    if "order" in parts:
        order(graphdef, cfg, params, args.tokens, args.repeats)


if __name__ == "__main__":
    main()
