"""Wall time of one pipeline step of a fixed plan on fake CPU devices: a quick A/B of executor
changes (run it on two checkouts, alternated), not the issue's benchmark (scripts/bench_pipeline.py).

    python scripts/pipeline_step_time.py --vocab 32000 --layout 2,2,2 --steps 15

The plan: epp-cpu's model (d = 64, 4 layers, fp32, XLA attention) with the given vocabulary; per
pipeline one 1,800-token document in four 450-token slices and seven short ones packed into two
chunks, 640-token bucket, token-level 1F1B, nothing recomputed, ``dots_and_attention`` residuals.
Prints one JSON line: median, min and max seconds of ``--steps`` steps after a warm-up, and the loss.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jvarlen.config import ModelConfig  # noqa: E402
from jvarlen.layout import Layout  # noqa: E402
from jvarlen.model import build_model  # noqa: E402
from jvarlen.parallel import pipeline as pl  # noqa: E402
from jvarlen.parallel.layouts import layout_mesh  # noqa: E402
from jvarlen.plan import schedule as sch  # noqa: E402
from jvarlen.runtime.state import split_model  # noqa: E402

LENGTHS = (1800, 300, 200, 150, 120, 100, 90, 50)
CHUNKS = [[(0, 450 * i, 450)] for i in range(4)] + [
    [(1, 0, 300), (2, 0, 200)],
    [(3, 0, 150), (4, 0, 120), (5, 0, 100), (6, 0, 90), (7, 0, 50)],
]
BUCKET = 640


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--layout", default="2,2,2", help="dp,pp,sp")
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    dp, pp, sp = (int(x) for x in args.layout.split(","))
    layout = Layout(dp=dp, pp=pp, sp=sp)
    cfg = ModelConfig(
        vocab_size=args.vocab,
        d_model=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=192,
        compute_dtype="float32",
        attention="xla",
    )
    graphdef, params = split_model(build_model(cfg, seed=0))
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, args.vocab, size=n).astype(np.int32) for n in LENGTHS]
    packs = [pl.pack_chunks(CHUNKS, docs, BUCKET) for _ in range(dp)]
    scheds = [sch.token_level_1f1b(pk.chunk_prev, pp) for pk in packs]
    ckpts = [np.zeros((pk.n_chunks, pp), np.int32) for pk in packs]
    sig, batch = pl.prepare_batch(packs, scheds, ckpts, layout, cfg.num_layers)
    mesh = layout_mesh(layout, jax.devices()[: layout.num_devices])
    grads = jax.jit(pl.make_pipeline_grads(graphdef, cfg, sig, mesh, residual_policy="dots_and_attention"))
    sharding = NamedSharding(mesh, P("dp"))
    batch = {k: jax.device_put(np.asarray(v), sharding) for k, v in batch.items()}
    out = jax.block_until_ready(grads(params, batch))
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        jax.block_until_ready(grads(params, batch))
        times.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "vocab": args.vocab,
                "layout": args.layout,
                "median_s": float(np.median(times)),
                "min_s": min(times),
                "max_s": max(times),
                "loss_sum": float(out[0]["loss_sum"]),
            }
        )
    )


if __name__ == "__main__":
    main()
