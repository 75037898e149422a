"""Bytes one device holds for the heterogeneous groups' pull and push, read off the compiled
programs (XLA's memory analysis; nothing is allocated, the train state is abstract).

    python scripts/group_sync_bytes.py [--config configs/llama-7b.yaml] [--devices 16] [--target h100] \
        [--parts 1 2 4]

For each stage size ``K`` (the iteration's largest stage: ``L / pp`` for the shallowest pipeline
of its groups) prints the pull's output per device (the stage's layers in the compute dtype, the
embedding and head) and the update's input per device (every device's fp32 gradient rows), beside
what a pull of every parameter onto every device (fp32) and full-size gradient rows would hold,
the groups' exchange before it moved stages. ``--parts``: with ``parallel.stage_weights=sharded``
the exchange's buffers hold ``1/parts`` of each weight axis (``parts``: the smallest sp of the
iteration's groups; 1 is the replicated exchange). Compiled for the host's CPU devices (fake ones:
``XLA_FLAGS=--xla_force_host_platform_device_count``, set here), or with ``--target`` for that many
abstract GPUs of one host (deviceless CUDA compilation: the ``gpu-aot`` extra, jvarlen.gpu_aot), which
also shows that the programs compile for it.
"""

from __future__ import annotations

import argparse
import os

from abstract_target import GB, ROOT, add_arguments, context, peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    ap.add_argument("--parts", type=int, nargs="+", default=[1], help="chunks of a sharded exchange (1: whole)")
    args = ap.parse_args(argv)
    config, ctx = context(args)
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jvarlen.runtime.strategies.groups import GroupsStrategy

    sharded = "sharded" if args.parts != [1] else "replicated"
    strategy = GroupsStrategy(ctx, None, "", ahead=0, stage_weights=sharded)
    params = ctx.abstract_state.params
    total = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    everything = jax.jit(
        lambda p: p,
        in_shardings=(ctx.placement.state_sharding.params,),
        out_shardings=jax.tree.map(lambda _: NamedSharding(ctx.placement.state_mesh, P()), params),
    )
    before = everything.lower(params).compile().memory_analysis().output_size_in_bytes
    layers = config.model.num_layers
    print(
        f"{os.path.relpath(args.config, ROOT)}: {total / 4 / 1e9:.2f} B parameters, {args.devices} "
        f"{args.target or 'cpu'} devices, compute {args.compute_dtype}; "
        f"every parameter onto every device (fp32): {before / GB:.2f} GB pulled, {total / GB:.2f} GB of rows"
    )
    print(
        "| largest stage K (layers) | parts | pull per device (GB) | update's rows per device (GB) "
        "| both vs every parameter | pull program peak (GB) | update program peak (GB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for pp in (1, 2, 4, 8):
        if layers % pp:
            continue
        rows = layers // pp
        for parts in args.parts:
            pull = strategy.exchange.compile_pull(("pull", rows, parts, sharded == "sharded")).memory_analysis()
            pulled = pull.output_size_in_bytes
            update = strategy.exchange.compile_update(("update", rows, parts, sharded == "sharded")).memory_analysis()
            pushed = update.argument_size_in_bytes - sum(
                a.size * a.dtype.itemsize // args.devices for a in jax.tree.leaves(ctx.abstract_state)
            )
            print(
                f"| {rows} (pp = {pp}) | {parts} | {pulled / GB:.2f} | {pushed / GB:.2f} "
                f"| {(pulled + pushed) / (before + total):.2f}× | {peak(pull) / GB:.2f} | {peak(update) / GB:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
