"""Ulysses SP and the canonical FSDP state against single-device references (8 fake devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tile_head_logits, values_compile
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_helpers import single_device_grads

from jvarlen.config import Config, ModelConfig, OptimizerConfig, TrainConfig
from jvarlen.kernels import reference_attention
from jvarlen.layout import Layout
from jvarlen.model import AttentionInputs
from jvarlen.parallel.layouts import layout_mesh
from jvarlen.parallel.sharding import Placement, place_global
from jvarlen.parallel.ulysses import gather_seq, heads_to_seq, kv_repeats, seq_to_heads, ulysses_attention_fn
from jvarlen.runtime.checkpoint import abstract_like
from jvarlen.runtime.state import create_train_state
from jvarlen.runtime.step import single_program_grads
from jvarlen.runtime.strategies.layouts import LayoutPolicy, LayoutStrategy, layout_loss_and_grads, shape_bucket
from jvarlen.runtime.strategy import StepContext

N = 8
LAYOUTS = [Layout(dp=8, sp=1), Layout(dp=4, sp=2), Layout(dp=2, sp=4), Layout(dp=1, sp=8)]
B, T, VOCAB = 8, 64, 64


@pytest.fixture(autouse=True)
def _eight_devices():
    if jax.device_count() < N:
        pytest.skip(f"needs {N} devices, have {jax.device_count()}")


def packed_batch(seed: int, rows: int = B, seq_len: int = T) -> dict:
    """Rank-coded tokens; documents of 3-40 tokens crossing every shard boundary; padding
    between and after documents, and one all-padding row."""
    rng = np.random.default_rng(seed)
    r, t = np.meshgrid(np.arange(rows), np.arange(seq_len), indexing="ij")
    tokens = ((13 * r + 5 * t + seed) % VOCAB).astype(np.int32)
    seg = np.zeros((rows, seq_len), np.int32)
    pos = np.zeros((rows, seq_len), np.int32)
    for b in range(rows - 1):  # the last row stays padding
        i, s = int(rng.integers(0, 3)), 1
        while i < seq_len - 2:
            length = min(int(rng.integers(3, 41)), seq_len - 2 - i)
            seg[b, i : i + length], pos[b, i : i + length] = s, np.arange(length)
            i += length + int(rng.integers(0, 2))  # sometimes a padding gap
            s += 1
    targets = np.roll(tokens, -1, axis=1)
    loss_mask = ((seg > 0) & (np.roll(seg, -1, axis=1) == seg)).astype(np.float32)
    return dict(tokens=tokens, segment_ids=seg, positions=pos, targets=targets, loss_mask=loss_mask)


def tiny_config(**model) -> Config:
    kw = dict(
        vocab_size=VOCAB,
        d_model=32,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        mlp_dim=64,
        compute_dtype="float32",
        attention="reference",
    )
    kw.update(model)
    return Config(model=ModelConfig(**kw), optimizer=OptimizerConfig(warmup_steps=0), train=TrainConfig(steps=5))


@pytest.fixture(scope="module")
def tiny():
    config = tiny_config()
    graphdef, optimizer, state = create_train_state(config)
    return config, graphdef, optimizer, state


@pytest.fixture(scope="module")
def reference(tiny):
    config, graphdef, _, state = tiny
    batch = packed_batch(0)
    sums, grads = single_device_grads(graphdef, state.params, batch)
    return batch, jax.device_get(sums), jax.device_get(grads)


@pytest.mark.parametrize(
    "layout, tile_rows",
    [(layout, None) for layout in LAYOUTS] + [(Layout(dp=4, sp=2), 24)],
    ids=lambda x: str(x) if x else "",
)
def test_loss_and_grads_match_single_device(tiny, reference, layout, tile_rows, monkeypatch):
    """Every layout's step against the single-device model's; with ``tile_rows``, each device's 64
    tokens go through the head in tiles of at most 24 rows (3 of 22, 2 padding rows), the reference's in one."""
    if tile_rows:
        tile_head_logits(monkeypatch, tile_rows * VOCAB)
    config, graphdef, optimizer, state = tiny
    batch, ref_sums, ref_grads = reference
    placement = Placement.for_state(state, optimizer)
    params = place_global(state.params, placement.state_sharding.params)
    sums, grads = layout_loss_and_grads(
        graphdef,
        params,
        placement.state_sharding.params,
        batch,
        placement.mesh(layout),
        attention=config.model.attention,
        compute_dtype="float32",
        compiler_options=values_compile(),
    )
    for key in ("loss_sum", "target_tokens"):
        np.testing.assert_allclose(float(sums[key]), float(ref_sums[key]), rtol=1e-5)
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    canonical = jax.tree.leaves(placement.state_sharding.params)
    for (path, g), ref, sharding in zip(flat, jax.tree.leaves(ref_grads), canonical):
        assert g.sharding == sharding  # pushed back to the canonical sharding, whatever the layout
        np.testing.assert_allclose(np.asarray(g), ref, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    assert any(np.abs(r).max() > 1e-3 for r in jax.tree.leaves(ref_grads))  # not trivially zero


def test_bf16_embedding_gradient_of_a_frequent_token_matches_single_device():
    """In bf16 the embedding gradient of a token that fills most of the batch (a scatter-add of
    thousands of rows) must equal the single-device model's, which gathers from the fp32 table: the
    layouts used to gather from a bf16 copy, and the sum stopped growing (40 % off here)."""
    config = Config(
        model=ModelConfig(
            vocab_size=VOCAB, d_model=32, num_layers=1, num_heads=8, num_kv_heads=2, mlp_dim=64,
            compute_dtype="bfloat16", attention="xla", tie_embeddings=False,
        )
    )  # fmt: skip
    graphdef, optimizer, state = create_train_state(config)
    rows, seq_len = 8, 1024
    rng = np.random.default_rng(0)
    tokens = np.where(rng.random((rows, seq_len)) < 0.9, 0, rng.integers(1, VOCAB, (rows, seq_len))).astype(np.int32)
    loss_mask = np.ones((rows, seq_len), np.float32)
    loss_mask[:, -1] = 0
    batch = dict(
        tokens=tokens,
        segment_ids=np.ones((rows, seq_len), np.int32),
        positions=np.tile(np.arange(seq_len, dtype=np.int32), (rows, 1)),
        targets=np.roll(tokens, -1, 1),
        loss_mask=loss_mask,
    )
    _, ref = single_device_grads(graphdef, state.params, batch)
    placement = Placement.for_state(state, optimizer)
    params = place_global(state.params, placement.state_sharding.params)
    mesh = placement.mesh(Layout(dp=8))
    _, grads = layout_loss_and_grads(
        graphdef,
        params,
        placement.state_sharding.params,
        batch,
        mesh,
        attention="xla",
        compute_dtype="bfloat16",
        compiler_options=values_compile(),
    )
    want, got = np.asarray(ref["embed"][...])[0], np.asarray(grads["embed"][...])[0]
    assert np.linalg.norm(got - want) <= 1e-3 * np.linalg.norm(want)


def test_layout_switching_every_step_matches_fixed_layout(tiny):
    config, graphdef, optimizer, state = tiny
    placement = Placement.for_state(state, optimizer)
    ctx = StepContext(
        graphdef,
        config.model,
        optimizer,
        placement,
        abstract_like(place_global(state, placement.state_sharding)),
        compiler_options=values_compile(),
    )
    strategy = LayoutStrategy(ctx, LayoutPolicy(N, config.model.num_heads), B, T)
    steps = {layout: strategy.compile(("layout", layout, shape_bucket(packed_batch(0)))) for layout in LAYOUTS[::3]}
    # dp=8 <-> sp=8 every step: the two most different arrangements of the devices
    # (each layout's own numerics are checked against the reference above).
    schedule = {
        "fixed": [LAYOUTS[0]] * 5,
        "switching": [LAYOUTS[3], LAYOUTS[0], LAYOUTS[3], LAYOUTS[0], LAYOUTS[3]],
    }
    final, losses = {}, {}
    for name, layouts in schedule.items():
        s = place_global(state, placement.state_sharding)
        losses[name] = []
        for i, layout in enumerate(layouts):
            s, metrics = steps[layout](s, packed_batch(10 + i))  # the step places the host batch
            losses[name].append(float(metrics["loss_sum"] / metrics["target_tokens"]))
        final[name] = jax.device_get(s.params)
        # the state never leaves its canonical sharding
        for leaf, sharding in zip(jax.tree.leaves(s), jax.tree.leaves(placement.state_sharding)):
            assert leaf.sharding == sharding
    np.testing.assert_allclose(losses["switching"], losses["fixed"], rtol=1e-5)
    moved = 0.0
    for a, b, init in zip(
        jax.tree.leaves(final["switching"]), jax.tree.leaves(final["fixed"]), jax.tree.leaves(state.params)
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        moved = max(moved, float(np.abs(b - np.asarray(init)).max()))
    assert moved > 1e-3  # five AdamW steps really changed the parameters


def _rank_coded(shape, offset):
    return jnp.sin(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) * 0.37 + offset)


# Hkv = 2 < sp = 4, 8 is also covered by the model-level test above (num_kv_heads=2).
@pytest.mark.parametrize("num_kv_heads, layout", [(1, Layout(dp=1, sp=8))])
def test_gqa_fewer_kv_heads_than_sp_matches_reference(num_kv_heads, layout):
    batch = packed_batch(3, rows=2, seq_len=64)
    seg, pos = jnp.asarray(batch["segment_ids"]), jnp.asarray(batch["positions"])
    h, d = 8, 4
    q = _rank_coded((2, 64, h, d), 0.0)
    k = _rank_coded((2, 64, num_kv_heads, d), 1.0)
    v = _rank_coded((2, 64, num_kv_heads, d), 2.0)
    dout = _rank_coded((2, 64, h, d), 3.0)
    assert kv_repeats(num_kv_heads, layout.sp) == layout.sp // num_kv_heads
    mesh = layout_mesh(layout)
    ulysses = ulysses_attention_fn(mesh, "reference")

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * dout)

    def ref_fn(q, k, v):
        return reference_attention(q, k, v, seg, seg, pos, pos, causal=True, sm_scale=d**-0.5)

    sharded = NamedSharding(mesh, P("dp", "sp"))
    q_s, k_s, v_s = (jax.device_put(x, NamedSharding(mesh, P("dp", "sp"))) for x in (q, k, v))
    inputs_s = AttentionInputs(segment_ids=jax.device_put(seg, sharded), positions=jax.device_put(pos, sharded))
    out = jax.jit(lambda q, k, v: ulysses(q, k, v, inputs_s), compiler_options=values_compile())(q_s, k_s, v_s)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_fn(q, k, v)), rtol=1e-5, atol=1e-6)
    grads = jax.jit(
        jax.grad(lambda q, k, v: loss(lambda *a: ulysses(*a, inputs_s), q, k, v), argnums=(0, 1, 2)),
        compiler_options=values_compile(),
    )(q_s, k_s, v_s)
    ref_grads = jax.grad(lambda q, k, v: loss(ref_fn, q, k, v), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_all_to_all_helpers_move_rank_coded_blocks():
    mesh = layout_mesh(Layout(dp=2, sp=4))
    x = jnp.arange(2 * 16 * 8 * 1, dtype=jnp.float32).reshape(2, 16, 8, 1)  # value = rank

    def body(x_local, ids_local):
        heads = seq_to_heads(x_local)  # [1, 16, 2, 1]: all tokens, this device's 2 heads
        sp_index = jax.lax.axis_index("sp")
        expected = jax.lax.dynamic_slice_in_dim(
            jax.lax.all_gather(x_local, "sp", axis=1, tiled=True), sp_index * 2, 2, axis=2
        )
        return heads_to_seq(heads), jnp.max(jnp.abs(heads - expected))[None, None], gather_seq(ids_local)

    ids = jnp.arange(2 * 16, dtype=jnp.int32).reshape(2, 16)
    back, err, gathered = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("dp", "sp"), P("dp", "sp")),
            out_specs=(P("dp", "sp"),) * 3,
        )
    )(x, ids)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
    assert float(np.max(err)) == 0.0
    # every sp device holds the whole row of ids: 4 copies side by side
    np.testing.assert_array_equal(np.asarray(gathered), np.tile(np.asarray(ids), (1, 4)))


def test_ulysses_rejects_indivisible_shapes():
    mesh = layout_mesh(Layout(dp=2, sp=4))
    fn = ulysses_attention_fn(mesh, "reference")
    ids = jnp.ones((2, 30), jnp.int32)
    with pytest.raises(ValueError, match=r"tokens \(30\).*divisible by sp \(4\)"):
        fn(jnp.ones((2, 30, 8, 4)), jnp.ones((2, 30, 2, 4)), jnp.ones((2, 30, 2, 4)), AttentionInputs(ids, ids))
    ids = jnp.ones((2, 32), jnp.int32)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be divisible by sp \(4\)"):
        fn(jnp.ones((2, 32, 6, 4)), jnp.ones((2, 32, 2, 4)), jnp.ones((2, 32, 2, 4)), AttentionInputs(ids, ids))
    ids = jnp.ones((3, 32), jnp.int32)
    with pytest.raises(ValueError, match=r"batch rows \(3\) must be divisible by dp \(2\)"):
        fn(jnp.ones((3, 32, 8, 4)), jnp.ones((3, 32, 2, 4)), jnp.ones((3, 32, 2, 4)), AttentionInputs(ids, ids))


def _dot_output_dtypes(closed, shapes) -> list[str]:
    """dtypes of the dot_general outputs anywhere in ``closed`` (nested jaxprs too) shaped as one of
    ``shapes``."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and tuple(eqn.outvars[0].aval.shape) in shapes:
                found.append(str(eqn.outvars[0].aval.dtype))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed.jaxpr)
    return found


def test_the_layouts_step_computes_layer_weight_gradients_with_fp32_outputs():
    """The partitioner sums a weight's gradient over dp / sp at the dot that produces it, in that dot's
    output dtype (on a GPU; XLA:CPU sums in fp32 whatever the dtype): the data-parallel layouts
    compute the layer matrices' gradients with fp32 outputs, so a bf16 model's gradients are summed
    in fp32 (tests/test_gpu_aot.py checks the compiled H100 step). The single-program step without
    the layouts keeps bf16 outputs (its dots are visible to residual policies)."""
    config = tiny_config(compute_dtype="bfloat16", mlp_dim=48)
    graphdef, optimizer, state = create_train_state(config)
    placement = Placement.for_state(state, optimizer)
    ctx = StepContext(
        graphdef, config.model, optimizer, placement, abstract_like(place_global(state, placement.state_sharding))
    )
    strategy = LayoutStrategy(ctx, LayoutPolicy(N, config.model.num_heads), B, T)
    batch = packed_batch(0)
    grads_fn, _, _ = strategy.step_inputs(("layout", Layout(dp=2, sp=4), shape_bucket(batch)))
    layer = {name: tuple(x.shape[1:]) for name, x in jax.tree_util.tree_leaves_with_path(state.params["layers"])}
    matrices = {shape for shape in layer.values() if len(shape) >= 2}
    assert len(matrices) >= 4  # wq/wk/wv/wo and the MLP's, told apart by their shapes
    layouts = _dot_output_dtypes(jax.make_jaxpr(grads_fn)(state.params, batch), matrices)
    plain = _dot_output_dtypes(jax.make_jaxpr(single_program_grads(graphdef))(state.params, batch), matrices)
    assert len(layouts) >= 7 and set(layouts) == {"float32"}, layouts  # one per matrix at least
    assert plain and set(plain) == {"bfloat16"}, plain


def test_layouts_padding_ratio_counts_the_rows_dp_adds(tiny):
    """5 full rows on dp = 4: the step computes 8 rows, 3 of them padding (before: logged 0.0, the
    packed batch's ratio without the rows added for dp)."""
    from jvarlen.data import Piece
    from jvarlen.runtime.feed import Iteration

    config, graphdef, optimizer, state = tiny
    placement = Placement.for_state(state, optimizer)
    ctx = StepContext(
        graphdef, config.model, optimizer, placement, abstract_like(place_global(state, placement.state_sharding))
    )
    strategy = LayoutStrategy(
        ctx, LayoutPolicy(N, config.model.num_heads), 5, T, layout_for_step=lambda *_: Layout(dp=4, sp=2)
    )
    pieces = [Piece(np.arange(1, T + 1, dtype=np.int32) % VOCAB, i, -1) for i in range(5)]
    prepared = strategy.prepare(Iteration(0, pieces, np.arange(5), {}))
    assert prepared.arrays["tokens"].shape == (8, T)
    assert prepared.info["padding_ratio"] == pytest.approx(3 / 8)
