"""A step in parts (docs/design/bucket-parts.md): several plans, each padded to its own bucket and
run with its own tables, one after the other in one program from the same gradient accumulators,
give the gradients of the mean loss over all of their documents (the single-device reference)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import relative_memory_compile, require_devices, values_compile
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_helpers import (
    PLAN_A,
    PLAN_C,
    assert_tree_close,
    pipeline_mesh,
    pipelines,
    reference,
    tiny_config,
    tiny_params,
)

from jvarlen.layout import Layout
from jvarlen.parallel import pipeline as pl
from jvarlen.plan import schedule as sch


def _part(layout: Layout, num_layers: int, bucket: int, plan, seed: int, recompute: int):
    pipes = pipelines(layout.dp, bucket=bucket, plans=(plan,), seed=seed)
    scheds = [sch.token_level_1f1b(pk.chunk_prev, layout.pp) for _, pk in pipes]
    ls = num_layers // layout.pp
    ckpts = [np.full((pk.n_chunks, layout.pp), min(recompute, ls), np.int32) for _, pk in pipes]
    sig, batch = pl.prepare_batch([pk for _, pk in pipes], scheds, ckpts, layout, num_layers)
    return pipes, sig, batch


@pytest.mark.parametrize(
    "layout,stage_weights",
    [
        pytest.param(Layout(dp=2, pp=1, sp=2), "replicated", marks=pytest.mark.slow),  # dp: in the slow suite
        (Layout(dp=1, pp=1, sp=2), "sharded"),
        (Layout(dp=1, pp=2, sp=2), "replicated"),
    ],
    ids=str,
)
def test_parts_of_a_step_give_the_gradients_of_all_their_documents(layout, stage_weights):
    require_devices(layout.num_devices)
    cfg = tiny_config(num_layers=4)
    graphdef, params = tiny_params(cfg)
    # short documents in a small bucket storing every layer, then split ones in a larger bucket
    # recomputing one layer: two signatures of different shapes
    first = _part(layout, cfg.num_layers, 32, PLAN_C, seed=300, recompute=0)
    second = _part(layout, cfg.num_layers, 64, PLAN_A, seed=400, recompute=1)
    sigs = (first[1], second[1])
    assert sigs[0].bucket != sigs[1].bucket
    mesh = pipeline_mesh(layout)
    sharding = NamedSharding(mesh, P("dp"))
    grads = pl.make_pipeline_grads(graphdef, cfg, sigs, mesh, stage_weights=stage_weights)
    shapes = tuple(
        {k: jax.ShapeDtypeStruct(v, np.int32, sharding=sharding) for k, v in s.input_shapes().items()} for s in sigs
    )
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    compiled = jax.jit(grads).lower(abstract, shapes).compile(values_compile())
    batches = tuple({k: jax.device_put(np.asarray(v), sharding) for k, v in b.items()} for _, _, b in (first, second))
    sums, got, forwards = compiled(params, batches)

    documents = [d for pipes, _, _ in (first, second) for docs, _ in pipes for d in docs]
    ref_sums, ref_grads = reference(graphdef, params, documents)
    np.testing.assert_allclose(sums["target_tokens"], ref_sums["target_tokens"])
    np.testing.assert_allclose(sums["loss_sum"], ref_sums["loss_sum"], rtol=1e-5)
    assert_tree_close(got, ref_grads)
    # every part's layers ran: forwards of both parts' chunks (+ the second part's recomputation,
    # where its chunks are not fused on the last stage)
    ls = cfg.num_layers // layout.pp
    chunks = sum(pk.n_chunks for pipes, _, _ in (first, second) for _, pk in pipes[:1])
    assert np.asarray(forwards).min() >= chunks * ls


def test_parts_need_one_layout_and_as_many_batches():
    require_devices(4)
    cfg = tiny_config(num_layers=4)
    graphdef, _ = tiny_params(cfg)
    a = _part(Layout(dp=1, pp=1, sp=2), cfg.num_layers, 32, PLAN_C, seed=1, recompute=0)[1]
    b = _part(Layout(dp=2, pp=1, sp=2), cfg.num_layers, 32, PLAN_C, seed=1, recompute=0)[1]
    with pytest.raises(ValueError, match="one layout"):
        pl.make_pipeline_grads(graphdef, cfg, (a, b), pipeline_mesh(a.layout))
    grads = pl.make_pipeline_grads(graphdef, cfg, (a, a), pipeline_mesh(a.layout))
    with pytest.raises(ValueError, match="1 batches for a step of 2 parts"):
        grads(tiny_params(cfg)[1], [{}])


def test_a_step_in_parts_holds_one_parts_buffers_at_a_time():
    """The executor's memory account of a plan in parts is its largest part's
    (``executor_memory``): XLA reuses the first part's buffers for the second, so the compiled
    step's temporaries are the larger part's (a 32-token part of short documents and a 64-token
    one with split documents and their context pool), not their sum."""
    layout = Layout(dp=1, pp=1, sp=2)
    require_devices(layout.num_devices)
    cfg = tiny_config(num_layers=4)
    graphdef, params = tiny_params(cfg)
    sigs = (
        _part(layout, cfg.num_layers, 32, PLAN_C, seed=1, recompute=0)[1],
        _part(layout, cfg.num_layers, 64, PLAN_A, seed=2, recompute=0)[1],
    )
    mesh = pipeline_mesh(layout)
    sharding = NamedSharding(mesh, P("dp"))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)

    def temp(sig):
        parts = sig if isinstance(sig, tuple) else (sig,)
        shapes = tuple(
            {k: jax.ShapeDtypeStruct(v, np.int32, sharding=sharding) for k, v in s.input_shapes().items()}
            for s in parts
        )
        grads = pl.make_pipeline_grads(graphdef, cfg, sig, mesh)
        compiled = (
            jax.jit(grads)
            .lower(abstract, shapes if isinstance(sig, tuple) else shapes[0])
            .compile(relative_memory_compile())
        )
        return compiled.memory_analysis().temp_size_in_bytes

    alone = [temp(s) for s in sigs]
    both = temp(sigs)
    assert min(alone) > 0.01 * max(alone)  # both parts hold real buffers
    assert max(alone) <= both <= 1.01 * max(alone) < sum(alone)
