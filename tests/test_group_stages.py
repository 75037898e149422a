"""The groups' per-stage pull and push (jvarlen/parallel/groups.py): each device receives its own
pipeline stage's decoder layers from the canonical state, and the update adds every device's stage
gradients back into it, each device's scaled by its weight. Checked against numpy on random layer tables, for leaves split on a weight
axis, on the layer axis and replicated (the strategy steps: tests/test_groups.py)."""

from __future__ import annotations

import functools

import jax
import numpy as np
from conftest import require_devices
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jvarlen.layout import Layout
from jvarlen.parallel.groups import pull_stages, shard_table, stage_shards, stage_tables, sum_stage_rows
from jvarlen.parallel.layouts import DP, FSDP, PP, SP, state_mesh

N, L, K = 8, 8, 3
# leaf shape and the axis split over the 8 devices (None: replicated, 0: the layer axis)
LEAVES = {"axis1": ((L, 16), 1), "axis2": ((L, 3, 16), 2), "layers": ((L, 5), 0), "none": ((L, 3), None)}
AXES = [axis for _, axis in LEAVES.values()]


def _spec(axis):
    return P() if axis is None else P(*([None] * axis), FSDP)


@functools.cache
def _programs(parts=None):
    """The pull and the update's sum (``parts``: with a shard table, each weight axis kept
    ``1/parts``)."""
    require_devices(N)
    mesh = state_mesh(jax.devices()[:N])
    canonical = {name: NamedSharding(mesh, _spec(axis)) for name, (_, axis) in LEAVES.items()}
    rows = {name: NamedSharding(mesh, P(FSDP)) for name in LEAVES}
    replicated = NamedSharding(mesh, P())
    if parts is None:
        pull = jax.jit(
            lambda layers, table: pull_stages(layers, table, AXES, mesh),
            in_shardings=(canonical, replicated),
            out_shardings=rows,
        )
        push = jax.jit(
            lambda stage_rows, table, weights: sum_stage_rows(stage_rows, table, weights, AXES, mesh, L),
            in_shardings=(rows, replicated, replicated),
            out_shardings=canonical,
        )
        return pull, push
    pull = jax.jit(
        lambda layers, table, shards: pull_stages(layers, table, AXES, mesh, shards, parts),
        in_shardings=(canonical, replicated, replicated),
        out_shardings=rows,
    )
    push = jax.jit(
        lambda stage_rows, table, weights, shards: sum_stage_rows(
            stage_rows, table, weights, AXES, mesh, L, shards, parts
        ),
        in_shardings=(rows, replicated, replicated, replicated),
        out_shardings=canonical,
    )
    return pull, push


tables = st.lists(st.lists(st.integers(-1, L - 1), min_size=K, max_size=K), min_size=N, max_size=N)


@settings(max_examples=12, deadline=None)
@given(tables, st.integers(0, 2**31 - 1))
def test_the_pull_hands_each_device_its_tables_layers_and_the_push_adds_them_back(table, seed):
    pull, push = _programs()
    table = np.asarray(table, np.int32)
    rng = np.random.default_rng(seed)
    layers = {name: rng.standard_normal(shape).astype(np.float32) for name, (shape, _) in LEAVES.items()}
    got = pull(layers, table)
    for name, x in layers.items():
        mine = np.where((table >= 0)[..., None], x[np.maximum(table, 0)].reshape(N, K, -1), 0)
        np.testing.assert_array_equal(np.asarray(got[name]).reshape(N, K, -1), mine, err_msg=name)

    stage_rows = {
        name: rng.standard_normal((N, K, *shape[1:])).astype(np.float32) for name, (shape, _) in LEAVES.items()
    }
    weights = rng.uniform(0, 1, N).astype(np.float32)
    summed = push(stage_rows, table, weights)
    for name, r in stage_rows.items():
        expected = np.zeros(LEAVES[name][0], np.float32)
        for d in range(N):
            for k in range(K):
                if table[d, k] >= 0:
                    expected[table[d, k]] += weights[d] * r[d, k]
        np.testing.assert_allclose(np.asarray(summed[name]), expected, rtol=1e-6, atol=1e-6, err_msg=name)


@settings(max_examples=12, deadline=None)
@given(tables, st.lists(st.sampled_from([1, 2, 4, 8]), min_size=N, max_size=N), st.integers(0, 2**31 - 1))
def test_a_sharded_stage_receives_its_chunk_and_its_chunks_rows_are_added_back(table, counts, seed):
    """With a shard table, each device keeps only the weight axis' ``1/parts`` from the start of its
    chunk (``parts``: the smallest count; its group cuts the rest), and its rows, zero past its
    chunk, land at the chunk's offset; the other leaves travel whole, as without."""
    table = np.asarray(table, np.int32)
    rng = np.random.default_rng(seed)
    shards = np.array([(c, rng.integers(c)) for c in counts], np.int32)
    parts = min(counts)
    pull, push = _programs(parts)
    layers = {name: rng.standard_normal(shape).astype(np.float32) for name, (shape, _) in LEAVES.items()}
    got = pull(layers, table, shards)
    for name, x in layers.items():
        a = LEAVES[name][1]
        mine = np.where((table >= 0).reshape(N, K, *[1] * (x.ndim - 1)), x[np.maximum(table, 0)], 0)
        if a:  # [N, K, ..., width] from each device's chunk start, zero past the axis' end
            size = x.shape[a]
            width, padded = size // parts, np.concatenate([mine, np.zeros_like(mine)], axis=a + 1)
            start = [i * (size // c) for c, i in shards]
            mine = np.stack([np.take(padded[d], np.arange(start[d], start[d] + width), axis=a) for d in range(N)])
        np.testing.assert_array_equal(np.asarray(got[name]).reshape(mine.shape), mine, err_msg=name)

    weights = rng.uniform(0, 1, N).astype(np.float32)
    stage_rows, expected = {}, {}
    for name, (shape, a) in LEAVES.items():
        want = np.zeros(shape, np.float32)
        if not a:
            r = rng.standard_normal((N, K, *shape[1:])).astype(np.float32)
            placed = r
        else:
            size, width = shape[a], shape[a] // parts
            r = rng.standard_normal((N, K, *shape[1:a], width, *shape[a + 1 :])).astype(np.float32)
            placed = np.zeros((N, K, *shape[1:]), np.float32)
            for d, (c, i) in enumerate(shards):
                keep = np.take(r[d], np.arange(size // c), axis=a)  # the chunk; zero past it
                idx = [slice(None)] * keep.ndim
                idx[a] = slice(i * (size // c), (i + 1) * (size // c))
                placed[d][tuple(idx)] = keep
                rest = [slice(None)] * r.ndim
                rest[a + 1] = slice(size // c, None)
                r[d][tuple(rest[1:])] = 0
        stage_rows[name] = r
        for d in range(N):
            for k in range(K):
                if table[d, k] >= 0:
                    want[table[d, k]] += weights[d] * placed[d, k]
        expected[name] = want
    summed = push(stage_rows, table, weights, shards)
    for name in LEAVES:
        np.testing.assert_allclose(np.asarray(summed[name]), expected[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_a_group_shards_its_stage_where_dp_sp_divides_every_weight_axis():
    layers = {name: jax.ShapeDtypeStruct(shape, np.float32) for name, (shape, _) in LEAVES.items()}
    assert stage_shards(Layout(2, 2, 2), layers, AXES, sharded=True) == 4  # 16 on axis 1 and 2
    assert stage_shards(Layout(2, 2, 2), layers, AXES, sharded=False) == 1
    assert stage_shards(Layout(1, 1, 1), layers, AXES, sharded=True) == 1
    assert stage_shards(Layout(3, 1, 1), layers, AXES, sharded=True) == 1  # 3 does not divide 16: whole
    # a (dp=2, pp=1, sp=2) group on devices 4-7 split in 4; one device per stage on 0-1; 2-3 idle
    table = shard_table([(Layout(2, 1, 2), (4, 5, 6, 7), 4), (Layout(1, 2, 1), (0, 1), 1)], 8)
    assert table.tolist() == [[1, 0], [1, 0], [1, 0], [1, 0], [4, 0], [4, 1], [4, 2], [4, 3]]


def test_stage_tables_list_each_devices_stage_padded_to_the_largest():
    # a (pp=2, sp=2) group on devices 4-7 (mesh order d, p, s), a (pp=4, sp=1) group on 0-3
    table = stage_tables([(Layout(1, 2, 2), (4, 5, 6, 7)), (Layout(1, 4, 1), (3, 2, 1, 0))], 9, 8)
    assert table.tolist() == [
        [6, 7, -1, -1],
        [4, 5, -1, -1],
        [2, 3, -1, -1],
        [0, 1, -1, -1],
        [0, 1, 2, 3],
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [4, 5, 6, 7],
        [-1, -1, -1, -1],  # in no group
    ]


def test_a_groups_sharded_stage_splits_its_weight_axes_over_sp_and_refuses_dp():
    """A device group is one pipeline (pp x sp devices): its sharded stage's leaves split on the
    given axes over sp, spec ``P(pp, ..., (dp, sp))``; a layout with dp > 1 is refused rather than
    compiled into a layout no group has."""
    import pytest
    from flax import nnx
    from pipeline_helpers import tiny_config

    from jvarlen.model.transformer import abstract_model
    from jvarlen.parallel.pipeline.weights import StageWeights
    from jvarlen.parallel.sharding import param_axes

    _, state = nnx.split(abstract_model(tiny_config()).layers, nnx.Param)
    axes = param_axes(state)
    split = [next((a for a in range(1, len(x.shape)) if x.shape[a] % 2 == 0), None) for x in jax.tree.leaves(state)]
    weights = StageWeights(state, axes, Layout(1, 2, 2), "sharded", canonical=False, group_axes=split)
    specs = jax.tree.leaves(weights.specs(), is_leaf=lambda x: isinstance(x, P))
    for spec, a in zip(specs, split):
        assert spec == (P(PP, *([None] * (a - 1)), (DP, SP)) if a else P(PP))
    assert all(leaf.local == bool(a) for leaf, a in zip(weights.leaves, split))
    with pytest.raises(ValueError, match="needs dp = 1"):
        StageWeights(state, axes, Layout(2, 2, 2), "sharded", canonical=False, group_axes=split)
