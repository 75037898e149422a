"""The time of sharded stage weights: a layer's all-gather and its gradient's reduce-scatter over
the stage's dp x sp devices, charged where the layers' compute does not hide them
(``CostModel.weight_comm_times``, ``weights_fwd_exposed``, ``weights_bwd_exposed``)."""

import numpy as np
import pytest
from test_cost_model import MHA
from test_cost_model import coeffs as cost_model_coeffs

from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, CostModel, LayerTime, Link
from jvarlen.plan.schedule import one_f_one_b
from jvarlen.plan.simulator import simulate

P = MHA.layer_params
INTRA, INTER = Link(1e6, 1e-3), Link(1e5, 2e-3)


def coeffs(**kw) -> CostCoefficients:
    """The cost-model tests' coefficients with per-layer constants below a layer's gather (0.063 s
    at sp = 4) and finite links."""
    timing = dict(
        fwd=LayerTime(1e-6, 1e-3, 0.01),
        bwd=LayerTime(3e-6, 2e-3, 0.02),
        recompute=LayerTime(1e-6, 1e-3, 0.005),
        memory_budget=1e12,
        p2p_intra=INTRA,
        p2p_inter=INTER,
    )
    return cost_model_coeffs(**{**timing, **kw})


def test_a_layers_gather_and_reduce_scatter_move_what_each_device_lacks():
    """Within a node each device takes in the (g-1)/g of the layer it lacks: e bytes per parameter
    for the gather, the accumulator's stage_bytes_per_param - e = 4 for the reduce-scatter."""
    z = CostModel(MHA, Layout(1, 2, 4), coeffs(), stage_weights_sharded=True)
    gather, reduce = z.weight_comm_times()
    assert gather == pytest.approx(3 / 4 * 2 * P / 1e6 + 1e-3)
    assert reduce == pytest.approx(3 / 4 * 4 * P / 1e6 + 1e-3)
    # dp pipelines of the same stage sit pp·sp apart: (2, 2, 2) keeps stage 1's devices 2, 3, 6, 7 in a node
    assert CostModel(MHA, Layout(2, 2, 2), coeffs(), stage_weights_sharded=True).weight_comm_times()[0] == (
        pytest.approx(gather)
    )
    # replicated stage weights, or a stage of one device, move nothing per layer
    assert CostModel(MHA, Layout(1, 2, 4), coeffs()).weight_comm_times() == (0.0, 0.0)
    assert CostModel(MHA, Layout(1, 4, 1), coeffs(), stage_weights_sharded=True).weight_comm_times() == (0.0, 0.0)


def test_a_group_across_nodes_sends_each_byte_into_a_node_once():
    """Four devices per node: a (2, 1, 4) stage spans two nodes of four, each taking in the other
    half of the layer over its four devices' network shares; NVLink takes in 7/8 per device."""
    c = coeffs(gpus_per_node=4)
    gather, _ = CostModel(MHA, Layout(2, 1, 4), c, stage_weights_sharded=True).weight_comm_times()
    inter = 0.5 * 2 * P / (4 * 1e5)
    intra = 7 / 8 * 2 * P / 1e6
    assert inter > intra
    assert gather == pytest.approx(inter + 2e-3)
    # uneven: (2, 2, 2) on 4-device nodes puts stage 0 on devices 0, 1 (node 0) and 4, 5 (node 1)
    gather, _ = CostModel(MHA, Layout(2, 2, 2), c, stage_weights_sharded=True).weight_comm_times()
    assert gather == pytest.approx(max(0.5 * 2 * P / (2 * 1e5), 3 / 4 * 2 * P / 1e6) + 2e-3)


def _per_layer_reference(cm: CostModel, chunk: ChunkShape, recomputed: int) -> float:
    """A backward's descending pass, layer by layer: the first gather, then each layer lasting the
    longer of its compute and the gather + reduce-scatter in flight over it, then the last
    reduce-scatter; all-to-alls on the critical path beside them."""
    gather, reduce = cm.weight_comm_times()
    b = cm.layer_bwd_compute(chunk)
    r = cm._recompute(cm.pairs(chunk), cm.time_tokens(chunk), cm.layout.sp)
    a2a = cm.layer_alltoall_time(chunk)
    layers = [max(b + (r if j < recomputed else 0.0), gather + reduce) for j in range(cm.layers_per_stage)]
    return gather + reduce + sum(layers) + cm.layers_per_stage * a2a + recomputed * a2a


@pytest.mark.parametrize("tokens, hidden", [(1, False), (64, False), (200, False), (4096, True), (1 << 20, True)])
def test_compute_hides_the_gathers_up_to_its_own_length(tokens, hidden):
    """Short chunks wait for the gathers, long ones only for the first gather (and, backward, the
    last reduce-scatter); recomputation hides more of them (at 200 tokens partly, at 64 wholly), so
    that bwd_time + recompute_time stays the per-layer sum for every count of recomputed layers."""
    c = coeffs(alltoall_intra={4: Link(1e7, 1e-4)})
    rep = CostModel(MHA, Layout(1, 2, 4), c)
    z = rep.with_stage_weights(True)
    chunk = ChunkShape(0, (tokens,))
    gather, reduce = z.weight_comm_times()
    f = z.layer_fwd_compute(chunk)
    assert z.fwd_time(chunk, 1) - rep.fwd_time(chunk, 1) == pytest.approx(gather + 2 * max(0.0, gather - f))
    for recomputed in range(3):
        got = z.bwd_time(chunk) + z.recompute_time(chunk, recomputed)
        assert got == pytest.approx(_per_layer_reference(z, chunk, recomputed))
        assert got >= (rep.bwd_time(chunk) + rep.recompute_time(chunk, recomputed) + gather + reduce) * (1 - 1e-12)
    assert (z.layer_bwd_compute(chunk) >= gather + reduce) == hidden
    assert (z.bwd_time(chunk) - rep.bwd_time(chunk) == pytest.approx(gather + reduce)) == hidden
    if tokens in (64, 200):  # a recomputed layer costs nothing where comm covers it, part where it covers part
        extra = z.recompute_time(chunk, 1) - z.layer_alltoall_time(chunk)
        assert (extra == 0.0) == (tokens == 64) and extra < rep.recompute_time(chunk, 1) - rep.layer_alltoall_time(
            chunk
        )


def test_the_simulator_charges_each_ops_exposed_gathers():
    """A sharded pipeline's ops wait "AG" seconds beside their compute: each stage is busy that
    much longer than replicated, and the iteration takes longer."""
    z = CostModel(MHA, Layout(1, 2, 4), coeffs(), stage_weights_sharded=True)
    shapes = [ChunkShape(0, (32,)), ChunkShape(0, (48,)), ChunkShape(0, (16,))]
    ckpt = np.zeros((3, 2), dtype=np.int64)
    sim = simulate(one_f_one_b(3, 2), shapes, ckpt, z)
    waits = [e for e in sim.events if e.kind == "AG"]
    assert len(waits) == 12  # every F and B of 3 chunks on 2 stages
    expected = sum(z.weights_fwd_exposed(s) + z.weights_bwd_exposed(s) for s in shapes) * 2
    assert sum(e.duration for e in waits) == pytest.approx(expected)
    rep = simulate(one_f_one_b(3, 2), shapes, ckpt, z.with_stage_weights(False))
    assert not any(e.kind == "AG" for e in rep.events)
    per_stage = sum(z.weights_fwd_exposed(s) + z.weights_bwd_exposed(s) for s in shapes)
    np.testing.assert_allclose(sim.stage_busy, rep.stage_busy + per_stage)
    assert sim.iteration_time > rep.iteration_time


def test_group_costs_price_short_documents_with_their_exposed_gathers():
    """FlexSP's and DCP's document times take a closed form where T(l) is quadratic in the length;
    sharded gathers exposed below ~125 tokens here make it piecewise, which the fit from 1K-4K
    tokens would miss: every length is priced as ``doc_time`` prices it."""
    from jvarlen.plan.sp_groups import GroupCosts
    from jvarlen.plan.strategy import Scheme, SchemeCosts

    c = coeffs(fwd=LayerTime(1e-6, 1e-3, 0.0), bwd=LayerTime(3e-6, 2e-3, 0.0), recompute=None)
    gc = GroupCosts(SchemeCosts(CostModel(MHA, Layout(1, 1, 4), c, stage_weights_sharded=True), 4), max_sp=2)
    scheme = Scheme(1, 2)
    lengths = [8, 64, 200, 2000]
    exposed = [gc.costs.cost(scheme).weights_bwd_exposed(ChunkShape(0, (n,))) for n in lengths]
    gather, reduce = gc.costs.cost(scheme).weight_comm_times()
    assert exposed[0] > gather + reduce and exposed[-1] == pytest.approx(gather + reduce)
    np.testing.assert_allclose(gc.doc_times(lengths, scheme), [gc.doc_time(n, scheme) for n in lengths], rtol=1e-12)
    replicated = GroupCosts(SchemeCosts(CostModel(MHA, Layout(1, 1, 4), c), 4), max_sp=2)
    assert replicated._quadratic(scheme) is not None  # the closed form stays where it is exact


def test_a_plain_backward_sharded_over_dp_waits_for_the_fused_ops_pass():
    """Sharded over the dp pipelines, lane 0 runs one pass for every op kind, so where the step has
    fused ops a plain backward also runs their ascending pass: L_s + 1 gathers with nothing to hide
    them. Sharded over sp only, lane 0 keeps a branch per op kind and a plain backward has none."""
    from jvarlen.plan.buffers import plan_tick_rows
    from jvarlen.plan.chunk import executor_bucket
    from jvarlen.plan.schedule import BWD, FUSED, LANE_B

    shapes = [ChunkShape(0, (32,)), ChunkShape(0, (48,)), ChunkShape(0, (16,))]
    ckpt = np.zeros((3, 2), dtype=np.int64)
    schedule = one_f_one_b(3, 2)
    ops = [row[p][LANE_B][0] for row in plan_tick_rows(schedule, ckpt) for p in range(2)]
    plain, fused = ops.count(BWD), ops.count(FUSED)
    assert plain > 0 and fused > 0
    dp = CostModel(MHA, Layout(2, 2, 2), coeffs(), stage_weights_sharded=True)
    gather, _ = dp.weight_comm_times()
    assert dp.weights_idle_pass() == pytest.approx((MHA.num_layers // 2 + 1) * gather)
    sim = simulate(schedule, shapes, ckpt, dp, mode="paired")
    padded = dp.padded(executor_bucket(48, 2))  # the paired executor runs every chunk over one bucket
    per_op = sum(padded.weights_fwd_exposed(s) + padded.weights_bwd_exposed(s) for s in shapes) * 2
    waited = sum(e.duration for e in sim.events if e.kind == "AG")
    assert waited == pytest.approx(per_op + plain * dp.weights_idle_pass())
    # the same gathers over sp only: no pass for a plain backward
    sp = CostModel(MHA, Layout(1, 2, 4), coeffs(), stage_weights_sharded=True)
    assert sp.weight_comm_times()[0] == pytest.approx(gather) and sp.weights_idle_pass() == 0.0
    sim = simulate(schedule, shapes, ckpt, sp, mode="paired")
    padded = sp.padded(executor_bucket(48, 4))
    per_op = sum(padded.weights_fwd_exposed(s) + padded.weights_bwd_exposed(s) for s in shapes) * 2
    assert sum(e.duration for e in sim.events if e.kind == "AG") == pytest.approx(per_op)
