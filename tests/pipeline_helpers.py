"""Shared fixtures of the pipeline tests: a tiny model, plans mixing all chunk kinds, the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jvarlen.config import ModelConfig
from jvarlen.layout import Layout
from jvarlen.model import build_model
from jvarlen.parallel.layouts import layout_mesh
from jvarlen.parallel.pipeline import PipelineSignature, make_pipeline_grads, pack_chunks, prepare_batch
from jvarlen.plan import schedule
from jvarlen.runtime.state import split_model
from jvarlen.runtime.step import loss_and_grads

BUCKET = 32
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # halves CPU compile time; numerics unchanged in kind


def tiny_config(num_layers: int = 4, attention: str = "reference") -> ModelConfig:
    return ModelConfig(
        vocab_size=64,
        d_model=32,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=64,
        compute_dtype="float32",
        attention=attention,
    )


def tiny_params(cfg: ModelConfig, seed: int = 0):
    return split_model(build_model(cfg, seed=seed))


# Plan A: a batched chunk, document 2 split into 4 slices (3 split chunks + a hybrid tail
# packed with two short documents), a batched chunk. Plan B: two documents split in 2.
PLAN_A = (
    (10, 7, 60, 5, 9, 14),
    [
        [(0, 0, 10), (1, 0, 7)],
        [(2, 0, 16)],
        [(2, 16, 16)],
        [(2, 32, 16)],
        [(2, 48, 12), (3, 0, 5), (4, 0, 9)],
        [(5, 0, 14)],
    ],
)
PLAN_B = (
    (40, 6, 50, 3, 8, 11, 21),
    [
        [(0, 0, 24)],
        [(0, 24, 16), (1, 0, 6)],
        [(2, 0, 30)],
        [(2, 30, 20), (3, 0, 3), (4, 0, 8)],
        [(5, 0, 11)],
        [(6, 0, 21)],
    ],
)

PLAN_C = (  # batched chunks only
    (12, 9, 20, 31, 4, 17, 8, 25, 6, 13),
    [
        [(0, 0, 12), (1, 0, 9)],
        [(2, 0, 20)],
        [(3, 0, 31)],
        [(4, 0, 4), (5, 0, 17), (6, 0, 8)],
        [(7, 0, 25), (8, 0, 6)],
        [(9, 0, 13)],
    ],
)


def plan_documents(plan, seed: int, vocab: int = 64):
    """(documents, chunks) of a plan template with fresh random tokens."""
    lengths, chunks = plan
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=n).astype(np.int32) for n in lengths], chunks


def pipelines(dp: int, bucket: int = BUCKET, plans=(PLAN_A, PLAN_B), seed: int = 100):
    """Per pipeline: (documents, PackedChunks); the plan templates alternate."""
    out = []
    for i in range(dp):
        docs, chunks = plan_documents(plans[i % len(plans)], seed=seed + i)
        out.append((docs, pack_chunks(chunks, docs, bucket)))
    return out


def token_1f1b_batch(cfg, layout, recompute: int):
    """(pipelines, signature, batch) of plans A/B under token-level 1F1B (split documents, context
    K/V, fused last-stage ops), ``recompute`` layers per stage and chunk."""
    pipes = pipelines(layout.dp, plans=(PLAN_A, PLAN_B))
    packs = [pk for _, pk in pipes]
    scheds = [schedule.token_level_1f1b(pk.chunk_prev, layout.pp) for pk in packs]
    ckpts = [np.full((pk.n_chunks, layout.pp), recompute, np.int32) for pk in packs]
    sig, batch = prepare_batch(packs, scheds, ckpts, layout, cfg.num_layers)
    return pipes, sig, batch


def reference(graphdef, params, documents):
    """Single-device (sums, grads of the mean loss) with one document per row."""
    return single_device_grads(graphdef, params, reference_batch(documents))


def single_device_grads(graphdef, params, batch: dict):
    """Single-device (sums, grads of the mean loss) of a packed ``batch``, compiled for values only
    (``conftest.values_compile``)."""
    from conftest import values_compile

    return jax.jit(lambda p, b: loss_and_grads(graphdef, p, b), compiler_options=values_compile())(params, batch)


def reference_batch(documents) -> dict:
    """One document per row, like ``jvarlen.runtime.step``'s packed batches."""
    width = max(len(d) for d in documents)
    batch = {
        k: np.zeros((len(documents), width), np.int32)
        for k in ("tokens", "segment_ids", "positions", "targets", "loss_mask")
    }
    for i, doc in enumerate(documents):
        n = len(doc)
        batch["tokens"][i, :n] = doc
        batch["segment_ids"][i, :n] = 1
        batch["positions"][i, :n] = np.arange(n)
        batch["targets"][i, : n - 1] = doc[1:]
        batch["loss_mask"][i, : n - 1] = 1
    return batch


def assert_tree_close(actual, expected, rtol: float = 1e-5):
    """Elementwise rtol, with an absolute floor of rtol × the tensor's largest magnitude."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        a, b = np.asarray(a), np.asarray(b)
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale, err_msg=jax.tree_util.keystr(path))


def zeros_like_tree(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def pipeline_mesh(layout: Layout):
    """The layout's ``(dp, pp, sp)`` mesh over the first ``layout.num_devices`` devices."""
    return layout_mesh(layout, jax.devices()[: layout.num_devices])


class PipelineGrads:
    """``grads(params, batch) -> (sums, grads, layer_forwards)`` of one signature, compiled once ahead of
    time (every schedule and recomputation table of that signature runs on this one executable)."""

    def __init__(
        self,
        graphdef,
        cfg,
        sig: PipelineSignature,
        params,
        *,
        residual_policy=None,
        stage_weights="replicated",
        compiler_options=None,
        per_layer_grads=None,
    ):
        mesh = pipeline_mesh(sig.layout)
        self.sharding = NamedSharding(mesh, P("dp"))
        grads = make_pipeline_grads(
            graphdef,
            cfg,
            sig,
            mesh,
            residual_policy=residual_policy,
            stage_weights=stage_weights,
            per_layer_grads=per_layer_grads,
        )
        fn = jax.jit(grads)
        shapes = {k: jax.ShapeDtypeStruct(v, np.int32, sharding=self.sharding) for k, v in sig.input_shapes().items()}
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        self.compiled = fn.lower(abstract, shapes).compile(compiler_options)

    def __call__(self, params, batch):
        return self.compiled(params, {k: jax.device_put(np.asarray(v), self.sharding) for k, v in batch.items()})
