"""Temporaries of the profiler harness's layer slice against how many of its layers are recomputed.

The harness (``jvarlen.profile.harness.ChunkHarness.layers_program``) recomputes the first ``l`` of
its layers by running them in a second ``lax.scan``; the runtime never does that (the pipeline
executor keeps or rebuilds each layer's residuals itself, ``jvarlen.parallel.pipeline.stage``; the
fused step recomputes all layers or none). This prints ``memory_analysis().temp_size_in_bytes`` of
the harness's forward+backward for l = 0..L, on CPU or compiled for an abstract GPU (deviceless;
the ``gpu-aot`` extra), to show what the cost-memory validation's partial rows measure.

Usage: ``python scripts/harness_remat_memory.py [--target h100] [--tokens 4096] [--d_model 2048]``
(~1 min on CPU; --target needs ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``, set here).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="an abstract GPU (h100, a100) instead of this CPU")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d_model", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)

    import jax
    from jax.sharding import SingleDeviceSharding

    from jvarlen.config import ModelConfig
    from jvarlen.plan.chunk import ChunkShape
    from jvarlen.profile.harness import ChunkHarness

    d = args.d_model
    cfg = ModelConfig(
        vocab_size=32000,
        d_model=d,
        num_layers=args.layers,
        num_heads=d // 128,
        num_kv_heads=d // 128,
        mlp_dim=int(d * 2.75),
        compute_dtype="bfloat16",
        attention="pallas" if args.target else "xla",
    )
    harness = ChunkHarness(cfg, token_buckets=(args.tokens,), context_buckets=(0,))
    params, batch = harness.params, harness.layer_inputs(ChunkShape(0, (args.tokens,)))
    where = contextlib.nullcontext()
    if args.target:
        from jvarlen import gpu_aot, kernels

        device = SingleDeviceSharding(gpu_aot.abstract_devices(args.target, 1)[0])
        params, batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), (params, batch))
        where = kernels.compile_for(gpu_aot.gpu_target(args.target))
    print(f"{args.target or 'cpu'}: {args.layers} layers, d {d}, {args.tokens} tokens, bf16")
    with where:
        for remat in range(args.layers + 1):
            program = harness.layers_program(args.layers, "fwdbwd", remat)
            temp = program.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
            print(f"  {remat} recomputed: temp {temp / 1e6:8.1f} MB", flush=True)


if __name__ == "__main__":
    main()
