"""Bytes one device of a heterogeneous strategy's group holds in the group's compiled step, with
its stage weights replicated and sharded over its devices (``parallel.stage_weights``), read off
the compiled programs (XLA's memory analysis; nothing is allocated, the train state is abstract).

    python scripts/group_step_memory.py [--config configs/llama-7b.yaml] [--devices 16] [--target h100] \\
        [--schemes 4x4 2x8 1x16] [--documents 4] [--length 4096]

For each scheme ``PPxSP`` one group on the first ``pp·sp`` devices runs ``--documents`` documents of
``--length`` tokens, one micro-batch each (1F1B for ``pp > 1``, every layer recomputed, so that
both stage-weight modes run the same plan); the step's arguments and outputs less its batch are
what it is handed and returns (its stage's layers in the compute dtype, their fp32 gradient rows,
the embedding and head and their rows), the peak adds its temporaries (activations, the executor's
buffers). Beside it, the planner's peak for the same plan under that mode's memory account
(``peak_memory_bytes``, its largest stage), which also holds the canonical state's share (fp32
master weights and Adam moments over all devices) and the profile's workspace (a constant for
what no program shows: allocator slack, cuBLAS and NCCL buffers), so it is shown less that
workspace, against the compiled peak plus the canonical state. Compiled for
the host's CPU devices (fake ones, set here), or with ``--target`` for abstract GPUs of one host
(deviceless CUDA compilation: the ``gpu-aot`` extra, jvarlen.gpu_aot).
"""

from __future__ import annotations

import argparse
import os

from abstract_target import GB, ROOT, add_arguments, compiling_for, context, peak

MODES = ("replicated", "sharded")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    ap.add_argument("--schemes", nargs="+", default=["4x4", "2x8", "1x16"], help="PPxSP of the group")
    ap.add_argument("--documents", type=int, default=4)
    ap.add_argument("--length", type=int, default=4096)
    args = ap.parse_args(argv)
    config, ctx = context(args)
    with compiling_for(args):  # the attention a GPU runs (Pallas kernels), not the CPU's XLA path
        import numpy as np

        from jvarlen.api import as_pieces
        from jvarlen.layout import Layout
        from jvarlen.plan.api import make_cost
        from jvarlen.plan.cost import ModelShape
        from jvarlen.plan.strategy import GroupPlan, Scheme, SchemeCosts, StrategyPlan, build_group_plan
        from jvarlen.runtime.feed import Iteration
        from jvarlen.runtime.strategies.groups import GroupsStrategy

        hardware = args.target or "h100"
        base = make_cost(ModelShape.from_config(config.model), hardware, Layout(args.devices, 1, 1))
        costs = {mode: SchemeCosts(base.with_stage_weights(mode == "sharded"), args.devices) for mode in MODES}
        rng = np.random.default_rng(0)
        lengths = [args.length] * args.documents
        docs = [rng.integers(1, config.model.vocab_size, size=n).astype(np.int32) for n in lengths]
        pieces = as_pieces(docs, config.model.vocab_size)
        print(
            f"{os.path.relpath(args.config, ROOT)}, {args.devices} {args.target or 'cpu'} devices, compute "
            f"{args.compute_dtype}: one group, {args.documents} documents of {args.length} tokens"
        )
        print(
            "| group | stage weights | handed + returned per device (GB) | step peak per device (GB) | sharded / replicated "
            "| step peak + canonical state (GB) | planner's peak less workspace (GB) | the two, ratio |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for text in args.schemes:
            pp, sp = (int(x) for x in text.lower().split("x"))
            scheme = Scheme(pp, sp)
            held = {}
            for mode in MODES:
                micro, ckpt = [[i] for i in range(len(lengths))], [config.model.num_layers // pp] * len(lengths)
                plan = build_group_plan("bench", scheme, lengths, micro, costs[mode], ckpt=ckpt)
                group = GroupPlan(scheme, tuple(range(pp * sp)), tuple(range(len(lengths))), plan)
                strategy_plan = StrategyPlan("bench", args.devices, tuple(lengths), (group,))
                # the vocabulary split within a node, as the account assumes
                nodes = costs[mode].coeffs.gpus_per_node
                strategy = GroupsStrategy(ctx, None, "", ahead=0, stage_weights=mode, vocab_max_sp=nodes)
                it = Iteration(0, pieces, np.zeros(len(pieces), np.int64), {}, groups=[pieces], plans=[strategy_plan])
                prepared = strategy.prepare(it)
                compiled, _, _ = strategy._compile_group(prepared.key[1][0])
                m = compiled.memory_analysis()
                batch = sum(np.asarray(v).nbytes for k, v in prepared.arrays.items() if k.startswith("0/")) / (pp * sp)
                handed = m.argument_size_in_bytes + m.output_size_in_bytes - batch
                step_peak = peak(m)
                held[mode] = (handed, step_peak)
                ratio = (
                    ""
                    if mode == "replicated"
                    else f"{handed / held['replicated'][0]:.2f}× / {step_peak / held['replicated'][1]:.2f}×"
                )
                resident = step_peak + strategy.exchange.state_bytes_per_device()
                planned = max(plan.stats["peak_memory_bytes"]) - costs[mode].coeffs.workspace_bytes
                print(
                    f"| (pp={pp}, sp={sp}) | {mode} | {handed / GB:.2f} | {step_peak / GB:.2f} | {ratio} | {resident / GB:.2f} "
                    f"| {planned / GB:.2f} | {resident / planned:.2f} |",
                    flush=True,
                )
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
