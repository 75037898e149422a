"""Bytes a decoder layer keeps for its backward in the data-parallel step, per residual policy,
compiled for abstract GPUs (deviceless CUDA compilation: the ``gpu-aot`` extra), against the
planner's cost model (docs/design/residuals.md).

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python scripts/residual_memory.py [--config configs/llama-7b.yaml] \\
        [--target h100] [--devices 8] [--policy dots_and_attention --policy all] \\
        [--layers 2 4] [--tokens 16384 32768]

Compiles the step without remat (``model.remat=false``) at every (layers, tokens per device) pair,
one row per device, and prints XLA's temporaries, the bytes per token and layer (the mixed
difference of the first and last layer and token counts: what the layers add per token, without
the head, the weights or the working memory) and the step's peak against the cost model's, whose
layers charge what the policy keeps (``m_stored_token`` from ``stage.stored_token_bytes``), as the
runtime's cost model does.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "llama-7b.yaml"))
    ap.add_argument("--target", default="h100")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--policy", action="append", help="repeatable; default dots_and_attention and all")
    ap.add_argument("--layers", type=int, nargs=2, default=[2, 4])
    ap.add_argument("--tokens", type=int, nargs=2, default=[16384, 32768])
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from gpu_compile_check import cost_model_memory

    from jvarlen import gpu_aot, kernels
    from jvarlen.config import load_config

    target = gpu_aot.gpu_target(args.target)
    devices = gpu_aot.abstract_devices(args.target, args.devices)
    print("| residuals | layers | tokens per device | temp GiB | peak GiB | cost model peak GiB | error |")
    print("|---|---|---|---|---|---|---|")
    for policy in args.policy or ["dots_and_attention", "all"]:
        temp = {}
        for layers in args.layers:
            for tokens in args.tokens:
                overrides = {
                    "parallel.pp": "1",
                    "model.remat": "false",
                    "model.num_layers": str(layers),
                    "data.seq_len": str(tokens),
                    "data.tokens_per_batch": str(args.devices * tokens),
                    "parallel.residual_policy": policy,
                }
                config = load_config(args.config, **overrides)
                with kernels.compile_for(target):
                    m = gpu_aot.lower_train_step(config, devices).compile().memory_analysis()
                peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
                pred = cost_model_memory(config, args.devices, args.target)["peak"]
                temp[layers, tokens] = m.temp_size_in_bytes
                print(
                    f"| {policy} | {layers} | {tokens} | {m.temp_size_in_bytes / GiB:.2f} | {peak / GiB:.2f} | "
                    f"{pred / GiB:.2f} | {(pred - peak) / peak:+.1%} |",
                    flush=True,
                )
        (l0, l1), (t0, t1) = args.layers, args.tokens
        mixed = (temp[l1, t1] - temp[l1, t0]) - (temp[l0, t1] - temp[l0, t0])
        print(f"\n{policy}: {mixed / (l1 - l0) / (t1 - t0):,.0f} B per token and layer\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
