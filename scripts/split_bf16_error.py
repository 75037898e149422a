"""How far a split document's bf16 gradients are from fp32 on the pipeline executor, against the
single-device bf16 step on the same documents.

The executor adds each later slice's context dK/dV into a pool in the compute dtype (bf16 here),
a rounding per slice that the unsplit step does not have. This measures whether that shows: one
document cut into ``--slices`` slices of 16 tokens (plus a short document packed into the tail)
on pp = 2, every layer's gradient compared with the fp32 reference in root-mean-square, beside the
bf16 reference's own error. Ratios near 1 mean the split adds nothing visible to bf16's error.

    python scripts/split_bf16_error.py --slices 8 32
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import pathlib  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from pipeline_helpers import pipeline_mesh, reference, tiny_config, tiny_params  # noqa: E402

from jvarlen.layout import Layout  # noqa: E402
from jvarlen.parallel import pipeline as pl  # noqa: E402
from jvarlen.plan import schedule as sch  # noqa: E402

SLICE = 16


def measure(slices: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 64, size=slices * SLICE).astype(np.int32), rng.integers(1, 64, size=9).astype(np.int32)]
    chunks = [[(0, i * SLICE, SLICE)] for i in range(slices - 1)] + [[(0, (slices - 1) * SLICE, SLICE), (1, 0, 9)]]
    layout = Layout(pp=2)
    cfg = dataclasses.replace(tiny_config(), compute_dtype="bfloat16")  # the pipeline tests' model
    graphdef, params = tiny_params(cfg)
    graphdef32, _ = tiny_params(tiny_config())
    packed = pl.pack_chunks(chunks, docs, 32)
    schedule = sch.token_level_1f1b(packed.chunk_prev, layout.pp)
    ckpt = np.zeros((packed.n_chunks, layout.pp), np.int32)
    sig, batch = pl.prepare_batch([packed], [schedule], [ckpt], layout, cfg.num_layers)
    mesh = pipeline_mesh(layout)
    sharding = NamedSharding(mesh, P("dp"))
    grads_fn = jax.jit(pl.make_pipeline_grads(graphdef, cfg, sig, mesh))
    _, got, _ = grads_fn(params, {k: jax.device_put(np.asarray(v), sharding) for k, v in batch.items()})
    bf16, fp32 = reference(graphdef, params, docs)[1], reference(graphdef32, params, docs)[1]

    def rms(a, b):
        return float(np.sqrt(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))

    return {
        jax.tree_util.keystr(path): (rms(g, r32), rms(r, r32))
        for (path, g), r, r32 in zip(
            jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(bf16), jax.tree.leaves(fp32)
        )
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slices", type=int, nargs="+", default=[8, 32])
    args = parser.parse_args()
    for slices in args.slices:
        print(f"{slices} slices of {SLICE} tokens: pipeline error / bf16 reference error (RMS against fp32)")
        for leaf, (pipe, ref) in measure(slices).items():
            print(f"  {leaf:44s} {pipe / max(ref, 1e-30):.3f}  ({pipe:.2e} / {ref:.2e})")


if __name__ == "__main__":
    main()
