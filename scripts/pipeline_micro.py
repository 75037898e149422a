"""The pipeline executor's micro-benchmarks, parts 1-4 of ``scripts/bench_pipeline.py``: the
executor against the plain and data-parallel steps (``overhead``), per-tick and compile time
(``ticks``), step time against recomputed layers (``recompute``) and 1F1B against GPipe order,
paired and one op per tick (``order``). Imported after ``bench_pipeline`` has set up XLA's devices.
"""

from __future__ import annotations

import time
from typing import Optional

import jax
import numpy as np
from pipeline_policies import shipped_profile

from jvarlen.layout import Layout
from jvarlen.model.transformer import DOTS_AND_ATTENTION
from jvarlen.parallel import pipeline as pl
from jvarlen.parallel.layouts import layout_mesh
from jvarlen.parallel.pipeline import pack_chunks
from jvarlen.plan import schedule as sch
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, CostModel, ModelShape
from jvarlen.plan.simulator import simulate
from jvarlen.runtime.step import loss_and_grads


def timed(fn, *args, repeats: int) -> float:
    """Best-of-``repeats`` seconds of one call (after a warm-up call)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def interleaved(runs: dict, params, repeats: int, samples: Optional[dict] = None) -> dict:
    """Best-of-``repeats`` wall seconds of each run, the runs taking turns (fairer on a loaded
    machine); ``samples``: filled with every timing per run, ``{name: [(wall s, process CPU s)]}``
    (the CPU time of the whole process, every XLA thread: on one pinned core, time on that core)."""
    for fn, batch in runs.values():
        jax.block_until_ready(fn(params, batch))
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (fn, batch) in runs.items():
            start, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(params, batch))
            times[name].append((time.perf_counter() - start, time.process_time() - cpu))
    if samples is not None:
        samples.update(times)
    return {name: min(w for w, _ in t) for name, t in times.items()}


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


def compile_step(graphdef, cfg, params, layout, packs, scheds, ckpts, policy=None, fuse=True, also=()):
    """(signature, batch, compiled step, compile s) of the tables; ``also``: more recomputation
    tables the signature must hold (the last stage fuses only chunks it recomputes nothing of)."""
    sig, batch = pl.prepare_batch(packs, scheds, ckpts, layout, cfg.num_layers, fuse=fuse)
    if also:
        others = [pl.prepare_batch(packs, scheds, c, layout, cfg.num_layers, fuse=fuse)[0] for c in also]
        sig = pl.cover(sig, *others)
        _, batch = pl.prepare_batch(packs, scheds, ckpts, layout, cfg.num_layers, fuse=fuse, signature=sig)
    fn = jax.jit(
        pl.make_pipeline_grads(
            graphdef, cfg, sig, layout_mesh(layout, jax.devices()[: layout.num_devices]), residual_policy=policy
        )
    )
    start = time.perf_counter()
    compiled = fn.lower(params, batch).compile()
    return sig, batch, compiled, time.perf_counter() - start


def overhead(graphdef, cfg, params, tokens, repeats, n: int = 1):
    """pp = 1, ``n`` chunks: the executor as it runs such a plan (F and B fused into one tick),
    and with F and B kept in separate ticks — the stored-residual / recompute path every
    stage but the last takes when pp > 1 — against the data-parallel step on the same documents as
    ``n`` rows of one batch (its layers keeping what ``parallel.residual_policy``'s default saves, as
    the layouts strategy runs it; the plain jitted loss+grads, every residual kept, beside it)."""
    docs, chunks = documents(n, tokens, cfg.vocab_size)
    pack = pack_chunks(chunks, docs, tokens)
    layout = Layout(1, 1, 1)
    plain_batch = {k: pack.arrays[k] for k in ("tokens", "segment_ids", "positions", "targets", "loss_mask")}
    runs = {"plain jitted loss+grads": (jax.jit(lambda p, b: loss_and_grads(graphdef, p, b)), plain_batch)}
    # the data-parallel step as the layouts strategy runs it (parallel.residual_policy's default)
    dp_step = jax.jit(lambda p, b: loss_and_grads(graphdef, p, b, residual=DOTS_AND_ATTENTION))
    runs[f"data-parallel step, residuals kept: {DOTS_AND_ATTENTION}"] = (dp_step, plain_batch)
    variants = [
        ("executor, F and B fused in one tick", None, 0, True),
        (f"executor, F and B fused in one tick, residuals kept: {DOTS_AND_ATTENTION}", DOTS_AND_ATTENTION, 0, True),
    ]
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
            graphdef, cfg, params, layout, [pack], [sch.one_f_one_b(n, 1)], [np.full((n, 1), r, np.int32)], policy, fuse
        )
        runs[name] = (step, batch)
    best = interleaved(runs, params, repeats)
    dp = best[f"data-parallel step, residuals kept: {DOTS_AND_ATTENTION}"]  # the issue bar's reference
    print(f"\n| step (pp=1, {n} chunk(s) of {tokens} tokens) | ms | against the data-parallel step |")
    print("|---|---|---|")
    for name, t in best.items():
        print(f"| {name} | {t * 1e3:.2f} | {'' if t == dp else f'{100 * (t / dp - 1):+.1f} %'} |")


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
        tables = [[np.full((n, 2), r, np.int32)] for r in range(1, ls + 1)]
        sig, _, step, _ = compile_step(
            graphdef, cfg, params, layout, [pack], [sched], [np.zeros((n, 2), np.int32)], policy, also=tables
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


def order(graphdef, cfg, params, tokens, repeats, counts=(4, 8), profile=None):
    """1F1B and GPipe op order, each as the executor's paired ticks (a backward and a forward per
    stage and tick, the last stage's F and B fused) and as the single-op table (one op per stage and
    tick, run by the same executable with one lane idle): only the tables differ, runs interleaved.
    Median and range of ``repeats`` interleaved timings; ``predicted``: the simulator's time of the
    same table ("paired" / "ticks" mode) with the shipped CPU profile of the model (one core per
    stage); ``predicted, one core``: the stages' summed busy time plus the step overhead, what the
    profile predicts when both fake devices share one core (``taskset -c N``: idle time is free)."""
    layout = Layout(1, 2, 1)
    cost = _profile_cost(cfg, layout, profile)
    print(
        f"\n| chunks (pp=2, {tokens} tokens each) | order | table | ticks | wall ms median (min-max) "
        "| process CPU ms median (min-max) | predicted ms | predicted ms, one core | CPU / predicted one core |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in counts:
        docs, chunks = documents(n, tokens, cfg.vocab_size, seed=7 + n)
        pack = pack_chunks(chunks, docs, tokens)
        shapes = [ChunkShape(0, tuple(p[2] for p in c)) for c in chunks]
        scheds = {"1F1B": sch.one_f_one_b(n, 2), "GPipe": sch.gpipe(n, 2)}
        zero = [np.zeros((n, 2), np.int32)]
        needs = [
            pl.prepare_batch([pack], [sc], zero, layout, cfg.num_layers, paired=pr)[0]
            for sc in scheds.values()
            for pr in (True, False)
        ]
        sig = pl.cover(*needs)
        step = jax.jit(
            pl.make_pipeline_grads(
                graphdef, cfg, sig, layout_mesh(layout, jax.devices()[:2]), residual_policy="dots_and_attention"
            )
        )
        runs, ticks = {}, {}
        for name, sc in scheds.items():
            for pr in (True, False):
                _, batch = pl.prepare_batch([pack], [sc], zero, layout, cfg.num_layers, signature=sig, paired=pr)
                runs[(name, pr)] = (step, batch)
                ticks[(name, pr)] = int((np.asarray(batch["ops"])[0, :, :, :, 0] != 0).any(axis=(1, 2)).sum())
        samples: dict = {}
        interleaved(runs, params, repeats, samples)
        for (name, pr), t in samples.items():
            mode = "paired" if pr else "ticks"
            pred = one = float("nan")
            if cost is not None:
                sim = simulate(scheds[name], shapes, zero[0], cost, mode)
                pred = sim.iteration_time
                one = float(sim.stage_busy.sum()) + sim.iteration_time - sim.makespan
            wall, cpu = np.asarray(t).T * 1e3
            print(
                f"| {n} | {name} | {'paired' if pr else 'one op per tick'} | {ticks[(name, pr)]} "
                f"| {np.median(wall):.1f} ({wall.min():.1f}-{wall.max():.1f}) "
                f"| {np.median(cpu):.1f} ({cpu.min():.1f}-{cpu.max():.1f}) | {pred * 1e3:.1f} | {one * 1e3:.1f} "
                f"| {np.median(cpu) / (one * 1e3):.2f} |",
                flush=True,
            )


def _profile_cost(cfg, layout, path=None):
    """The shipped CPU profile of ``cfg``'s shape on ``layout`` (None if there is none)."""
    path = path or shipped_profile(cfg)
    return CostModel(ModelShape.from_config(cfg), layout, CostCoefficients.load(path)) if path else None
