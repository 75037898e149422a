"""Cost model (InfiniPipe Eq. 1-11), fitting and analytic profiles: hand-computed expectations."""

import dataclasses
import json
import math
import pathlib

import numpy as np
import pytest

from jvarlen import head_tiles
from jvarlen.config import ModelConfig
from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape, executor_buckets, executor_context
from jvarlen.plan.cost import CostCoefficients, CostModel, LayerTime, Link, ModelShape, profile_filename
from jvarlen.plan.cost_fit import fit_layer_time, fit_linear, fit_link, fit_tick_overhead, tick_overhead_terms
from jvarlen.plan.hardware import CLUSTERS, analytic_coefficients
from jvarlen.plan.online_refit import OnlineRefit, scale_coefficients
from jvarlen.plan.schedule import gpipe, one_f_one_b, token_level_1f1b

MHA = ModelShape(num_layers=4, d_model=64, num_heads=4, num_kv_heads=4, head_dim=16, mlp_dim=128, vocab_size=100)
GQA = ModelShape(num_layers=4, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, vocab_size=100)


def coeffs(**kw) -> CostCoefficients:
    base = dict(
        fwd=LayerTime(1e-6, 1e-3, 0.1),
        bwd=LayerTime(3e-6, 2e-3, 0.2),
        m_token=100.0,
        bytes_per_element=2,
        dkv_bytes_per_element=4,
        master_bytes_per_param=12.0,
        stage_bytes_per_param=6.0,
        workspace_bytes=1000.0,
        memory_budget=1e9,
    )
    base.update(kw)
    return CostCoefficients(**base)


def test_model_shape_from_config_and_params():
    m = ModelShape.from_config(ModelConfig())
    assert (m.num_layers, m.d_model, m.head_dim, m.kv_dim) == (4, 128, 32, 64)
    # q 128x128, k/v 128x64 each, o 128x128, SwiGLU 3x128x384, two norms
    layer = 128 * 128 * 2 + 2 * 128 * 64 + 3 * 128 * 384 + 2 * 128
    assert m.layer_params == layer
    assert m.param_count == 4 * layer + 320 * 128 + 128  # tied head: final norm only
    assert m.stage_params(0, 2) == 2 * layer + 320 * 128
    assert m.stage_params(1, 2) == 2 * layer + 128 + 320 * 128  # tied matrix held again by the last stage


def test_fwd_time_eq1_hand_computed():
    cm = CostModel(MHA, Layout(1, 2, 2), coeffs())
    chunk = ChunkShape(10, (4, 3))
    # pairs = (10+4)^2 - 10^2 + 3^2 = 105; tokens 7; per layer (1e-6*105 + 1e-3*7)/2 + 0.1
    per_layer = (1e-6 * 105 + 1e-3 * 7) / 2 + 0.1
    assert cm.fwd_time(chunk) == pytest.approx(2 * per_layer, rel=1e-12)
    per_layer_b = (3e-6 * 105 + 2e-3 * 7) / 2 + 0.2
    assert cm.bwd_time(chunk) == pytest.approx(2 * per_layer_b, rel=1e-12)
    assert cm.recompute_time(chunk, 1) == pytest.approx(per_layer, rel=1e-12)  # Eq. 11, one layer
    assert cm.recompute_time(chunk, 0) == 0.0
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        cm.recompute_time(chunk, 3)


def test_quadratic_context_term():
    cm = CostModel(MHA, Layout(1, 1, 1), coeffs(fwd=LayerTime(1.0, 0.0, 0.0)))
    # (C + s)^2 - C^2: a 100-token slice after 1000 tokens of context costs 2*1000*100 + 100^2
    t_ctx = cm.fwd_time(ChunkShape(1000, (100,), tail=False))
    assert t_ctx == pytest.approx(4 * (1100**2 - 1000**2))
    assert t_ctx - cm.fwd_time(ChunkShape(0, (100,))) == pytest.approx(4 * 2 * 1000 * 100)
    # splitting a document into slices keeps the total attention work of the whole document
    whole = cm.fwd_time(ChunkShape(0, (300,)))
    parts = sum(cm.fwd_time(ChunkShape(c, (100,))) for c in (0, 100, 200))
    assert parts == pytest.approx(whole)
    # packing short documents: no cross terms
    assert cm.fwd_time(ChunkShape(0, (100, 200))) == pytest.approx(4 * (100**2 + 200**2))


def test_padding_buckets_and_measured_recompute():
    c = coeffs(fwd=LayerTime(0.0, 1.0, 0.0), recompute=LayerTime(0.0, 1.5, 0.0), token_buckets=(256, 512))
    cm = CostModel(MHA, Layout(1, 1, 1), c)
    assert [cm.linear_tokens(ChunkShape(0, (t,))) for t in (1, 256, 257, 600)] == [256, 256, 512, 600]
    assert cm.fwd_time(ChunkShape(0, (300,))) == pytest.approx(4 * 512)  # matmuls run over the padding
    assert cm.recompute_time(ChunkShape(0, (300,)), 2) == pytest.approx(2 * 1.5 * 512)


def test_last_stage_pays_the_head():
    c = coeffs(head_fwd=LayerTime(0.0, 0.5, 0.0), head_bwd=LayerTime(0.0, 1.0, 0.0))
    cm = CostModel(MHA, Layout(1, 2, 1), c)
    ch = ChunkShape(0, (10,))
    assert cm.fwd_time(ch, stage=1) - cm.fwd_time(ch, stage=0) == pytest.approx(5.0)
    assert cm.bwd_time(ch, stage=1) - cm.bwd_time(ch, stage=0) == pytest.approx(10.0)


def test_alltoall_eq3_hand_computed():
    link = Link(1e6, 1e-3)
    cm = CostModel(GQA, Layout(1, 2, 4), coeffs(alltoall_intra={4: link}))
    # 400 tokens, sp 4: 100 local, 75 sent; q/out: 2 B * 75 * 64, k/v: 2 B * 75 * 32
    per_layer = 2 * (2 * 75 * 64 / 1e6 + 1e-3) + 2 * (2 * 75 * 32 / 1e6 + 1e-3)
    assert cm.alltoall_time(ChunkShape(0, (400,))) == pytest.approx(2 * per_layer)
    assert cm.fwd_time(ChunkShape(0, (400,))) == pytest.approx(
        cm.fwd_compute_time(ChunkShape(0, (400,))) + 2 * per_layer
    )
    assert CostModel(GQA, Layout(1, 2, 1), coeffs()).alltoall_time(ChunkShape(0, (400,))) == 0.0


def test_alltoall_intra_vs_inter_node():
    slow, fast = Link(1e3, 0.0), Link(1e9, 0.0)
    c = coeffs(gpus_per_node=2, alltoall_intra={2: fast}, alltoall_inter={4: slow}, alltoall_default=Link(1.0, 0.0))
    ch = ChunkShape(0, (16,))
    t2 = CostModel(GQA, Layout(1, 1, 2), c).alltoall_time(ch)
    t4 = CostModel(GQA, Layout(1, 1, 4), c).alltoall_time(ch)
    assert t4 > 1000 * t2  # sp 4 spans two 2-GPU nodes: inter-node link
    assert c.alltoall_link(4) is slow and c.alltoall_link(2) is fast


def test_p2p_intra_and_inter_node_boundaries():
    c = coeffs(gpus_per_node=4, p2p_intra=Link(1e9, 0.0), p2p_inter=Link(1e6, 0.0))
    cm = CostModel(GQA, Layout(1, 4, 2), c)
    ch = ChunkShape(0, (100,))
    # devices: stage p holds [2p, 2p+2); node = device // 4
    assert cm.p2p_time(ch, 0) == pytest.approx(2 * 64 * 50 / 1e9)  # devices 0-3, one node
    assert cm.p2p_time(ch, 1) == pytest.approx(2 * 64 * 50 / 1e6)  # devices 2-5 cross nodes
    with pytest.raises(ValueError):
        cm.p2p_time(ch, 3)


def test_activation_memory_eq5_9_10_hand_computed():
    cm = CostModel(MHA, Layout(1, 2, 2), coeffs())  # 2 layers per stage, D = kv_dim = 64
    tail = ChunkShape(0, (100,), tail=True)
    split = ChunkShape(0, (100,), tail=False)
    t = 50  # tokens per device
    assert cm.activation_memory(tail) == pytest.approx(2 * 100 * t)  # Eq. 5 Act only
    dkv = 2 * 4 * 64 * 2 * t  # (1 - I) 2 e_dkv D L_s T/sp
    assert cm.activation_memory(split) == pytest.approx(2 * 100 * t + dkv)
    # Eq. 9/10 with one checkpointed layer: (L_s - 1) Act + M_dkv + (3 - 2I) e D T/sp
    assert cm.activation_memory(tail, 1) == pytest.approx(100 * t + 1 * 2 * 64 * t)
    assert cm.activation_memory(split, 1) == pytest.approx(100 * t + dkv + 3 * 2 * 64 * t)
    assert cm.activation_memory(split, 2) == pytest.approx(dkv + 2 * 3 * 2 * 64 * t)
    with pytest.raises(ValueError):
        cm.activation_memory(tail, 3)
    gqa = CostModel(GQA, Layout(1, 2, 2), coeffs())  # GQA: K/V are kv_dim = 32 wide
    assert gqa.activation_memory(split, 2) == pytest.approx(2 * 4 * 32 * 2 * t + 2 * 2 * (64 + 2 * 32) * t)


def test_the_head_holds_one_tile_of_logits(monkeypatch):
    """The last stage's head: ``m_head_token / V`` (``(4 + e)``: fp32 logits, their gradient in the
    compute dtype) per logit of one tile (``jvarlen.head_tiles``), the device's ``T/sp`` tokens
    over ``V`` columns whole, the chunk's ``T`` tokens over ``V/sp`` columns split by vocabulary;
    with more than one tile the fp32 sum of the head's gradient, ``4 · d · columns``; per token the
    outputs' gradient (``e · d``), split the gathered outputs and their fp32 gradient (``(e + 4) · d``)."""
    c = coeffs(m_head_token=6.0 * MHA.vocab_size)
    chunk = ChunkShape(0, (200,), tail=True)
    split = CostModel(MHA, Layout(1, 2, 2), c)  # sp = 2 divides the vocabulary (100)
    odd = CostModel(dataclasses.replace(MHA, vocab_size=99), Layout(1, 2, 2), c)
    assert split.splits_vocab and not odd.splits_vocab
    d = MHA.d_model
    assert split.head_memory(chunk) == pytest.approx(6 * 200 * 50 + 6 * d * 200)  # one tile: 200 tokens, 50 columns
    assert odd.head_memory(chunk) == pytest.approx(6 * 100 / 99 * 100 * 99 + 2 * d * 100)  # 100 tokens per device
    # on the last stage only
    assert split.activation_memory(chunk, 0, 1) - split.activation_memory(chunk, 0, 0) == pytest.approx(
        split.head_memory(chunk)
    )
    fused = CostModel(MHA, Layout(2, 1, 2), c)  # the fused data-parallel step keeps the head whole
    assert not fused.splits_vocab and fused.head_memory(chunk) == pytest.approx(6 * 100 * 100 + 2 * d * 100)
    monkeypatch.setattr(head_tiles, "LOGITS_TILE_BYTES", 4 * 10 * 100)  # ten rows of 100 fp32 logits
    # one tile while the logits are at most a tile's and the gradient sum's (10 + 64 rows of 100)
    assert fused.head_memory(ChunkShape(0, (148,), tail=True)) == pytest.approx(6 * 74 * 100 + 2 * d * 74)
    many = 6 * 10 * 100 + 4 * d * 100
    assert fused.head_memory(chunk) == pytest.approx(many + 2 * d * 100)  # 10 tiles of 10 rows
    assert split.head_memory(chunk) == pytest.approx(6 * 20 * 50 + 4 * d * 50 + 6 * d * 200)  # 10 of 20
    # 105 tokens per device: 11 tiles, of 105/11 rows in the planner's account (its rows are T/sp, not whole)
    assert fused.head_memory(ChunkShape(0, (210,), tail=True)) == pytest.approx(
        6 * 105 / 11 * 100 + 4 * d * 100 + 2 * d * 105
    )


def rest_bytes(shape: ModelShape, shards: int = 1) -> tuple[float, float]:
    """What the pipeline executor holds of the rest per device by dtype, with a bf16 compute dtype
    and fp32 parameters: (the embedding table and the final norm in fp32, copy 4 + accumulator 4;
    an untied head in bf16, copy 2 + accumulator 4; one op's gradient of it in the copy's dtypes),
    the table and head split over ``shards`` devices by vocabulary (the stage's sp; a device
    group's copy too: each device keeps its rows of the pulled copy)."""
    fp32 = shape.embed_params / shards + shape.d_model
    bf16 = 0 if shape.tie_embeddings else shape.vocab_size * shape.d_model / shards
    copy = 4 * fp32 + 2 * bf16
    return copy + 4 * fp32 + 4 * bf16, copy


def test_model_state_memory_hand_computed():
    cm = CostModel(MHA, Layout(2, 2, 2), coeffs())
    p = MHA.param_count
    layers = MHA.num_layers // 2 * MHA.layer_params
    held = rest_bytes(MHA, shards=2)[0]  # split over sp = 2 by vocabulary
    # the executor runs one program on every stage: each holds the whole rest, not its own part of it,
    # and the layer its pass over the stage's two layers has sliced out of the stack (2 bytes each)
    sliced = 2 * MHA.layer_params
    for stage in (0, 1):
        assert cm.model_state_memory(stage) == pytest.approx(12 * p / 8 + 6 * layers + held + sliced + 1000)
    # one layer per stage: XLA removes the loop, nothing is sliced
    one = cm.with_layout(Layout(1, 4, 2), state_devices=8)
    assert one.model_state_memory(0) == pytest.approx(12 * p / 8 + 6 * MHA.layer_params + held + 1000)
    with pytest.raises(ValueError):
        cm.model_state_memory(2)
    # a fused data-parallel step (pp = 1, no group) holds the whole model at 6 bytes per parameter
    fused = cm.with_layout(Layout(8, 1, 1))
    assert fused.model_state_memory(0) == pytest.approx(12 * p / 8 + 6 * p + 1000)
    # ZeRO-3 over the sp group and the dp pipelines: the compute copy and gradients of the stage's
    # decoder layers are 1/(dp·sp) per device (embedding and head whole), plus two whole layers
    # in flight (2 bytes each), the previous layer's gradient before its deferred reduce-scatter
    # (2 bytes) and one layer's gradient as it is reduced (4 bytes), in every layout derived from
    # it (padded, other schemes' layouts)
    in_flight = (3 * 2 + 4) * MHA.layer_params
    z = CostModel(MHA, Layout(2, 2, 2), coeffs(), stage_weights_sharded=True)
    for stage in (0, 1):
        assert z.model_state_memory(stage) == pytest.approx(12 * p / 8 + 6 * layers / 4 + held + in_flight + 1000)
    assert z.padded(64).model_state_memory(1) == pytest.approx(z.model_state_memory(1))
    z4 = z.with_layout(Layout(1, 2, 4), state_devices=8)
    held4 = rest_bytes(MHA, shards=4)[0]
    assert z4.model_state_memory(0) == pytest.approx(12 * p / 8 + 6 * layers / 4 + held4 + in_flight + 1000)
    # one layer per stage: that layer gathered and its gradient (2 bytes each), nothing ahead or late
    z_one = z.with_layout(Layout(1, 4, 2), state_devices=8)
    held2 = rest_bytes(MHA, shards=2)[0]
    one_layer = 2 * 2 * MHA.layer_params
    assert z_one.model_state_memory(0) == pytest.approx(
        12 * p / 8 + 6 * MHA.layer_params / 2 + held2 + one_layer + 1000
    )
    # one device per stage: nothing to shard, nothing gathered
    z1 = z.with_layout(Layout(1, 2, 1), state_devices=8)
    assert z1.model_state_memory(0) == pytest.approx(cm.with_layout(Layout(1, 2, 1), 8).model_state_memory(0))
    from jvarlen.plan.strategy import Scheme, SchemeCosts

    scheme = SchemeCosts(z, 8).cost(Scheme(pp=2, sp=4))  # a device group's: the rest on every stage
    assert scheme.model_state_memory(0) == pytest.approx(z4.replace(group=True).model_state_memory(0))


def test_the_executor_backward_holds_its_layer_gradients_until_they_are_accumulated():
    """The pipeline executor's backward returns its stage's layer gradients before adding them to
    the accumulator: ``e · L_s · layer params`` per device in the compute dtype, with sharded stage
    weights the reduce-scattered ``1/(dp·sp)`` in the accumulator's dtype; the fused step's peak has
    no such copy."""
    c = coeffs(m_work_token=500.0)  # a bf16 copy and an fp32 accumulator: e = 2, 6 bytes per parameter
    cm = CostModel(MHA, Layout(2, 2, 2), c)
    stage_layers = MHA.num_layers // 2 * MHA.layer_params
    rest = rest_bytes(MHA)[1]  # and its gradient of the rest, allocated on every stage
    split = rest_bytes(MHA, shards=2)[1]  # (its 1/sp split by vocabulary)
    assert cm.layer_gradient_memory() == pytest.approx(c.bytes_per_element * stage_layers + split)
    sharded = CostModel(MHA, Layout(2, 2, 2), c, stage_weights_sharded=True)
    accumulator = c.stage_bytes_per_param - c.bytes_per_element
    assert sharded.layer_gradient_memory() == pytest.approx(accumulator * stage_layers / 4 + split)
    alone = CostModel(MHA, Layout(1, 2, 1), c, stage_weights_sharded=True)  # nothing to shard over
    assert alone.layer_gradient_memory() == pytest.approx(c.bytes_per_element * stage_layers + rest)
    # a fused data-parallel step returns no op's gradients; a device group with one stage does
    fused = CostModel(MHA, Layout(8, 1, 1), c)
    assert fused.layer_gradient_memory() == pytest.approx(c.bytes_per_element * MHA.num_layers * MHA.layer_params)
    assert fused.replace(group=True).layer_gradient_memory() == pytest.approx(fused.layer_gradient_memory() + rest)
    ch = ChunkShape(0, (1024,))
    assert cm.backward_memory(ch, 1) == pytest.approx(cm.working_memory(ch, 1) + cm.layer_gradient_memory())
    assert cm.peak_memory(ch, 1, 0) == pytest.approx(cm.activation_memory(ch, 1, 0) + cm.working_memory(ch, 1))


@pytest.mark.parametrize("backend, per_layer", [("gpu", True), ("analytic", True), ("cpu", False), ("", False)])
def test_a_gpu_backward_holds_one_layers_gradients(backend, per_layer):
    """Off XLA:CPU, with its stage weights whole on each device, the executor's backward adds each
    layer's gradients into the accumulator as it descends (``StageProgram.per_layer``): one layer's
    ``e · layer params`` is held, not the stage's stack. Coefficients of no named backend are
    charged the stack; sharded stage weights keep their stacked reduce-scattered gradients."""
    c = coeffs(m_work_token=500.0)
    c = c.replace(meta=dataclasses.replace(c.meta, backend=backend))
    cm = CostModel(MHA, Layout(2, 2, 2), c)
    assert cm.executor_per_layer == per_layer
    stage_layers = MHA.num_layers // 2 * MHA.layer_params
    held = MHA.layer_params if per_layer else stage_layers
    split = rest_bytes(MHA, shards=2)[1]
    assert cm.layer_gradient_memory() == pytest.approx(c.bytes_per_element * held + split)
    sharded = CostModel(MHA, Layout(2, 2, 2), c, stage_weights_sharded=True)
    accumulator = c.stage_bytes_per_param - c.bytes_per_element
    assert not sharded.executor_per_layer
    assert sharded.layer_gradient_memory() == pytest.approx(accumulator * stage_layers / 4 + split)
    alone = CostModel(MHA, Layout(1, 2, 1), c, stage_weights_sharded=True)  # nothing to shard over: whole
    assert alone.executor_per_layer == per_layer


@pytest.mark.parametrize("backend", ["gpu", "analytic"])
def test_a_group_step_on_a_gpu_holds_two_attention_accumulators_again(backend):
    """A device group's GPU step that adds each layer's gradients as it descends returns its
    accumulators, and XLA carries two of them (``wq``- and ``wo``-shaped) in the matmuls' layout and
    transposes them into the outputs at the end: ``2 · L_s · d · H·D`` more accumulator bytes in the
    model states than the same group on XLA:CPU (measured in the deviceless H100 compile,
    docs/benchmarks.md). Not for a pipeline step (it applies its update), nor where the coefficients
    charge no accumulator per parameter (ZeRO-3 stand-ins: ``stage_bytes_per_param`` below ``e``)."""

    def model_states(backend, group, **changes):
        c = coeffs(**changes)
        c = c.replace(meta=dataclasses.replace(c.meta, backend=backend))
        return CostModel(MHA, Layout(2, 2, 2), c, group=group).model_state_memory(0)

    c = coeffs()
    relayout = 2 * (MHA.num_layers // 2) * MHA.d_model * MHA.num_heads * MHA.head_dim
    relayout *= c.stage_bytes_per_param - c.bytes_per_element
    assert model_states(backend, True) - model_states("cpu", True) == pytest.approx(relayout)
    assert model_states(backend, False) == pytest.approx(model_states("cpu", False))
    zero3 = {"stage_bytes_per_param": 6 / 64}
    assert model_states(backend, True, **zero3) == pytest.approx(model_states("cpu", True, **zero3))


@pytest.mark.parametrize("in_flight", [1, 3])
def test_max_tokens_is_the_largest_fitting_chunk(in_flight):
    c = coeffs(memory_budget=5e7, m_head_token=40.0, m_work_token=500.0, m_work_remat_token=700.0)
    cm = CostModel(MHA, Layout(1, 2, 2), c)
    n = cm.max_tokens(in_flight=in_flight)
    assert n > 0

    def fits(tokens, stage):  # in_flight chunks of activations, one of them in its backward
        ch = ChunkShape(0, (tokens,), tail=False)
        act = in_flight * cm.activation_memory(ch, 2, stage)
        return cm.model_state_memory(stage) + act + cm.backward_memory(ch, 2) <= cm.memory_budget

    assert all(fits(n, s) for s in range(2))
    assert not all(fits(n + 2, s) for s in range(2))  # tokens per device step in units of 1/sp
    assert cm.max_tokens(stage=0, in_flight=in_flight) >= n
    assert CostModel(MHA, Layout(1, 2, 2), coeffs(memory_budget=10.0)).max_tokens() == 0


def test_coefficients_json_round_trip(tmp_path):
    c = coeffs(
        per_sp={2: (LayerTime(1, 2, 3), LayerTime(4, 5, 6))},
        alltoall_intra={2: Link(1e9, 1e-5)},
        alltoall_inter={16: Link(5e9, 2e-5)},
        recompute=LayerTime(7, 8, 9),
        token_buckets=(256, 512),
        attention_block=128,
    )
    path = tmp_path / "p.json"
    c.save(path)
    back = CostCoefficients.load(path)
    assert back == c
    assert math.isinf(back.p2p_intra.bandwidth)
    assert back.layer_times(2) == (LayerTime(1, 2, 3), LayerTime(4, 5, 6))
    assert "analytic" in path.read_text()
    assert profile_filename(MHA, "cpu", "TFRT_CPU 0").endswith("__cpu__tfrt_cpu_0.json")


def test_fit_layer_time_recovers_coefficients_from_noisy_timings():
    rng = np.random.default_rng(0)
    true = LayerTime(2e-9, 3e-6, 4e-4)
    sp = 2
    shapes = [
        ChunkShape(int(c), (int(s),))
        for c, s in zip(rng.choice([0, 512, 2048, 8192], 120), rng.integers(64, 4096, 120))
    ]
    pairs = [c.attention_pairs for c in shapes]
    tokens = [c.tokens for c in shapes]
    times = [true(p, t, sp) * (1 + 0.02 * rng.standard_normal()) for p, t in zip(pairs, tokens)]
    got = fit_layer_time(pairs, tokens, times, sp)
    assert got.alpha1 == pytest.approx(true.alpha1, rel=0.05)
    assert got.alpha2 == pytest.approx(true.alpha2, rel=0.05)
    assert got.beta1 == pytest.approx(true.beta1, rel=0.10)
    # a model without the quadratic term cannot explain the data
    lin = fit_layer_time(np.zeros(len(pairs)), tokens, times, sp)
    err_lin = np.median([abs(lin(p, t, sp) - y) / y for p, t, y in zip(pairs, tokens, times)])
    err = np.median([abs(got(p, t, sp) - y) / y for p, t, y in zip(pairs, tokens, times)])
    assert err < 0.03 < err_lin


def test_fit_link_and_linear():
    rng = np.random.default_rng(1)
    nbytes = rng.uniform(1e3, 1e8, 60)
    times = (nbytes / 2e10 + 5e-5) * (1 + 0.01 * rng.standard_normal(60))
    link = fit_link(nbytes, times)
    assert link.bandwidth == pytest.approx(2e10, rel=0.03)
    assert link.latency == pytest.approx(5e-5, rel=0.1)
    slope, icpt = fit_linear([1, 2, 3, 4], [12, 22, 32, 42])
    assert (slope, icpt) == (pytest.approx(10), pytest.approx(2))


def test_analytic_profiles_are_labelled_and_follow_flops():
    llama7b = ModelShape(32, 4096, 32, 32, 128, 11008, 32000, tie_embeddings=False)
    for name, spec in CLUSTERS.items():
        c = analytic_coefficients(llama7b, name, num_nodes=2)
        assert c.meta.analytic and c.meta.backend == "analytic" and c.meta.device_kind == spec.device_kind
        assert c.fwd.alpha2 == pytest.approx(
            llama7b.layer_linear_flops_per_token / (spec.peak_flops * spec.matmul_efficiency)
        )
        assert c.memory_budget == pytest.approx(spec.hbm_bytes * spec.memory_margin)
        assert c.alltoall_link(8).bandwidth > c.alltoall_link(16).bandwidth  # NVLink beats the network
    a800 = CostModel(llama7b, Layout(1, 2, 8), analytic_coefficients(llama7b, "a800", 2))
    # 7B forward on 4K tokens: ~2 * 6.5e9 * 4096 FLOPs at 312 TF/s * 0.55 over 8 GPUs, ~40 ms per GPU stage pair
    t = sum(a800.fwd_compute_time(ChunkShape(0, (4096,)), s) for s in range(2))
    assert 0.03 < t < 0.06
    assert analytic_coefficients(llama7b, "h200").memory_budget > analytic_coefficients(llama7b, "h100").memory_budget


def test_shipped_analytic_profiles_load():
    files = sorted((pathlib.Path(__file__).parent.parent / "jvarlen" / "profiles").glob("*analytic*.json"))
    assert len(files) >= 3
    kinds = set()
    for f in files:
        c = CostCoefficients.load(f)
        assert c.meta.analytic is True
        kinds.add(c.meta.device_kind)
    assert any("A800" in k for k in kinds) and any("H100" in k for k in kinds) and any("H200" in k for k in kinds)


def test_online_refit_recovers_scaled_truth():
    model = GQA
    base = coeffs(step_overhead=0.05, alltoall_intra={2: Link(1e5, 1e-3)}, p2p_intra=Link(1e6, 1e-3))
    truth = scale_coefficients(base, {"alpha1": 1.5, "alpha2": 0.7, "beta1": 1.2, "comm": 2.0, "overhead": 3.0})
    rng = np.random.default_rng(2)
    refit = OnlineRefit(model, base, every=12, mode="async")
    oracle = OnlineRefit(model, truth, mode="async")
    for i in range(12):
        layout = Layout(1, 2, 2) if i % 2 else Layout(1, 1, 2)
        n = int(rng.integers(2, 5))
        shapes = [ChunkShape(int(rng.choice([0, 300])), (int(rng.integers(50, 600)),), tail=True) for _ in range(n)]
        sched = one_f_one_b(n, layout.pp) if i % 3 else token_level_1f1b([-1] + list(range(n - 1)), layout.pp)
        measured = oracle.predict(shapes, layout, sched)
        pred = refit.observe(shapes, layout, measured, schedule=sched)
        assert pred == pytest.approx(refit.predict(shapes, layout, sched))
    before = np.median(refit.relative_errors())
    assert refit.due()
    refit.refit()
    after = np.median(
        [abs(refit.predict(o.chunk_shapes, o.layout, o.schedule) - o.measured_s) / o.measured_s for o in refit.history]
    )
    assert before > 0.1
    assert after < 0.01
    assert not refit.due()


def test_tick_overhead_recovered_from_simulated_steps():
    """Steps 'measured' by the simulator with known executor costs, a tick overhead (a constant, a
    part per bucket token and a part per context token) and a recomputation factor (plus ±1 %
    noise), give all four back; the critical path's tick count is what the paired simulator
    charges. Chunks of 100-1,500 tokens (buckets 128 to 1,536); in two steps of three the first
    chunk is a slice of a split document with 200-3,000 tokens of context; every other step
    recomputes 0-2 layers per chunk and stage (the profile's own ``recompute`` is 0 here, as the
    CPU profile's fused-program measurement is)."""
    from jvarlen.plan.simulator import simulate

    layout = Layout(1, 2, 1)
    fast = dict(fwd=LayerTime(1e-7, 1e-4, 0.01), bwd=LayerTime(3e-7, 2e-4, 0.02), recompute=LayerTime(0.0, 0.0, 0.0))
    overhead = dict(tick_overhead=0.03, tick_token_overhead=4e-5, tick_context_overhead=1e-5, tick_recompute_factor=0.6)
    rng = np.random.default_rng(5)
    terms, measured = [], []
    for i in range(16):
        n = int(rng.integers(2, 9))
        shapes = [ChunkShape(0, (int(rng.integers(100, 1500)),)) for _ in range(n)]
        if i % 3:
            shapes[0] = ChunkShape(int(rng.integers(200, 3000)), shapes[0].slices, tail=bool(i % 2))
        sched = gpipe(n, 2) if i % 2 else one_f_one_b(n, 2)
        ckpt = rng.integers(0, 3, size=(n, 2)) if i % 2 else None
        truth = CostModel(GQA, layout, coeffs(**overhead, **fast))
        true_t = simulate(sched, shapes, ckpt, truth, "paired").iteration_time
        row = tick_overhead_terms(sched, shapes, ckpt, CostModel(GQA, layout, coeffs(**fast)))
        base, ticks, tick_tokens, tick_context, recomputed = row
        bucket = executor_buckets(max(c.tokens for c in shapes))[0]
        assert tick_tokens == pytest.approx(ticks * bucket)
        assert tick_context == pytest.approx(ticks * executor_context(shapes, bucket))
        assert (tick_context > 0) == (i % 3 > 0)
        assert (recomputed > 0) == (ckpt is not None and bool(ckpt.any()))
        if ckpt is None:  # linear in the tick terms (recomputation may move the critical path)
            assert base + np.dot(list(overhead.values()), row[1:]) == pytest.approx(true_t, rel=1e-9)
        assert ticks == pytest.approx(round(ticks)) and ticks >= n + 1  # every tick of the table
        terms.append(row)
        measured.append(true_t * (1 + rng.uniform(-0.01, 0.01)))
    fitted = fit_tick_overhead(terms, measured)
    assert fitted == pytest.approx(tuple(overhead.values()), rel=0.3)
    without = [t for t, c in zip(terms, range(16)) if c % 2 == 0]  # no step recomputes: factor stays 0
    assert fit_tick_overhead(without, [measured[i] for i in range(0, 16, 2)])[3] == 0.0
    nothing_unexplained = fit_tick_overhead(terms, [t[0] for t in terms])
    assert nothing_unexplained == pytest.approx((0.0, 0.0, 0.0, 0.0), abs=1e-12)
    with pytest.raises(ValueError):
        fit_tick_overhead(terms[:1], measured[:1])
    # a subset of the terms: the others stay 0, and the fitted ones take what they can explain
    three = ("tick_overhead", "tick_token_overhead", "tick_recompute_factor")
    assert fit_tick_overhead(terms, measured, fit=three)[2] == 0.0
    no_context_cost = [m - overhead["tick_context_overhead"] * t[3] for m, t in zip(measured, terms)]
    refitted = fit_tick_overhead(terms, no_context_cost, fit=three)
    assert refitted == pytest.approx((*list(overhead.values())[:2], 0.0, overhead["tick_recompute_factor"]), rel=0.3)
    with pytest.raises(ValueError, match="fit must name"):
        fit_tick_overhead(terms, measured, fit=("tick_bogus",))


def test_executor_recomputation_is_charged_in_the_lock_step_models_only():
    """``tick_recompute_factor`` adds that many forwards of each recomputed layer to the
    lock-step (executor) simulations and to EPP's checkpointing weights, not to the async model."""
    from jvarlen.plan.checkpointing import MemoryTable
    from jvarlen.plan.simulator import simulate

    layout = Layout(1, 2, 1)
    chunk = ChunkShape(0, (512,))
    plain = CostModel(GQA, layout, coeffs(recompute=LayerTime(0.0, 0.0, 0.0)))
    fitted = CostModel(GQA, layout, coeffs(recompute=LayerTime(0.0, 0.0, 0.0), tick_recompute_factor=0.5))
    assert plain.executor_recompute_time(chunk, 2) == plain.recompute_time(chunk, 2) == 0.0
    assert fitted.executor_recompute_time(chunk, 2) == pytest.approx(2 * 0.5 * fitted.layer_fwd_compute(chunk))
    assert MemoryTable.build([chunk], fitted, 2).rec1.tolist() == [fitted.executor_recompute_time(chunk, 1)]
    ckpt = np.full((3, 2), 2)
    for mode in ("ticks", "paired"):
        r = simulate(one_f_one_b(3, 2), [chunk] * 3, ckpt, fitted, mode)
        assert r.stage_recompute.tolist() == pytest.approx([3 * fitted.executor_recompute_time(chunk, 2)] * 2)
    assert simulate(one_f_one_b(3, 2), [chunk] * 3, ckpt, fitted).stage_recompute.tolist() == [0.0, 0.0]


def test_one_stage_pays_none_of_the_multi_stage_executors_terms():
    """The executor terms are fitted on multi-stage steps; one stage runs each chunk's forward and
    backward as one op, priced by the whole-model calibration: its paired simulation of one chunk
    is that chunk's forward + backward + step overhead, whatever the tick terms say."""
    from jvarlen.plan.simulator import simulate

    chunk = ChunkShape(0, (600,))
    terms = dict(tick_overhead=0.03, tick_token_overhead=4e-5, tick_context_overhead=1e-5, tick_recompute_factor=0.6)
    base = coeffs(token_buckets=(512, 1024), bucket_token_scale={1: {1024: 2.0}})
    one = CostModel(GQA, Layout(1, 1, 1), base.replace(**terms, executor_bucket_scale=False)).padded(1024)
    plain = CostModel(GQA, Layout(1, 1, 1), base).padded(1024)
    assert one.tick_overhead(2048) == 0.0 and one.time_tokens(chunk) == plain.time_tokens(chunk) == 2048.0
    assert one.executor_recompute_time(chunk, 2) == plain.recompute_time(chunk, 2)
    for mode in ("paired", "ticks"):
        t = simulate(one_f_one_b(1, 1), [chunk], None, one, mode).iteration_time
        assert t == pytest.approx(one.fwd_time(chunk, 0) + one.bwd_time(chunk, 0) + one.step_overhead())
    two = CostModel(GQA, Layout(1, 2, 1), base.replace(**terms)).padded(1024)
    assert two.tick_overhead(2048) == pytest.approx(0.03 + 4e-5 * 1024 + 1e-5 * 2048)


@pytest.mark.parametrize(
    "chunk",
    [
        ChunkShape(0, (512,)),
        ChunkShape(0, (96,) * 8),
        ChunkShape(300, (200,), tail=False),
        ChunkShape(1500, (700, 100, 37), tail=True),
        ChunkShape(0, (130, 1, 250)),
    ],
)
def test_tile_pairs_matches_the_harness_layout(chunk):
    """tile_pairs counts exactly the tiles a block-skipping kernel visits for the profiler's layout."""
    from jvarlen.plan.chunk import tile_pairs
    from jvarlen.profile.harness import bucket, chunk_metadata

    b = 128
    tb, cb = bucket(chunk.tokens, (256, 512, 1024)), bucket(chunk.context, (0, 2048))
    m = chunk_metadata(chunk, tb, cb)
    qs, qp, ks, kp = (m[k][0] for k in ("seg", "pos", "kv_seg", "kv_pos"))
    vis = (qs[:, None] == ks[None, :]) & (qs[:, None] > 0) & (kp[None, :] <= qp[:, None])
    tiles = vis.reshape(tb // b, b, (cb + tb) // b, b).any(axis=(1, 3)).sum()
    assert tile_pairs(chunk, b) == 2 * b * b * tiles
    assert (qs > 0).sum() == chunk.tokens and (ks > 0).sum() == chunk.tokens + chunk.context


def test_joint_layer_program_fit_recovers_per_layer_coefficients():
    """fit_layer_programs separates per-layer cost from per-call overhead on noisy program times."""
    from jvarlen.plan.cost_fit import fit_layer_programs
    from jvarlen.plan.cost_fit import parse_chunk as _parse_chunk

    rng = np.random.default_rng(3)
    true, c1, c0 = LayerTime(2e-8, 3e-6, 1e-4), 5e-7, 2e-3
    rows = []
    for _ in range(80):
        p, t = float(rng.integers(1, 40) * 32768), float(rng.choice([512, 1024, 2048]))
        for n in (2, 3):
            rows.append((n, p, t, (n * true(p, t) + c1 * t + c0) * (1 + 0.02 * rng.standard_normal())))
    got, (g1, g0) = fit_layer_programs(rows)
    assert got.alpha1 == pytest.approx(true.alpha1, rel=0.1)
    assert got.alpha2 == pytest.approx(true.alpha2, rel=0.2)
    assert g0 + got.beta1 * 2 == pytest.approx(c0 + true.beta1 * 2, rel=0.3)
    assert _parse_chunk(str(ChunkShape(12, (3, 4), tail=False))) == ChunkShape(12, (3, 4), tail=False)


def test_shipped_measured_profile_is_labelled():
    path = pathlib.Path(__file__).parent.parent / "jvarlen" / "profiles" / "measured"
    f = path / profile_filename(ModelShape.from_config(ModelConfig()), "cpu", "cpu")
    c = CostCoefficients.load(f)
    assert c.meta.analytic is False and c.meta.backend == "cpu"
    assert c.token_buckets and c.attention_block == 128 and c.fwd.alpha1 > 0 and c.bwd.alpha1 > 0
    # timed on the one-core clock, in reference units: the reading is its own report's calibration
    from jvarlen.profile.fit import reference_reading
    from jvarlen.profile.harness import REFERENCE_PROBE

    report = json.loads(f.with_suffix(".report.json").read_text())
    assert "pinned to one core" in report["clock"]
    assert c.meta.reference_s > 0 and c.meta.reference_s == reference_reading(report)
    assert c.meta.reference_probe == REFERENCE_PROBE
    assert c.meta.reference_calls == report["calibration_rounds"]  # the statistic a reading beside it must be


def test_step_overhead_syncs_the_largest_stage():
    c = coeffs(step_overhead=0.5, sync_bytes_per_param=6.0, sync_link=Link(1e6, 0.01))
    cm = CostModel(MHA, Layout(1, 2, 1), c)
    big = max(MHA.stage_params(p, 2) for p in range(2))
    assert cm.step_overhead() == pytest.approx(0.5 + 6 * big / 1e6 + 0.01)
    assert CostModel(MHA, Layout(1, 1, 1), c).step_overhead() > cm.step_overhead()  # pp=1 holds everything


def test_a_device_group_syncs_its_stages_layers_and_the_rest_of_the_model():
    """The groups' pull and push (jvarlen/parallel/groups.py) move each device's stage layers and the
    embedding and head to every device, and a group of smaller stages moves as many layers as the
    iteration's largest stage: the strategy's predicted time charges that padding."""
    from types import SimpleNamespace

    from jvarlen.plan.strategy import GroupPlan, Scheme, SchemeCosts, predicted_time

    c = coeffs(step_overhead=0.5, sync_bytes_per_param=6.0, sync_link=Link(1e6, 0.01))
    untied = dataclasses.replace(MHA, tie_embeddings=False)
    costs = SchemeCosts(CostModel(untied, Layout(1, 1, 1), c), 8)
    rest = untied.embed_params + untied.head_params
    assert untied.embed_params > 0 and untied.head_params > untied.embed_params  # untied: both move

    def sync(layers):
        return 6 * (layers * untied.layer_params + rest) / 1e6 + 0.01

    pipeline = costs.cost(Scheme(2, 1))
    assert pipeline.step_overhead() == pytest.approx(0.5 + sync(2))
    assert pipeline.sync_time(4) == pytest.approx(sync(4))
    # the pipeline strategy's own stages: the largest one (the head's), not the embedding too
    assert CostModel(untied, Layout(1, 2, 1), c).step_overhead() == pytest.approx(
        0.5 + 6 * (2 * untied.layer_params + untied.head_params) / 1e6 + 0.01
    )
    assert costs.cost(Scheme(1, 1)).step_overhead() == pytest.approx(0.5 + sync(4))  # pp = 1: everything

    def group(scheme, devices, seconds):  # a group whose plan's simulated time is ``seconds``
        return GroupPlan(scheme, devices, (0,), SimpleNamespace(stats={"iteration_time_s": seconds}))

    two = [group(Scheme(2, 1), (0, 1), 3.0), group(Scheme(2, 1), (2, 3), 2.0)]
    assert predicted_time(two, costs) == 3.0  # stages alike: nothing padded
    mixed = [group(Scheme(1, 1), (0,), 3.0), group(Scheme(2, 1), (2, 3), 2.99)]
    assert predicted_time(mixed, costs) == pytest.approx(2.99 + sync(4) - sync(2))  # pads to 4 layers


def test_every_device_of_a_group_holds_the_embedding_and_the_head():
    """The groups' pull hands every device of a device group the rest of the model (embedding,
    final norm, head) with its stage's layers, and each returns their gradients: the memory account
    charges them on every stage, in the dtypes the pull hands them in (an untied head in the
    compute dtype, the embedding in fp32), the copy, their accumulators and an op's gradient
    split by vocabulary over sp; with sharded stage weights only the decoder layers shrink."""
    untied = dataclasses.replace(MHA, tie_embeddings=False)
    p, layers = untied.param_count, untied.num_layers // 2 * untied.layer_params
    held = rest_bytes(untied, shards=2)[0]  # split by vocabulary over sp = 2, the copy too
    whole = rest_bytes(untied)[0]
    assert whole == 8 * (untied.embed_params + untied.d_model) + 6 * untied.vocab_size * untied.d_model
    pipeline = CostModel(untied, Layout(2, 2, 2), coeffs())
    group = pipeline.replace(group=True)
    sliced = 2 * untied.layer_params  # the layer the executor's pass slices out of the stacked stage
    for stage in (0, 1):
        assert group.model_state_memory(stage) == pytest.approx(12 * p / 8 + 6 * layers + held + sliced + 1000)
        # the pipeline strategy's executor splits the table and head by vocabulary over sp = 2 alike
        assert pipeline.model_state_memory(stage) == pytest.approx(group.model_state_memory(stage))
    one_stage = CostModel(untied, Layout(2, 1, 4), coeffs())  # a fused step: the whole model at 6 bytes
    assert one_stage.replace(group=True).model_state_memory(0) == pytest.approx(
        one_stage.model_state_memory(0)
        - 6 * (p - untied.num_layers * untied.layer_params)
        + rest_bytes(untied, shards=4)[0]
        + sliced
    )
    in_flight = (3 * 2 + 4) * untied.layer_params
    sharded = group.with_stage_weights(True)
    assert sharded.model_state_memory(1) == pytest.approx(12 * p / 8 + 6 * layers / 4 + held + in_flight + 1000)
    from jvarlen.plan.strategy import Scheme, SchemeCosts

    # the schemes a strategy policy prices are groups: every stage of theirs charges the rest
    scheme = SchemeCosts(CostModel(untied, Layout(1, 1, 1), coeffs()), 8).cost(Scheme(pp=2, sp=4))
    assert scheme.model_state_memory(0) == pytest.approx(scheme.model_state_memory(1))


def test_the_account_charges_a_share_of_the_vocabulary():
    """The memory account (``memory_floor``) charges 1/sp of the table and head on every stage of
    the pipeline strategy where sp divides the vocabulary (the executor splits them by vocabulary,
    jvarlen/parallel/pipeline/rest.py), the whole of them where it does not; so does a device
    group's (each device keeps its rows of the pulled copy)."""
    untied = dataclasses.replace(MHA, tie_embeddings=False)  # vocabulary 100
    odd = dataclasses.replace(untied, vocab_size=99)
    held = rest_bytes(untied)[0] - 8 * untied.d_model  # the table and head; the norm is never split
    copy = rest_bytes(untied)[1] - 4 * untied.d_model  # their copy, and one op's gradient, in the same dtypes

    def floor(model, layout, group=False):
        return CostModel(model, layout, coeffs(), state_devices=8, group=group).memory_floor(0)

    for sp in (2, 4):
        layout, one = Layout(1, 2, sp), Layout(1, 2, 1)  # sp = 1: whole
        # the copy and accumulator between ops and one op's gradient (rest_bytes' second term) at 1/sp,
        # in the pipeline strategy and in a group
        assert floor(untied, one) - floor(untied, layout) == pytest.approx((held + copy) * (1 - 1 / sp))
        assert floor(untied, one, True) - floor(untied, layout, True) == pytest.approx((held + copy) * (1 - 1 / sp))
        assert floor(odd, layout) == pytest.approx(floor(odd, one))  # 99: nothing split
        assert floor(odd, layout, True) == pytest.approx(floor(odd, one, True))


@pytest.mark.parametrize("layout", [Layout(1, 2, 2), Layout(2, 1, 2), Layout(2, 1, 4)], ids=str)
@pytest.mark.parametrize("tile_rows", [None, 7, 40])
def test_the_head_lines_bound_it_for_every_chunk(monkeypatch, layout, tile_rows):
    """``head_memory_lines``: every line bounds the head from above up to its limit, the lowest
    ``per`` from below (the capacity searches divide a chunk's memory by its tokens; the tiled
    head is not linear in them); the head is subadditive in the tokens. Split (sp = 2 divides 100) and whole (a fused step); one tile, tiles of 7 or 40
    rows of 100 or 50 columns."""
    cm = CostModel(MHA, layout, coeffs(m_head_token=6.0 * MHA.vocab_size))
    if tile_rows:
        monkeypatch.setattr(head_tiles, "LOGITS_TILE_BYTES", 4 * tile_rows * 100)
    lines = cm.head_memory_lines()
    lowest = min(per for _, per, _ in lines)
    tiled = False
    for tokens in range(1, 1500):
        head = cm.head_memory(ChunkShape(0, (tokens,), tail=True))
        assert lowest * tokens <= head * (1 + 1e-12), tokens
        assert any(tokens <= limit and head <= (fixed + per * tokens) * (1 + 1e-12) for fixed, per, limit in lines), (
            tokens
        )
        tiled |= tokens > lines[0][2]  # past one tile: the second line's
    assert tiled == bool(tile_rows)
    # subadditive (epp.split_memory_bound: a document's slices hold at least its head)
    head = [cm.head_memory(ChunkShape(0, (t,), tail=True)) if t else 0.0 for t in range(1500)]
    for a in range(1, 750, 7):
        for b in range(a, 1500 - a, 11):
            assert head[a + b] <= (head[a] + head[b]) * (1 + 1e-12), (a, b)
