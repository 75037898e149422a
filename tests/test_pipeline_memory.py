"""Compiled temp memory (``memory_analysis``) of the pipeline step follows the buffer slots:
1F1B's stays flat in the number of chunks (the window is pp), GPipe's grows with it, and a
signature with fewer residual slots (more recomputation) compiles to less."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import relative_memory_compile, require_devices
from flax import nnx
from pipeline_helpers import (
    FAST_COMPILE,
    PLAN_B,
    assert_tree_close,
    pipeline_mesh,
    pipelines,
    reference,
    tiny_config,
    tiny_params,
)

from jvarlen.layout import Layout
from jvarlen.model import AttentionInputs, make_attention_fn
from jvarlen.model.transformer import abstract_model
from jvarlen.parallel import pipeline as pl
from jvarlen.parallel.pipeline import pack_chunks
from jvarlen.parallel.pipeline.stage import StageFns, residual_policy, residual_shapes
from jvarlen.plan import schedule as sch

LAYOUT = Layout(dp=1, pp=2, sp=1)
BUCKET = 32


@pytest.fixture(scope="module")
def model():
    require_devices(LAYOUT.num_devices)
    cfg = tiny_config(num_layers=2)
    return (cfg,) + tiny_params(cfg)


_SEEN: dict = {}


def _compiled(model, n: int, kind: str, recompute: int):
    """(signature, temp bytes) of the step for n one-document chunks (compiled once per case)."""
    if (n, kind, recompute) not in _SEEN:
        _SEEN[(n, kind, recompute)] = _compile(model, n, kind, recompute)
    return _SEEN[(n, kind, recompute)]


def _compile(model, n: int, kind: str, recompute: int, policy=None, run=False, text=False):
    cfg, graphdef, params = model
    rng = np.random.default_rng(n)
    docs = [rng.integers(1, cfg.vocab_size, size=20).astype(np.int32) for _ in range(n)]
    pack = pack_chunks([[(i, 0, 20)] for i in range(n)], docs, BUCKET)
    sched = sch.gpipe(n, LAYOUT.pp) if kind == "gpipe" else sch.one_f_one_b(n, LAYOUT.pp)
    ckpt = np.full((n, LAYOUT.pp), recompute, np.int32)
    sig, batch = pl.prepare_batch([pack], [sched], [ckpt], LAYOUT, cfg.num_layers)
    fn = jax.jit(pl.make_pipeline_grads(graphdef, cfg, sig, pipeline_mesh(LAYOUT), residual_policy=policy))
    compiled = fn.lower(params, batch).compile(compiler_options=FAST_COMPILE if text else relative_memory_compile())
    if run:
        return sig, compiled.memory_analysis().temp_size_in_bytes, compiled(params, batch), docs
    if text:
        return sig, compiled.as_text()
    return sig, compiled.memory_analysis().temp_size_in_bytes


def _chunk_state_bytes(cfg) -> int:
    """Stashed input + cotangent inbox of one chunk on one stage (fp32)."""
    return 2 * BUCKET * cfg.d_model * 4


def test_1f1b_memory_follows_the_window_gpipe_follows_the_chunks(model):
    cfg = model[0]
    sig4, f4 = _compiled(model, 4, "1f1b", 0)
    sig8, f8 = _compiled(model, 8, "1f1b", 0)
    assert (sig4.n_stash, sig4.n_res) == (sig8.n_stash, sig8.n_res) == (LAYOUT.pp, LAYOUT.pp)
    assert abs(f8 - f4) < 0.02 * f4, (f4, f8)
    gsig4, g4 = _compiled(model, 4, "gpipe", 0)
    gsig8, g8 = _compiled(model, 8, "gpipe", 0)
    assert (gsig4.n_stash, gsig8.n_stash) == (4, 8)
    # four more chunks in flight: at least their stashed inputs and inboxes
    assert g8 - g4 >= 4 * _chunk_state_bytes(cfg), (g4, g8)
    assert g8 > f8 and g4 > f4


def test_tick_loop_updates_its_buffers_in_place(model):
    """No buffer of the tick loop is copied whole: reads gather a chunk's rows, writes scatter them
    in place. (Lane 1's writes without a data dependency on lane 0's reads, or a ``lax.cond`` over
    the residual buffers, made XLA:CPU copy every residual buffer each tick: +35 % step time.)"""
    sig, hlo = _compile(model, 6, "gpipe", 0, text=True)
    assert sig.n_res >= 6 and sig.n_stash >= 5  # a buffer copy would be unmistakable
    leading = {sig.n_res, sig.n_stash + 1, sig.n_grad + 1}
    copies = [
        line.strip()
        for line in hlo.splitlines()
        if re.search(r"= f32\[(\d+),[^=]*\bcopy\(%(?!wrapped_broadcast|broadcast)", line)  # zero-fills are fine
        and int(re.search(r"= f32\[(\d+),", line).group(1)) in leading
    ]
    assert not copies, copies[:3]


def test_context_pools_hold_each_split_document_its_own_rows(model):
    """The context K/V and dK/dV pools hold ``ctx_rows`` rows: each split document in flight its
    own region, as long as its context grows (24 and 30 rows here), not a whole context bucket
    each; and the tick loop updates them in place."""
    cfg, graphdef, params = model
    ((_, pack),) = pipelines(1, plans=(PLAN_B,))  # documents of 40 and 50 tokens, each split in two
    sched = sch.token_level_1f1b(pack.chunk_prev, LAYOUT.pp)
    sig, batch = pl.prepare_batch(
        [pack], [sched], [np.zeros((pack.n_chunks, LAYOUT.pp), np.int32)], LAYOUT, cfg.num_layers
    )
    assert sig.context >= 30 and 30 <= sig.ctx_rows <= 24 + 30, sig
    fn = jax.jit(pl.make_pipeline_grads(graphdef, cfg, sig, pipeline_mesh(LAYOUT)))
    hlo = fn.lower(params, batch).compile(compiler_options=FAST_COMPILE).as_text()
    ls = cfg.num_layers // LAYOUT.pp
    pool = f"f32[{ls},{sig.ctx_rows},{cfg.num_kv_heads},{cfg.head_dim}]"
    assert pool in hlo
    copies = [
        line.strip()
        for line in hlo.splitlines()
        if re.search(r"= " + re.escape(pool) + r"[^=]*\bcopy\(%(?!wrapped_broadcast|broadcast)", line)
    ]
    assert not copies, copies[:3]


def test_an_op_reads_the_context_one_layer_at_a_time():
    """Per context token of the window Sc, what the step holds grows by four layer rows
    (one layer's K, V, dK or dV of one token) per layer of the stage: the backward's dK/dV, which
    the op returns stacked, and the K/V its recomputed attention keeps (no residual policy: every
    residual). Each layer reads its context rows where it uses them; read and rolled for the whole
    stage before each op, that was 12 rows per layer (the stage's K/V and dK/dV, their rolls and
    sums; +9.0 GiB on the H100 compile of llama-7b at (4, 2, 1) with a split 16K document)."""
    require_devices(LAYOUT.num_devices)
    ((_, pack),) = pipelines(1, plans=(PLAN_B,))  # two documents split in two
    sched = sch.token_level_1f1b(pack.chunk_prev, LAYOUT.pp)
    extra = 1024  # context tokens added to the signature's bucket
    growth = {}
    for layers in (4, 8):
        cfg = tiny_config(num_layers=layers, attention="xla")  # blockwise: no [T, context] scores
        _, graphdef, params = (cfg,) + tiny_params(cfg)
        ls = layers // LAYOUT.pp
        recompute = np.full((pack.n_chunks, LAYOUT.pp), ls, np.int32)  # no residual slot holds context
        sig, _ = pl.prepare_batch([pack], [sched], [recompute], LAYOUT, layers)
        temps = []
        for s in (sig, dataclasses.replace(sig, context=sig.context + extra)):
            _, batch = pl.prepare_batch([pack], [sched], [recompute], LAYOUT, layers, signature=s)
            fn = jax.jit(pl.make_pipeline_grads(graphdef, cfg, s, pipeline_mesh(LAYOUT)))
            temps.append(
                fn.lower(params, batch)
                .compile(compiler_options=relative_memory_compile())
                .memory_analysis()
                .temp_size_in_bytes
            )
        row = extra * cfg.num_kv_heads * cfg.head_dim * 4  # one layer's K of the extra tokens, fp32
        growth[ls] = (temps[1] - temps[0]) / row  # the pools do not grow with the window Sc
    per_layer = (growth[4] - growth[2]) / 2
    assert per_layer <= 4.5, growth


def test_a_recomputing_backward_rebuilds_one_layer_at_a_time():
    """Every layer recomputed (no residual slot, nothing fused): per token and layer of the stage,
    the step holds the layer's input for each chunk in flight (its checkpoint slots, and the
    forward's inputs on their way to them), not the chunk's rebuilt residuals of every layer at
    once. Rebuilding them all before the descent held a layer's residuals per token and layer
    (DAPPLE's 4,096-token CPU step: 136 -> 114 MB). The growth in both the bucket and the layer
    count isolates that term from the parameters' and the buffers'."""
    require_devices(LAYOUT.num_devices)
    n = 4
    temps, slots = {}, {}
    for layers in (4, 8):
        cfg = tiny_config(num_layers=layers)
        _, graphdef, params = (cfg,) + tiny_params(cfg)
        ls = layers // LAYOUT.pp
        rng = np.random.default_rng(0)
        docs = [rng.integers(1, cfg.vocab_size, size=20).astype(np.int32) for _ in range(n)]
        for bucket in (32, 64):
            pack = pack_chunks([[(i, 0, 20)] for i in range(n)], docs, bucket)
            recompute = np.full((n, LAYOUT.pp), ls, np.int32)
            sig, batch = pl.prepare_batch([pack], [sch.one_f_one_b(n, LAYOUT.pp)], [recompute], LAYOUT, layers)
            assert sig.n_res == 0 and not sig.fused and sig.n_ckpt > 0
            fn = jax.jit(pl.make_pipeline_grads(graphdef, cfg, sig, pipeline_mesh(LAYOUT)))
            compiled = fn.lower(params, batch).compile(compiler_options=relative_memory_compile())
            temps[ls, bucket] = compiled.memory_analysis().temp_size_in_bytes
            slots[ls] = sig.n_ckpt / (ls - 1)  # checkpoint slots per layer: the chunks in flight
    per_token = {ls: (temps[ls, 64] - temps[ls, 32]) / 32 for ls in (2, 4)}
    row = cfg.d_model * 4  # one token's layer input, fp32
    per_layer = (per_token[4] - per_token[2]) / 2 / row
    assert slots[2] == slots[4]
    assert per_layer <= slots[4] + 1 + 0.5, (per_layer, temps)  # + 1: the forward's inputs


def test_fewer_residual_slots_compile_to_less_temp_memory(model):
    cfg = model[0]
    sig_keep, keep = _compiled(model, 8, "gpipe", 0)  # every layer's residuals stored
    sig_rec, rec = _compiled(model, 8, "gpipe", 1)  # every layer recomputed
    assert sig_keep.n_res == 8 and sig_rec.n_res == 0
    # each residual slot holds at least a layer input and its attention output
    assert keep - rec >= 8 * 2 * BUCKET * cfg.d_model * 4, (keep, rec)


def test_selective_residual_policy_is_exact_and_stores_less(model):
    """A stored layer that keeps only its matmul outputs (the rest recomputed in the backward)."""
    cfg, graphdef, params = model
    _, full = _compiled(model, 8, "gpipe", 0)
    _, dots, (sums, grads, forwards), docs = _compile(
        model, 8, "gpipe", 0, "dots_with_no_batch_dims_saveable", run=True
    )
    assert dots < full, (dots, full)
    ref_sums, ref_grads = reference(graphdef, params, docs)
    np.testing.assert_allclose(sums["loss_sum"], ref_sums["loss_sum"], rtol=1e-5)
    assert_tree_close(grads, ref_grads)
    np.testing.assert_array_equal(np.asarray(forwards), [[8, 8]])  # no whole layer recomputed


def test_dots_and_attention_policy_keeps_the_attention_output_and_is_exact():
    """With the blockwise attention (custom_vjp, named residuals) ``dots_and_attention`` keeps the
    attention output [T, H, D] and logsumexp [H, T] on top of the matmul outputs, so the backward
    does not rerun the attention forward; less than every residual, same gradients."""
    require_devices(LAYOUT.num_devices)
    cfg = tiny_config(num_layers=2, attention="xla")
    xla_model = (cfg,) + tiny_params(cfg)
    graphdef, params = xla_model[1:]
    layer_graphdef, _ = nnx.split(abstract_model(cfg).layers, nnx.Param)
    layer0 = jax.tree.map(lambda a: a[0], params["layers"])
    x, no_ctx = jnp.zeros((BUCKET, cfg.d_model)), jnp.zeros((0, cfg.num_kv_heads, cfg.head_dim))
    pos = jnp.arange(BUCKET, dtype=jnp.int32)[None]
    inputs = AttentionInputs(jnp.ones_like(pos), pos)

    def kept_bytes(policy):
        fns = StageFns(
            layer_graphdef, make_attention_fn("xla"), jnp.float32, with_context=False, residual_policy=policy
        )
        return sum(s.size * s.dtype.itemsize for s in residual_shapes(fns, layer0, x, no_ctx, no_ctx, inputs, pos[0]))

    full, dots, both = (kept_bytes(p) for p in (None, "dots_with_no_batch_dims_saveable", "dots_and_attention"))
    assert both - dots == 4 * (BUCKET * cfg.num_heads * cfg.head_dim + cfg.num_heads * BUCKET)
    assert both < full
    _, _, (sums, grads, _), docs = _compile(xla_model, 4, "gpipe", 0, "dots_and_attention", run=True)
    ref_sums, ref_grads = reference(graphdef, params, docs)
    np.testing.assert_allclose(sums["loss_sum"], ref_sums["loss_sum"], rtol=1e-5)
    assert_tree_close(grads, ref_grads)
    with pytest.raises(ValueError, match="unknown residual policy"):
        residual_policy("keep_what_i_like")
