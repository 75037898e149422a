"""Step time per layout for one fixed batch, and what a layout switch costs.

    python scripts/bench_layouts.py [--devices 8] [--rows 8] [--seq-len 512] [--steps 5]

On CPU it fakes ``--devices`` host devices (set before JAX starts). For every valid
(dp, sp) layout it reports the compile time of the step, the median step time, and the
time of the pull alone (canonical FSDP params -> the layout's whole weights: the only
resharding a layout needs, done inside every step). The switch rows run two compiled
layouts in a random order and compare, per layout, steps that follow the other layout
with steps that follow the same one (the state never moves; this is what is left).
Prints a Markdown table (for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices (ignored on GPU)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--attention", default="auto", help="auto | xla | pallas | reference")
    p.add_argument("--steps", type=int, default=5, help="timed steps per layout (after one warm-up)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
        ).strip()
    import jax
    import numpy as np

    from jvarlen.api import Session
    from jvarlen.config import Config, ModelConfig, TrainConfig
    from jvarlen.model.transformer import resolve_compute_dtype
    from jvarlen.parallel.sharding import place_global, pull
    from jvarlen.runtime.state import create_train_state
    from jvarlen.runtime.strategies.layouts import LayoutPolicy

    config = Config(
        model=ModelConfig(
            vocab_size=320,
            d_model=args.d_model,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            mlp_dim=3 * args.d_model,
            attention=args.attention,
        ),
        train=TrainConfig(steps=1000),
    )
    graphdef, optimizer, state = create_train_state(config)
    session = Session(graphdef, config.model, optimizer, state)
    placement = session.placement
    n = len(placement.devices)
    layouts = LayoutPolicy(num_devices=n, num_heads=args.heads).candidates(args.seq_len)
    layouts = [lay for lay in layouts if args.rows % lay.dp == 0]

    rng = np.random.default_rng(0)
    rows, t = args.rows, args.seq_len
    tokens = rng.integers(0, 256, (rows, t)).astype(np.int32)
    seg = np.zeros((rows, t), np.int32)
    pos = np.zeros((rows, t), np.int32)
    for r in range(rows):  # documents of 16..t/2 tokens, a little padding at the end
        i, s = 0, 1
        while i < t - 8:
            length = min(int(rng.integers(16, t // 2)), t - 8 - i)
            seg[r, i : i + length], pos[r, i : i + length] = s, np.arange(length)
            i, s = i + length, s + 1
    batch = dict(
        tokens=tokens,
        segment_ids=seg,
        positions=pos,
        targets=np.roll(tokens, -1, 1),
        loss_mask=(seg > 0).astype(np.float32),
    )

    dtype = resolve_compute_dtype(config.model.compute_dtype)
    state = session.state
    steps, batches, results = {}, {}, []

    def run(layout, s):
        s, m = steps[layout](s, batches[layout])
        jax.block_until_ready(m)
        return s

    for layout in layouts:
        mesh = placement.mesh(layout)
        t0 = time.perf_counter()
        layout_step = session.layout_step(layout, rows, t)
        compiled = layout_step.compiled(layout_step.from_arrays(batch))
        compile_s = time.perf_counter() - t0
        batches[layout] = place_global(batch, compiled.batch_shardings)  # placed once: time the step only
        steps[layout] = compiled.compiled
        state = run(layout, state)  # warm-up
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state = run(layout, state)
            times.append(time.perf_counter() - t0)
        pulled = jax.jit(lambda p, mesh=mesh: pull(p, mesh, dtype))
        jax.block_until_ready(pulled(state.params))
        pull_times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            jax.block_until_ready(pulled(state.params))
            pull_times.append(time.perf_counter() - t0)
        results.append((layout, compile_s, statistics.median(times), statistics.median(pull_times)))

    def switch_cost(a, b, k):
        """Random a/b sequence; per layout, median step time after a switch vs after the same layout.

        Interleaving both kinds of step in one window keeps load drift out of the comparison.
        """
        nonlocal state
        order = np.random.default_rng(1).integers(0, 2, 8 * k)
        times = {(lay, sw): [] for lay in (a, b) for sw in (False, True)}
        prev = None
        for i in order:
            layout = (a, b)[i]
            t0 = time.perf_counter()
            state = run(layout, state)
            if prev is not None:
                times[(layout, prev != layout)].append(time.perf_counter() - t0)
            prev = layout
        rel = [statistics.median(times[(lay, True)]) / statistics.median(times[(lay, False)]) - 1 for lay in (a, b)]
        same = [statistics.median(times[(lay, False)]) for lay in (a, b)]
        switched = [statistics.median(times[(lay, True)]) for lay in (a, b)]
        return switched, same, rel

    switch = []
    for a, b in [(layouts[0], layouts[-1]), (layouts[0], layouts[len(layouts) // 2])]:
        switch.append((a, b, *switch_cost(a, b, args.steps)))

    backend = f"{jax.default_backend()} ({jax.devices()[0].device_kind}) x {n}"
    print(
        f"\nbackend {backend}; batch [{rows}, {t}] = {rows * t} tokens; model d={args.d_model} "
        f"L={args.layers} H={args.heads} Hkv={args.kv_heads}; attention={args.attention}; jax {jax.__version__}\n"
    )
    print("| layout | compile s | step ms (median) | tokens/s | pull ms | pull / step |")
    print("|---|---|---|---|---|---|")
    for layout, compile_s, step_s, pull_s in results:
        print(
            f"| dp={layout.dp} sp={layout.sp} | {compile_s:.1f} | {step_s * 1e3:.1f} | {rows * t / step_s:.0f} | "
            f"{pull_s * 1e3:.2f} | {pull_s / step_s:.1%} |"
        )
    print(
        "\n| switch a <-> b | step ms after a switch (a / b) | after the same layout (a / b) | switch overhead (a / b) |"
    )
    print("|---|---|---|---|")
    for a, b, switched, same, rel in switch:
        print(
            f"| (dp={a.dp},sp={a.sp}) <-> (dp={b.dp},sp={b.sp}) | {switched[0] * 1e3:.0f} / {switched[1] * 1e3:.0f} | "
            f"{same[0] * 1e3:.0f} / {same[1] * 1e3:.0f} | {rel[0]:+.1%} / {rel[1]:+.1%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
