"""Bytes the head's forward and backward hold, compiled for abstract GPUs (deviceless CUDA
compilation: the ``gpu-aot`` extra), against the planner profile's ``m_head_token``: the whole head
(the fused data-parallel step's and an unsplit pipeline stage's: ``Transformer.loss_sums``, i.e.
``jvarlen.model.head.head_loss_sum`` under ``jax.grad``), the head split by vocabulary over sp
(``rest.VocabShard.head_loss``, per token of the device's ``T/sp``), and, for comparison, the
untiled head jvarlen had before (``Transformer.logits``' fp32 einsum, ``cross_entropy_sums``,
``jax.grad``).

    python scripts/head_memory.py [--target h100] [--vocab 32000] [--d_model 4096] [--sp 2] \\
        [--tokens 4096 8192 16384 65536]

Prints one line per head and token count: XLA's temporaries, their bytes per token per vocabulary
entry, and per row of the largest tile of logits (``jvarlen.head_tiles``): the planner charges
``m_head_token / V`` bytes per logit of one tile (``CostModel.head_memory``).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="h100")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--d_model", type=int, default=4096)
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 65536])
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    sys.path.insert(0, ROOT)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jvarlen import gpu_aot, head_tiles
    from jvarlen.layout import Layout
    from jvarlen.model import cross_entropy_sums
    from jvarlen.model.head import head_loss_sum
    from jvarlen.parallel.layouts import SP
    from jvarlen.parallel.pipeline.rest import VocabShard
    from jvarlen.plan.chunk import ChunkShape
    from jvarlen.plan.cost import CostModel, ModelShape
    from jvarlen.plan.hardware import analytic_coefficients

    devices = gpu_aot.abstract_devices(args.target, args.sp)
    mesh = Mesh(np.array(devices), (SP,))
    whole, rows = NamedSharding(Mesh(np.array(devices[:1]), (SP,)), P()), NamedSharding(mesh, P(SP))
    v, d, bf16 = args.vocab, args.d_model, jnp.bfloat16
    shape = ModelShape(2, d, 32, 32, d // 32, 4 * d, v, tie_embeddings=False)
    coeffs = analytic_coefficients(shape, args.target)
    # the planner's charge: the fused step's head (one device, whole), a split pipeline's last stage
    charge = {
        "whole": CostModel(shape, Layout(1, 1, 1), coeffs),
        "split": CostModel(shape, Layout(1, 2, args.sp), coeffs),
    }

    def untiled_loss(x, w, targets, mask):  # the logits' fp32 einsum, then the loss, under jax.grad
        logits = jnp.einsum("btd,dv->btv", x, w, preferred_element_type=jnp.float32)
        return cross_entropy_sums(logits, targets, mask)["loss_sum"]

    def whole_loss(x, w, targets, mask):
        return head_loss_sum(x, w, targets, mask, None)

    def split_loss(h, w, targets, mask):
        loss, dw, dh = VocabShard(v, args.sp).head_loss(h, w, targets, mask, jnp.float32(1.0), 0, h.shape[0])
        return jax.lax.psum(loss, SP), dw, dh

    split = jax.shard_map(
        split_loss,
        mesh=mesh,
        in_specs=(P(SP), P(None, SP), P(), P()),
        out_specs=(P(), P(None, SP), P(SP)),
        check_vma=False,
    )
    sds = jax.ShapeDtypeStruct
    for t in args.tokens:
        whole_shapes = (sds((1, t, d), bf16, sharding=whole), sds((d, v), bf16, sharding=whole)) + tuple(
            sds((1, t), jnp.int32, sharding=whole) for _ in range(2)
        )
        heads = {
            "whole": (jax.grad(whole_loss, argnums=(0, 1)), whole_shapes, t, head_tiles.logits_tiles(t, v, d)),
            "untiled (before)": (jax.grad(untiled_loss, argnums=(0, 1)), whole_shapes, t, (1, t)),
            f"split over sp={args.sp}": (
                split,
                (sds((t, d), bf16, sharding=rows), sds((d, v), bf16, sharding=NamedSharding(mesh, P(None, SP))))
                + tuple(sds((t,), jnp.int32, sharding=NamedSharding(mesh, P())) for _ in range(2)),
                t // args.sp,
                head_tiles.logits_tiles(t, v // args.sp, d),
            ),
        }
        for name, (fn, shapes, per_device, (tiles, tile_rows)) in heads.items():
            with gpu_aot.lowering_device(devices[0]):
                temp = jax.jit(fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes
            columns = v // args.sp if name.startswith("split") else v
            model = charge["split" if name.startswith("split") else "whole"]
            planned = (
                ""
                if name.startswith("untiled")
                else f"; the planner charges {model.head_memory(ChunkShape(0, (t,), tail=True)) / 2**20:.1f} MiB"
            )
            print(
                f"{args.target} head {name}, {t} tokens: temporaries {temp / 2**20:.1f} MiB, "
                f"{temp / per_device / v:.2f} B per token per vocabulary entry; {tiles} tile(s) of {tile_rows} rows: "
                f"{temp / tile_rows / columns:.2f} B per logit of a tile{planned}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
