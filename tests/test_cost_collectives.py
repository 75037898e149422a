"""The vocabulary split's collectives in the time model (``CostModel.vocab_time``;
jvarlen/parallel/pipeline/rest.py): hand-computed on a model whose sp divides
its vocabulary, none where it does not or the executor does not hold the rest, and the simulator's
``V`` events on the end stages."""

from __future__ import annotations

import dataclasses

import pytest
from test_cost_model import MHA, coeffs

from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostModel, Link
from jvarlen.plan.schedule import one_f_one_b
from jvarlen.plan.simulator import simulate

LINK = Link(bandwidth=1e9, latency=1e-6)


def _cost(layout: Layout, vocab: int = 100, **kw) -> CostModel:
    return CostModel(dataclasses.replace(MHA, vocab_size=vocab), layout, coeffs(alltoall_default=LINK), **kw)


def test_the_end_stages_pay_the_vocabulary_collectives():
    cost = _cost(Layout(1, 2, 2))  # sp = 2 divides 100: split
    assert cost.splits_vocab
    chunk, t, d, e = ChunkShape(0, (40,)), 40, MHA.d_model, 2
    half = lambda nbytes: LINK.time(nbytes / 2)  # noqa: E731  (sp - 1)/sp of the whole result
    lookup = gather = half(e * t * d)  # reduce-scatter of the embeddings, all-gather of the outputs
    sums = 2 * half(4 * t) + 2 * half(8 * t)  # the max [T] and the stacked sums [2, T] (fp32), two ways
    output_grad = half(4 * t * d)  # fp32
    assert cost.vocab_time(chunk, 0, False) == pytest.approx(lookup)
    assert cost.vocab_time(chunk, 0, True) == pytest.approx(lookup)  # the cotangents' all-gather
    assert cost.vocab_time(chunk, 1, False) == pytest.approx(gather + sums)
    assert cost.vocab_time(chunk, 1, True) == pytest.approx(output_grad)
    assert cost.vocab_time(chunk, None, False) == 0.0  # a middle stage
    # in the op times: the last stage's forward and backward
    plain = _cost(Layout(1, 2, 2), vocab=101)  # 2 does not divide 101: whole, nothing moves
    assert not plain.splits_vocab and plain.vocab_time(chunk, 1, False) == 0.0
    assert cost.fwd_time(chunk, 1) - plain.fwd_time(chunk, 1) == pytest.approx(gather + sums)
    assert cost.bwd_time(chunk, 1) - plain.bwd_time(chunk, 1) == pytest.approx(output_grad)
    # over the padded tokens where the step pads its chunks
    assert cost.padded(64).vocab_time(chunk, 1, True) == pytest.approx(half(4 * 64 * d))
    # one stage is both ends; a device group splits too; sp = 1 and a fused data-parallel step do not
    one = _cost(Layout(2, 1, 2), group=True)
    assert one.vocab_time(chunk, 0, False) == pytest.approx(lookup + gather + sums)
    assert one.vocab_time(chunk, 0, True) == pytest.approx(lookup + output_grad)
    assert not _cost(Layout(2, 2, 1)).splits_vocab and not _cost(Layout(2, 1, 2)).splits_vocab


def test_an_sp_group_across_nodes_holds_the_vocabulary_whole():
    """The executor splits the vocabulary over a stage's sp only within a node (the runtime's
    strategies pass the profile's ``gpus_per_node``): sp = 4 on nodes of 2 devices holds the table
    and head whole, moves nothing for them and is charged their memory whole."""
    assert Layout(1, 1, 16).vocab_shards(32000) == 16 and Layout(1, 1, 16).vocab_shards(32000, 16) == 16
    assert Layout(1, 1, 16).vocab_shards(32000, 8) == 1 and Layout(1, 1, 16).vocab_shards(32001) == 1
    chunk = ChunkShape(0, (40,))
    in_node, across = (
        CostModel(MHA, Layout(1, 2, 4), coeffs(alltoall_default=LINK, gpus_per_node=n), state_devices=8) for n in (8, 2)
    )
    assert in_node.vocab_shards == 4 and across.vocab_shards == 1
    assert across.vocab_time(chunk, 1, False) == 0.0 < in_node.vocab_time(chunk, 1, False)
    assert across.memory_floor(0) > in_node.memory_floor(0)


def test_the_simulator_charges_them_on_the_end_stages():
    cost = _cost(Layout(1, 2, 2))
    shapes = [ChunkShape(0, (40,)) for _ in range(3)]
    result = simulate(one_f_one_b(3, 2), shapes, None, cost)
    vocab = [e for e in result.events if e.kind == "V"]
    assert {(e.stage, e.chunk) for e in vocab} == {(0, k) for k in range(3)} | {(1, k) for k in range(3)}
    plain = simulate(one_f_one_b(3, 2), shapes, None, _cost(Layout(1, 2, 2), vocab=101))
    assert not any(e.kind == "V" for e in plain.events) and result.makespan > plain.makespan
