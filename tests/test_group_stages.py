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
from jvarlen.parallel.groups import pull_stages, stage_tables, sum_stage_rows
from jvarlen.parallel.layouts import FSDP, state_mesh

N, L, K = 8, 8, 3
# leaf shape and the axis split over the 8 devices (None: replicated, 0: the layer axis)
LEAVES = {"axis1": ((L, 16), 1), "axis2": ((L, 3, 16), 2), "layers": ((L, 5), 0), "none": ((L, 3), None)}
AXES = [axis for _, axis in LEAVES.values()]


def _spec(axis):
    return P() if axis is None else P(*([None] * axis), FSDP)


@functools.cache
def _programs():
    require_devices(N)
    mesh = state_mesh(jax.devices()[:N])
    canonical = {name: NamedSharding(mesh, _spec(axis)) for name, (_, axis) in LEAVES.items()}
    rows = {name: NamedSharding(mesh, P(FSDP)) for name in LEAVES}
    replicated = NamedSharding(mesh, P())
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
