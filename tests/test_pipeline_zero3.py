"""Stage weights sharded over the stage's sp devices and the dp pipelines (ZeRO-3,
``stage_weights="sharded"``): the gradients equal the single-device reference under every op kind
(stored layers, recomputed layers, the fused last-stage op, context K/V of split documents), a
device holds 1/(dp·sp) of its stage's layers (gathered whole one layer ahead of its use, never
stacked), and pull/gather/reduce/push move exactly the right chunks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import relative_memory_compile, require_devices, values_compile
from flax import nnx
from jax.sharding import PartitionSpec as P
from pipeline_helpers import (
    PLAN_A,
    PLAN_B,
    PipelineGrads,
    assert_tree_close,
    pipeline_mesh,
    pipelines,
    reference,
    tiny_config,
    tiny_params,
    token_1f1b_batch,
)

from jvarlen.layout import Layout
from jvarlen.model.transformer import abstract_model
from jvarlen.parallel import pipeline as pl
from jvarlen.parallel.pipeline.weights import StageWeights
from jvarlen.parallel.sharding import param_axes
from jvarlen.plan import schedule as sch


def _layer_state(cfg):
    return nnx.split(abstract_model(cfg).layers, nnx.Param)[1]


def _weights(cfg, layout, mode):
    state = _layer_state(cfg)
    return state, StageWeights(state, param_axes(state), layout, mode)


def _per_layer(fn, tree):
    """``fn`` on each layer of a stacked tree (leaves [Ls, ...]), restacked."""
    n = jax.tree.leaves(tree)[0].shape[0]
    out = [fn(jax.tree.map(lambda a, j=j: a[j], tree)) for j in range(n)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *out)


def _mixed_config():
    """d_model = 20: N = 8 devices divide only the MLP matrices (canonical axes 1 and 2); the
    attention matrices and norm scales are left to GSPMD (sharded over sp on their first axis)."""
    return dataclasses.replace(tiny_config(num_layers=4), d_model=20, num_heads=2, num_kv_heads=2, mlp_dim=48)


@pytest.mark.parametrize(
    "layout, model",
    [
        (Layout(dp=2, pp=2, sp=2), "tiny"),
        (Layout(dp=1, pp=4, sp=2), "tiny"),
        (Layout(dp=2, pp=1, sp=4), "tiny"),
        (Layout(dp=4, pp=2, sp=1), "tiny"),
        (Layout(dp=2, pp=2, sp=2), "mixed"),
        (Layout(dp=4, pp=2, sp=1), "bias"),  # q/k bias: 8 elements over 8 devices; sharded, 2 per stage
    ],
    ids=str,
)
@pytest.mark.parametrize("mode", ["replicated", "sharded"])
def test_pull_and_push_move_the_right_chunks(layout, model, mode):
    """On the layout mesh, from the canonical placement: pull gives each device its stage's layers
    (sharded: its pipeline's chunks of its sp shard), ``gather`` per layer the whole layers as an
    op uses them; ``reduce`` per layer and push of per-device gradients give the canonical chunks
    of their sum; against numpy slicing of the whole leaves."""
    require_devices(layout.num_devices)
    cfg = {
        "tiny": tiny_config(num_layers=4),
        "mixed": _mixed_config(),
        "bias": dataclasses.replace(tiny_config(num_layers=4), qkv_bias=True),
    }[model]
    state, weights = _weights(cfg, layout, mode)
    managed = [leaf.canon is not None for leaf in weights.leaves]
    assert 0 < sum(managed) < len(managed) if model == "mixed" else all(managed)
    assert weights.dp_sharded == (mode == "sharded" and layout.dp > 1)
    mesh = pipeline_mesh(layout)
    rng = np.random.default_rng(0)
    full = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), state)
    specs = weights.specs()

    # pull, then push of (used weights × (device's flat index + 1)): the sum over the devices of
    # a stage group that share a chunk is a known multiple of the weights
    def device(layers):
        held = weights.pull(layers)
        used = _per_layer(weights.gather, held)
        i = (jax.lax.axis_index("dp") * layout.pp + jax.lax.axis_index("pp")) * layout.sp + jax.lax.axis_index("sp")
        scaled = jax.tree.map(lambda x: x * (i + 1).astype(x.dtype), used)
        return held, used, weights.push(_per_layer(weights.reduce, scaled))

    per_device = jax.tree.map(lambda _: P(("dp", "pp", "sp")), specs, is_leaf=lambda x: isinstance(x, P))
    held, used, pushed = jax.jit(
        jax.shard_map(device, mesh=mesh, in_specs=(specs,), out_specs=(per_device, per_device, specs), check_vma=False),
        compiler_options=values_compile(),
    )(full)
    n, ls = layout.num_devices, cfg.num_layers // layout.pp
    for x, h, p, g, leaf in zip(
        jax.tree.leaves(full), jax.tree.leaves(held), jax.tree.leaves(used), jax.tree.leaves(pushed), weights.leaves
    ):
        h = np.asarray(h).reshape((n, ls) + h.shape[1:])
        p = np.asarray(p).reshape((n, ls) + p.shape[1:])
        for d in range(layout.dp):
            for q in range(layout.pp):
                for s in range(layout.sp):
                    stage = x[q * ls : (q + 1) * ls]
                    if mode == "sharded" and leaf.canon is not None:  # its pipeline's chunks (d, q', s)
                        a, chunk = leaf.canon, x.shape[leaf.canon] // n
                        mine = [(d * layout.pp + r) * layout.sp + s for r in range(layout.pp)]
                        own = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in mine])
                        np.testing.assert_array_equal(
                            h[(d * layout.pp + q) * layout.sp + s], np.take(stage, own, axis=a)
                        )
                    np.testing.assert_array_equal(p[(d * layout.pp + q) * layout.sp + s], stage)  # whole
        # summed over the dp and sp devices of a stage (whatever chunk a device holds)
        expected = np.zeros_like(x)
        for q in range(layout.pp):
            k = sum((d * layout.pp + q) * layout.sp + s + 1 for d in range(layout.dp) for s in range(layout.sp))
            expected[q * ls : (q + 1) * ls] = k * x[q * ls : (q + 1) * ls]
        np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-6)


@pytest.mark.parametrize("reverse", [True, False], ids=["descending", "ascending"])
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "ahead"])
def test_layer_pass_reduces_each_layer_one_layer_late(reverse, ordered):
    """``layer_pass(reduce=True)`` reduce-scatters layer j's gradient in the body of the layer after
    it (and the last one after the loop): every layer's reduced gradient lands at its own index,
    equal to reducing each layer where it was computed, in both directions and orders."""
    layout = Layout(dp=2, pp=2, sp=2)
    require_devices(layout.num_devices)
    cfg = tiny_config(num_layers=4)
    state, weights = _weights(cfg, layout, "sharded")
    mesh = pipeline_mesh(layout)
    rng = np.random.default_rng(1)
    full = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), state)
    specs = weights.specs()
    ls = cfg.num_layers // layout.pp

    def device(layers):
        held = weights.pull(layers)
        i = (jax.lax.axis_index("dp") * layout.pp + jax.lax.axis_index("pp")) * layout.sp + jax.lax.axis_index("sp")
        scale = lambda j: ((i + 1) * (j + 1)).astype(jnp.float32)  # noqa: E731

        def step(visited, lp, j):
            return visited + 1, (j, jax.tree.map(lambda w: w * scale(j), lp))

        visited, (order, late) = weights.layer_pass(held, step, 0, jnp.arange(ls), reverse, ordered, reduce=True)
        used = _per_layer(weights.gather, held)
        scaled = jax.tree.map(lambda w: w * scale(jnp.arange(ls).reshape((ls,) + (1,) * (w.ndim - 1))), used)
        return visited[None], order[None], late, _per_layer(weights.reduce, scaled)

    per_device = jax.tree.map(lambda _: P(("dp", "pp", "sp")), specs, is_leaf=lambda x: isinstance(x, P))
    visited, order, late, direct = jax.jit(
        jax.shard_map(
            device,
            mesh=mesh,
            in_specs=(specs,),
            out_specs=(P(("dp", "pp", "sp")), P(("dp", "pp", "sp")), per_device, per_device),
            check_vma=False,
        ),
        compiler_options=values_compile(),
    )(full)
    assert np.asarray(visited).tolist() == [ls] * layout.num_devices
    np.testing.assert_array_equal(np.asarray(order).reshape(layout.num_devices, ls), [list(range(ls))] * 8)
    for a, b in zip(jax.tree.leaves(late), jax.tree.leaves(direct)):
        assert np.abs(np.asarray(b)).max() > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_stage_weights_reject_unknown_modes():
    with pytest.raises(ValueError, match="stage_weights"):
        _weights(tiny_config(num_layers=4), Layout(dp=1, pp=2, sp=2), "zero3")


@pytest.mark.parametrize(
    "layout",
    [
        Layout(dp=2, pp=2, sp=2),  # chunks over dp and sp; the default suite's case
        pytest.param(Layout(dp=2, pp=1, sp=2), marks=pytest.mark.slow),
        pytest.param(Layout(dp=4, pp=2, sp=1), marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_sharded_stage_weights_match_reference(layout):
    require_devices(layout.num_devices)
    cfg = tiny_config(num_layers=4)
    graphdef, params = tiny_params(cfg)
    pp, ls = layout.pp, cfg.num_layers // layout.pp
    pipes = pipelines(layout.dp, plans=(PLAN_A, PLAN_B))
    n = pipes[0][1].n_chunks
    rng = np.random.default_rng(3)
    cases = {
        "token_1f1b/none": ([sch.token_level_1f1b(pk.chunk_prev, pp) for _, pk in pipes], 0),
        "gpipe/all": ([sch.gpipe(pk.n_chunks, pp, pk.chunk_prev) for _, pk in pipes], ls),
        "token_1f1b/mixed": ([sch.token_level_1f1b(pk.chunk_prev, pp) for _, pk in pipes], None),
    }
    tables = {
        name: (
            scheds,
            [
                rng.integers(0, ls + 1, size=(n, pp)).astype(np.int32) if r is None else np.full((n, pp), r, np.int32)
                for _ in pipes
            ],
        )
        for name, (scheds, r) in cases.items()
    }
    packs = [pk for _, pk in pipes]
    sig = pl.cover(*[pl.prepare_batch(packs, s, c, layout, cfg.num_layers)[0] for s, c in tables.values()])
    assert sig.context > 0 and (pp == 1 or sig.n_res > 0)
    grads_of = PipelineGrads(
        graphdef, cfg, sig, params, residual_policy="dots_and_attention", stage_weights="sharded",
        compiler_options=values_compile(),
    )  # fmt: skip
    ref_sums, ref_grads = reference(graphdef, params, [d for docs, _ in pipes for d in docs])
    for name, (scheds, ckpts) in tables.items():
        _, batch = pl.prepare_batch(packs, scheds, ckpts, layout, cfg.num_layers, signature=sig)
        sums, grads, _ = grads_of(params, batch)
        np.testing.assert_allclose(sums["loss_sum"], ref_sums["loss_sum"], rtol=1e-5, err_msg=name)
        assert_tree_close(grads, ref_grads)


def _temp_bytes(layout, stage_weights, residual_policy, num_layers: int = 4):
    """(compiled temp bytes of the pipeline step, parameter bytes of one stage's layers), the
    parameters given in their canonical placement (as the train step holds them)."""
    cfg = tiny_config(num_layers=num_layers)
    graphdef, params = tiny_params(cfg)
    _, sig, batch = token_1f1b_batch(cfg, layout, 0)
    mesh = pipeline_mesh(layout)
    grads = pl.make_pipeline_grads(
        graphdef, cfg, sig, mesh, residual_policy=residual_policy, stage_weights=stage_weights
    )
    _, weights = _weights(cfg, layout, stage_weights)
    shardings = jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(mesh, spec), weights.specs(), is_leaf=lambda x: isinstance(x, P)
    )
    placed = nnx.merge_state(params, nnx.State({"layers": jax.device_put(params["layers"], shardings)}))
    compiled = jax.jit(grads).lower(placed, batch).compile(relative_memory_compile())
    stage = sum(x.nbytes for x in jax.tree.leaves(params["layers"])) // layout.pp
    return compiled.memory_analysis().temp_size_in_bytes, stage


@pytest.mark.parametrize(
    "layout,policy",
    [  # the default suite: one layout sharding over dp and sp, and the policy that keeps every residual
        pytest.param(Layout(dp=1, pp=2, sp=2), "dots_and_attention", marks=pytest.mark.slow),
        (Layout(dp=1, pp=2, sp=2), None),
        (Layout(dp=2, pp=2, sp=2), "dots_and_attention"),
        pytest.param(Layout(dp=4, pp=2, sp=1), "dots_and_attention", marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_sharded_stage_weights_memory(layout, policy):
    """Sharded, a device holds 1/(dp·sp) of its stage's layers and of their gradient accumulator:
    the step's temporaries shrink by at least (1 - 1/(dp·sp)) of the stage's weights (the
    accumulator saves as much again, minus the layers in flight and a layer's gradient); no stack
    of gathered layers is kept (policy None keeps every other residual of a stored layer). Sixteen
    layers, eight per stage, so that the layers in flight (two gathered layers, the gradient
    reduced one layer late and the one being reduced) are a small part of a stage: with four per
    stage they are most of it, and the bound held only while both placements also held a
    stage's worth of one chunk's residuals twice (before the backward read its stored residuals
    layer by layer)."""
    require_devices(layout.num_devices)
    temp_r, stage = _temp_bytes(layout, "replicated", policy, num_layers=16)
    temp_s, _ = _temp_bytes(layout, "sharded", policy, num_layers=16)
    assert temp_r - temp_s >= (1 - 1 / (layout.dp * layout.sp)) * stage, (temp_r, temp_s, stage)


def test_bf16_stage_copy_matches_reference():
    """With a bf16 compute dtype the stages hold their weight matrices in bf16 (the planner's
    6 bytes per parameter: bf16 copy + fp32 accumulator) and accumulate gradients in fp32: the
    gradients differ from the single-device bf16 reference by less than that reference differs
    from the fp32 one, in root-mean-square over each leaf (measured: 0.23-0.54 of it on JAX 0.10
    and 0.12). Not in the largest element: two bf16 programs round differently, and on JAX 0.12
    the reference's fusion changed so that one element of w_gate's gradient differs by 1.13x the
    reference's largest error while the RMS ratio stayed at 0.53.

    Both placements sum bf16 per-device gradients in fp32 (a sharded stage reduce-scatters each
    layer's gradient per chunk, a replicated stage sums its accumulators once at the end), so they
    agree to fp32 rounding; the sharded stage once returned each chunk's sum in bf16 and was off
    by bf16's rounding of every chunk's share (relative RMS 1.4e-3 on wk)."""
    layout = Layout(dp=2, pp=2, sp=2)
    require_devices(layout.num_devices)
    cfg = dataclasses.replace(tiny_config(num_layers=4), compute_dtype="bfloat16")
    graphdef, params = tiny_params(cfg)
    pipes, sig, batch = token_1f1b_batch(cfg, layout, 1)
    documents = [d for docs, _ in pipes for d in docs]
    ref_sums, ref_grads = reference(graphdef, params, documents)
    # the bar is bf16's own error: the bf16 reference against the fp32 one, per leaf
    graphdef32, _ = tiny_params(tiny_config(num_layers=4))
    _, fp32_grads = reference(graphdef32, params, documents)

    def rms(a, b):
        return float(np.sqrt(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))

    grads = {}
    for mode in ("replicated", "sharded"):
        grads_of = PipelineGrads(
            graphdef, cfg, sig, params, residual_policy="dots_and_attention", stage_weights=mode,
            compiler_options=values_compile(),
        )  # fmt: skip
        sums, grads[mode], _ = grads_of(params, batch)
        assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads[mode]))
        for (path, g), r, r32 in zip(
            jax.tree_util.tree_leaves_with_path(grads[mode]), jax.tree.leaves(ref_grads), jax.tree.leaves(fp32_grads)
        ):
            error, bf16_error = rms(g, r), rms(r, r32)
            assert error <= bf16_error, (mode, jax.tree_util.keystr(path), error, bf16_error)
        np.testing.assert_allclose(sums["loss_sum"], ref_sums["loss_sum"], rtol=1e-2)
    for (path, g), r in zip(
        jax.tree_util.tree_leaves_with_path(grads["sharded"]), jax.tree.leaves(grads["replicated"])
    ):
        relative = rms(g, r) / max(rms(r, np.zeros_like(r)), 1e-30)
        assert relative < 1e-5, (jax.tree_util.keystr(path), relative)


def _untied_bf16(layout):
    cfg = dataclasses.replace(tiny_config(num_layers=4), compute_dtype="bfloat16", tie_embeddings=False)
    graphdef, params = tiny_params(cfg)
    _, sig, batch = token_1f1b_batch(cfg, layout, 1)
    return cfg, graphdef, params, sig, batch


def test_the_rest_accumulates_its_gradients_in_fp32():
    """An untied head reaches the stages in the compute dtype (next test), and each op's gradient
    of it is a bf16 number; the executor sums them over the step's chunks in fp32, as it does the
    layers' (the planner's 6 bytes per parameter: a bf16 copy and an fp32 accumulator). With
    pp = 2 the head's gradient is the last stage's sum alone: 1,858 of its 2,048 elements are no
    bf16 number. The accumulator once took the rest's dtype: every element was one, and the sum
    of the 6 chunks' shares was off by relative RMS 3.2e-3 from the fp32 sum."""
    layout = Layout(dp=1, pp=2, sp=1)
    require_devices(layout.num_devices)
    cfg, graphdef, params, sig, batch = _untied_bf16(layout)
    grads = PipelineGrads(graphdef, cfg, sig, params, compiler_options=values_compile())(params, batch)[1]
    head = np.asarray(jax.tree.leaves(grads["head"])[0])
    assert head.dtype == np.float32
    nonzero = head[head != 0]
    in_bf16 = nonzero.astype(jnp.bfloat16).astype(np.float32) == nonzero
    assert nonzero.size > 1000 and in_bf16.mean() < 0.5, (nonzero.size, in_bf16.sum())


def test_the_stages_are_handed_an_untied_head_in_the_compute_dtype():
    """The rest of the model (embedding, final norm, head) is replicated on every device of every
    stage. It moves there and is held as the stages compute with it: an untied head in the compute
    dtype (half the bytes of its all-gather, its copy and each op's gradient of it), the embedding
    table and the norm scale in fp32 (``pulled_dtypes``), as a device group's pull hands them. On
    abstract H100s (llama-7b's shape with 4 layers, 2 chunks of 2K tokens) the step's temporaries
    fell by 0.37-0.74 GiB per device (docs/benchmarks.md, "The embedding and head on every
    pipeline device"); the gradients are the head's per-op bf16 gradients summed in fp32 either
    way (the test above)."""
    layout = Layout(dp=1, pp=2, sp=2)
    require_devices(layout.num_devices)
    cfg, graphdef, params, sig, batch = _untied_bf16(layout)
    grads = pl.make_pipeline_grads(graphdef, cfg, sig, pipeline_mesh(layout))
    jaxpr = jax.make_jaxpr(grads)(params, {k: jnp.asarray(v) for k, v in batch.items()})
    (executor,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    n_layers = len(jax.tree.leaves(params["layers"]))
    rest = _split_rest(params)
    handed = executor.invars[n_layers : n_layers + len(rest)]
    expected = {"embed": jnp.float32, "final_norm": jnp.float32, "head": jnp.bfloat16}
    assert len(rest) == 3
    for (name, leaf), var in zip(rest, handed):
        assert var.aval.shape == leaf.shape and var.aval.dtype == expected[name], (name, var.aval)


def _split_rest(params) -> list:
    """(top-level name, leaf) of every leaf of the rest, in leaf order."""
    return [(path[0].key, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(pl.split_params(params)[1])]
