"""The embedding table and head split by vocabulary over a stage's sp devices
(jvarlen/parallel/pipeline/rest.py): the gradients equal the single-device reference, tied and
untied, with the split and without it (a vocabulary sp does not divide); a device holds 1/sp of
them (the planner's account of it: tests/test_cost_model.py)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import relative_memory_compile, require_devices, tile_head_logits, values_compile
from pipeline_helpers import (
    PipelineGrads,
    assert_tree_close,
    pipeline_mesh,
    reference,
    tiny_config,
    tiny_params,
    token_1f1b_batch,
)

from jvarlen.layout import Layout
from jvarlen.parallel import pipeline as pl


def _config(vocab: int, tied: bool):
    return dataclasses.replace(tiny_config(num_layers=4), vocab_size=vocab, tie_embeddings=tied)


@pytest.mark.parametrize(
    "layout, vocab, tied, recompute, tile_logits",
    [
        (Layout(dp=1, pp=2, sp=2), 64, False, 0, None),  # split: 32 rows per device
        (Layout(dp=2, pp=1, sp=2), 64, True, 1, None),  # one stage: the embedding in the fused op
        (Layout(dp=1, pp=2, sp=4), 64, True, 2, None),  # split four ways, every layer recomputed
        # 2 does not divide 65: whole on every device (the default suite: in tiles below)
        pytest.param(Layout(dp=1, pp=2, sp=2), 65, False, 0, None, marks=pytest.mark.slow),
        (Layout(dp=1, pp=2, sp=2), 64, False, 0, 512),  # split: the head in 2 tiles of the 32 gathered tokens
        (Layout(dp=1, pp=2, sp=2), 65, False, 0, 512),  # whole: 3 tiles of 6 of a device's 16 tokens
    ],
    ids=str,
)
def test_the_split_vocabulary_matches_reference(layout, vocab, tied, recompute, tile_logits, monkeypatch):
    """``tile_logits``: the head's logits a tile of at most that many at a time (``jvarlen.head_tiles``)."""
    require_devices(layout.num_devices)
    if tile_logits:
        tile_head_logits(monkeypatch, tile_logits)
    assert layout.vocab_shards(vocab) == (layout.sp if vocab % layout.sp == 0 else 1)
    cfg = _config(vocab, tied)
    graphdef, params = tiny_params(cfg)
    pipes, sig, batch = token_1f1b_batch(cfg, layout, recompute)
    sums, grads, _ = PipelineGrads(graphdef, cfg, sig, params, compiler_options=values_compile())(params, batch)
    ref_sums, ref_grads = reference(graphdef, params, [d for docs, _ in pipes for d in docs])
    np.testing.assert_allclose(sums["loss_sum"], ref_sums["loss_sum"], rtol=1e-5)
    assert_tree_close(grads, ref_grads)
    head = "embed" if tied else "head"
    assert np.abs(np.asarray(jax.tree.leaves(grads[head])[0])).max() > 0  # the head's gradient is real


def _memory(vocab: int, layout: Layout, vocab_max_sp=None) -> tuple[int, int, int]:
    """(compiled temp bytes of the step, fp32 bytes of the table and the untied head, what the
    split head holds that the whole one does not: the chunk's ``[T, d]`` outputs gathered over sp
    and their fp32 gradient before its reduce-scatter, and at most four fp32 per-token statistics
    combined over sp)."""
    cfg = _config(vocab, tied=False)
    graphdef, params = tiny_params(cfg)
    _, sig, batch = token_1f1b_batch(cfg, layout, 0)
    grads = pl.make_pipeline_grads(graphdef, cfg, sig, pipeline_mesh(layout), vocab_max_sp=vocab_max_sp)
    compiled = jax.jit(grads).lower(params, batch).compile(relative_memory_compile())
    gathered = 2 * sig.bucket * cfg.d_model * 4 + 4 * sig.bucket * 4
    return compiled.memory_analysis().temp_size_in_bytes, 2 * vocab * cfg.d_model * 4, gathered


def test_a_device_holds_its_share_of_the_vocabulary():
    """Split over sp = 2, a device's step holds half the table and head and half their fp32
    accumulators (the model is fp32 here: copy 4 + accumulator 4 bytes per parameter): the
    temporaries shrink by at least half the accumulators, less what the split head holds that the
    whole one does not (``_memory``; the logits of both are one tile of ``T · V / sp`` per device),
    against a vocabulary one larger, which 2 does not divide
    (whole on every device; the few extra rows are 0.01 % of it), and against the same vocabulary
    where sp is more than ``vocab_max_sp`` (a node's devices: whole)."""
    layout = Layout(dp=1, pp=2, sp=2)
    require_devices(layout.num_devices)
    split, rest, gathered = _memory(8192, layout)
    whole, _, _ = _memory(8193, layout)
    assert whole - split >= rest / 2 - gathered, (whole, split, rest, gathered)
    across_nodes, _, _ = _memory(8192, layout, vocab_max_sp=1)
    assert across_nodes - split >= rest / 2 - gathered, (across_nodes, split, rest, gathered)


def _all_gathers(jaxpr, in_loop=False, in_cond=False, found=None) -> list[tuple[bool, bool, tuple]]:
    """(inside the tick loop, inside a conditional, output shape) of every ``all_gather`` in
    ``jaxpr`` and the jaxprs it calls."""
    found = [] if found is None else found
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "all_gather":
            found.append((in_loop, in_cond, tuple(eqn.outvars[0].aval.shape)))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _all_gathers(sub, in_loop or name == "while", in_cond or name == "cond", found)
    return found


def test_only_the_first_stages_backward_gathers_the_lookup_cotangents():
    """The lookup gradient's all-gather of a chunk's cotangents runs inside the op's conditional,
    where the first stage's backward takes it (``StageRest.lookup_cotangent``), not on every tick
    of every stage: no all-gather in the tick loop is unconditional (the time model charges it to
    the first stage's backward only, ``CostModel.vocab_time``)."""
    layout = Layout(dp=1, pp=2, sp=2)
    require_devices(layout.num_devices)
    cfg = _config(64, tied=False)
    graphdef, params = tiny_params(cfg)
    _, sig, batch = token_1f1b_batch(cfg, layout, 1)
    grads = pl.make_pipeline_grads(graphdef, cfg, sig, pipeline_mesh(layout))
    gathers = [g for g in _all_gathers(jax.make_jaxpr(grads)(params, batch).jaxpr) if g[0]]
    chunk = (sig.bucket, cfg.d_model)  # all T cotangents (or normed outputs) of a chunk
    assert any(shape == chunk for _, _, shape in gathers), gathers  # the gathers are there
    assert all(in_cond for _, in_cond, _ in gathers), gathers
