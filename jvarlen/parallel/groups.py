"""Device groups of a heterogeneous strategy: pull from and push to the one canonical state.

Groups run their own programs on disjoint sets of the run's devices. Data moves between the
canonical fully-sharded state (the 1-D ``fsdp`` mesh over all devices) and the groups only inside
programs that span *all* devices, so every transfer is a collective of one program — which is
what multi-controller JAX supports (a ``device_put`` between different device sets is not) — and
the hand-over between a group's program and an all-device program re-labels device buffers
without copying them. Each device moves its own pipeline stage's decoder layers, not the model:

* :func:`stage_tables`: the iteration's ``[N, K]`` table of the layers each device's stage holds
  (``K``: the largest stage of the iteration's groups; shorter stages padded with ``-1``);
* **pull** (:func:`pull_stages`, one program on all devices): an all-to-all over the ``fsdp``
  axis hands every device its stage's layers (``[K, ...]`` per device, one ``[N·K, ...]``
  array): whole, or a sharded stage's device its chunk (:func:`stage_shards`,
  :func:`shard_table`); the rest of the model (embedding, final norm, head) is all-gathered onto
  every device. :func:`stage_view` and :func:`for_group` then view a group's devices' buffers as
  its ``P(pp)`` layer stack and its replicated rest (no copy, no transfer);
* **push**: every device of a group returns its own contribution to its stage's layer gradients
  as a ``[1, L/pp, ...]`` row (the pipeline executor's accumulators, not reduced within the
  group, or a sharded stage's chunk of their reduce-scattered sum; padded to ``K`` rows where
  the stage is shorter), its own contribution to the rest's gradients (``[1, ...]``, not reduced
  within the group either), and the group's first device the loss sums (:func:`device_partials`);
  :func:`gather_partials` views those buffers of all groups as ``[N, ...]`` arrays sharded over
  ``fsdp`` (no copy), and the update program (all devices) scales each device's rows by its
  group's share of the iteration's target tokens and adds them into the canonical sharding: the
  layers by :func:`sum_stage_rows` (the pull's all-to-all backwards, then a scatter-add by the
  table), the rest by a sum over the axis (a reduce-scatter); then one optimizer update.

Bytes per device per iteration: the pull receives its stage's ``K`` layers (weight matrices in
the compute dtype) and the rest, the push sends their fp32 gradient rows (sharded: the same on
the links, a chunk of them held)
(docs/design/heterogeneous.md, "Bytes and memory").
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jvarlen.layout import Layout
from jvarlen.parallel.layouts import DP, FSDP, PP, SP, layout_mesh

GROUP_AXES = (DP, PP, SP)


def group_mesh(layout: Layout, devices: Sequence[jax.Device]) -> Mesh:
    """The ``(dp, pp, sp)`` mesh of a group's layout over its devices (in the run's device order)."""
    return layout_mesh(layout, list(devices))


def for_group(array: jax.Array, mesh: Mesh) -> jax.Array:
    """An array replicated over all devices, seen as replicated over ``mesh``'s devices (the same
    device buffers: no copy, no transfer). Works with several processes: each contributes its
    addressable devices of the group."""
    want = set(mesh.devices.flat)
    shards = [s.data for s in array.addressable_shards if s.device in want]
    return jax.make_array_from_single_device_arrays(array.shape, NamedSharding(mesh, P()), shards)


def stage_tables(groups: Sequence[tuple[Layout, Sequence[int]]], num_devices: int, num_layers: int) -> np.ndarray:
    """The ``[N, K]`` table of the decoder layers each of the run's devices holds for the iteration:
    row ``i`` lists the layers of device ``i``'s pipeline stage in its group (``groups``: each
    group's layout and its devices as indices into the run's device list, in the group mesh's
    order), padded with ``-1``; devices in no group hold none. ``K`` is the largest stage."""
    rows = max((num_layers // layout.pp for layout, _ in groups), default=1)
    table = np.full((num_devices, rows), -1, np.int32)
    for layout, devices in groups:
        per_stage = num_layers // layout.pp
        for i, device in enumerate(devices):
            stage = np.unravel_index(i, (layout.dp, layout.pp, layout.sp))[1]
            table[device, :per_stage] = np.arange(stage * per_stage, (stage + 1) * per_stage)
    return table


def fsdp_axis(sharding: NamedSharding):
    """The axis of a canonical leaf split over the ``fsdp`` devices (None: replicated)."""
    return next((i for i, entry in enumerate(sharding.spec) if entry is not None), None)


def _keep(x, valid):
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - valid.ndim)), x, jnp.zeros_like(x))


def stage_shards(layout: Layout, layers, axes: Sequence, sharded: bool) -> int:
    """Into how many contiguous chunks a group of ``layout`` splits its stage's layers over its
    ``dp × sp`` devices (``sharded``: ``parallel.stage_weights=sharded``): ``dp·sp`` where it
    divides the axis of every leaf split on a weight axis in the canonical state (``axes``), else
    1 (whole layers, as with replicated stage weights)."""
    g = layout.dp * layout.sp
    if not sharded or g == 1:
        return 1
    ok = all(x.shape[a] % g == 0 for x, a in zip(jax.tree.leaves(layers), axes) if a)
    return g if ok else 1


def shard_table(groups: Sequence[tuple[Layout, Sequence[int], int]], num_devices: int) -> np.ndarray:
    """The ``[N, 2]`` table of each device's chunk of its stage's layers: (chunks, its index),
    ``groups``: each group's layout, devices (as in :func:`stage_tables`) and
    :func:`stage_shards`; device ``(d, p, s)`` of a sharded group holds chunk ``d·sp + s``. Devices
    in no group: ``(1, 0)`` (they hold no layers)."""
    table = np.tile(np.array([1, 0], np.int32), (num_devices, 1))
    for layout, devices, shards in groups:
        for i, device in enumerate(devices):
            d, _, s = np.unravel_index(i, (layout.dp, layout.pp, layout.sp))
            table[device] = (shards, d * layout.sp + s if shards > 1 else 0)
    return table


def _chunk(whole, axis: int, shard, width: int):
    """``width`` entries of ``whole`` along ``axis`` from the start of chunk ``shard[1]`` of
    ``shard[0]`` (data), zero-padded past the end."""
    size = whole.shape[axis]
    padded = jnp.pad(whole, [(0, width if i == axis else 0) for i in range(whole.ndim)])
    return jax.lax.dynamic_slice_in_dim(padded, shard[1] * (size // shard[0]), width, axis)


def _unchunk(part, axis: int, shard, size: int):
    """The inverse of :func:`_chunk`: ``part`` placed at its chunk's offset in zeros of ``size``
    along ``axis`` (``part`` zero past its chunk: the entries it brings there add nothing)."""
    shape = list(part.shape)
    shape[axis] = size + part.shape[axis]
    whole = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(shape, part.dtype), part, shard[1] * (size // shard[0]), axis)
    return jax.lax.slice_in_dim(whole, 0, size, axis=axis)


def pull_stages(layers, table, axes: Sequence, mesh: Mesh, shards=None, parts: int = 1):
    """(Traced in a program over all devices.) The canonical stacked layers (``axes``: each leaf's
    :func:`fsdp_axis` on ``mesh``, the state mesh) -> each device's stage layers, ``[K, ...]``
    per device as one ``[N·K, ...]`` array sharded over ``fsdp`` (``table``: :func:`stage_tables`,
    replicated). A leaf split on a weight axis travels one layer row at a time by one all-to-all
    (so that the program holds one layer beyond its output): device ``j`` sends every device its
    chunk of that device's ``k``-th layer and receives its own ``k``-th layer's chunks from
    everyone. With ``shards`` (:func:`shard_table`) a device keeps only ``1/parts`` of that axis,
    from the start of its own chunk (a sharded stage's; the group cuts it to its chunk). A leaf
    split on the layer axis or replicated (small vectors) is all-gathered and indexed, whole."""
    leaves, treedef = jax.tree.flatten(layers)
    specs = [P() if a is None else P(*([None] * a), FSDP) for a in axes]
    moved = [i for i, a in enumerate(axes) if a]

    def device_fn(leaves, table, shards):
        me = jax.lax.axis_index(FSDP)
        valid, rows = table >= 0, jnp.maximum(table, 0)
        out = [None] * len(leaves)
        for i, a in enumerate(axes):
            if not a:  # replicated, or split on the layer axis
                whole = leaves[i] if a is None else jax.lax.all_gather(leaves[i], FSDP, axis=0, tiled=True)
                out[i] = _keep(jnp.take(whole, rows[me], axis=0), valid[me])

        def row(_, k):
            got = []
            for i in moved:
                a = axes[i]
                send = _keep(jnp.take(leaves[i], rows[:, k], axis=0), valid[:, k])  # my chunk of each's k-th
                x = jax.lax.all_to_all(send, FSDP, 0, 0, tiled=False)  # [N, ...]: chunk j of my k-th, from j
                x = jnp.moveaxis(x, 0, a - 1)  # [..., N, chunk, ...]
                x = x.reshape(x.shape[: a - 1] + (-1,) + x.shape[a + 1 :])
                got.append(_chunk(x, a - 1, shards[me], x.shape[a - 1] // parts) if chunked else x)
            return None, got

        _, stacked = jax.lax.scan(row, None, jnp.arange(table.shape[1]))
        for i, x in zip(moved, stacked):
            out[i] = x
        return out

    chunked = shards is not None
    shards = jnp.ones((table.shape[0], 2), jnp.int32) if shards is None else shards
    out = jax.shard_map(
        device_fn, mesh=mesh, in_specs=(specs, P(), P()), out_specs=[P(FSDP)] * len(leaves), check_vma=False
    )(leaves, table, shards)
    return treedef.unflatten(out)


def sum_stage_rows(rows, table, weights, axes: Sequence, mesh: Mesh, num_layers: int, shards=None, parts: int = 1):
    """(Traced in a program over all devices.) The transpose of :func:`pull_stages`: every
    device's ``[1, K, ...]`` row of stage gradients (one ``[N, K, ...]`` array per leaf, sharded
    over ``fsdp``), scaled by its ``weights[i]`` (``[N]``, replicated) -> their sum over all
    devices as canonical stacked layers. The all-to-all hands device ``j`` chunk ``j`` of every
    device's rows, one row index at a time, which it adds into its layers by the table (padding
    rows dropped); with ``shards``, a row holds ``1/parts`` of the weight axis from the start of
    the device's chunk (zero past it), placed there first. Leaves split on the layer axis or
    replicated are added whole and reduce-scattered or all-reduced."""
    leaves, treedef = jax.tree.flatten(rows)
    out_specs = [P() if a is None else P(*([None] * a), FSDP) for a in axes]
    moved = [i for i, a in enumerate(axes) if a]

    def device_fn(leaves, table, weights, shards):
        me = jax.lax.axis_index(FSDP)
        ids = jnp.where(table >= 0, table, num_layers)  # padding: one extra segment, dropped
        out = [None] * len(leaves)
        for i, a in enumerate(axes):
            if not a:  # replicated, or split on the layer axis: whole, then reduced
                x = leaves[i][0] * weights[me].astype(leaves[i].dtype)
                whole = jax.ops.segment_sum(x, ids[me], num_segments=num_layers + 1)[:num_layers]
                if a is None:
                    out[i] = jax.lax.psum(whole, FSDP)
                else:
                    out[i] = jax.lax.psum_scatter(whole, FSDP, scatter_dimension=0, tiled=True)

        # one row at a time, so that only one layer's chunks are in flight (all rows at once held
        # the all-to-all's K rows twice: 65 GB per H100 for a one-stage Llama-2-7B)
        def row(sums, k):
            new = []
            for acc, i in zip(sums, moved):
                x = jax.lax.dynamic_index_in_dim(leaves[i][0], k, 0)  # [1, ...]: my k-th row
                if chunked:
                    x = _unchunk(x, axes[i], shards[me], x.shape[axes[i]] * parts)
                got = jax.lax.all_to_all(x, FSDP, axes[i], 0, tiled=True)  # [N, ...]: device j's, my chunk
                got = got * weights.astype(got.dtype).reshape((-1,) + (1,) * (got.ndim - 1))
                new.append(acc + jax.ops.segment_sum(got, ids[:, k], num_segments=num_layers + 1))
            return new, None

        zeros = []
        for i in moved:
            chunk = list(leaves[i].shape[2:])
            chunk[axes[i] - 1] = chunk[axes[i] - 1] * (parts if chunked else 1) // table.shape[0]
            zeros.append(jnp.zeros((num_layers + 1, *chunk), leaves[i].dtype))
        sums, _ = jax.lax.scan(row, zeros, jnp.arange(table.shape[1]))
        for i, acc in zip(moved, sums):
            out[i] = acc[:num_layers]
        return out

    chunked = shards is not None
    shards = jnp.ones((table.shape[0], 2), jnp.int32) if shards is None else shards
    out = jax.shard_map(
        device_fn,
        mesh=mesh,
        in_specs=([P(FSDP)] * len(leaves), P(), P(), P()),
        out_specs=out_specs,
        check_vma=False,
    )(leaves, table, weights, shards)
    return treedef.unflatten(out)


def stage_view(array: jax.Array, mesh: Mesh, axis=None) -> jax.Array:
    """The pulled ``[N·K, ...]`` stage layers (:func:`pull_stages`) seen as a group's ``[pp·K, ...]``
    layer stack split over its ``pp`` axis (the same device buffers: each device of stage ``p``
    holds block ``p``; no copy, no transfer). ``axis``: the devices of a stage hold different
    windows of that axis (a sharded stage's chunks), seen as split over ``(dp, sp)`` there."""
    want = set(mesh.devices.flat)
    shards = [s.data for s in array.addressable_shards if s.device in want]
    shape = list(array.sharding.shard_shape(array.shape))
    shape[0] *= mesh.shape[PP]
    spec = P(PP)
    if axis is not None:
        shape[axis] *= mesh.shape[DP] * mesh.shape[SP]
        spec = P(PP, *([None] * (axis - 1)), (DP, SP))
    return jax.make_array_from_single_device_arrays(tuple(shape), NamedSharding(mesh, spec), shards)


def gather_partials(
    arrays: Sequence[jax.Array], state_mesh: Mesh, order: Sequence[jax.Device], shape: tuple, dtype
) -> jax.Array:
    """This process's groups' per-device partials ``[n_g, ...]`` (each sharded one row per device)
    as one ``[N, ...]`` = ``shape`` array sharded over the ``fsdp`` axis of ``state_mesh`` (row i on
    ``order[i]``, the state mesh's device order); this process's devices that are in none of its
    groups contribute zeros (a process may run no group at all)."""
    rows = {}
    for a in arrays:
        for s in a.addressable_shards:
            rows[s.device] = s.data
    local = [d for d in order if d.process_index == jax.process_index()]
    missing = [d for d in local if d not in rows]
    if missing:  # idle devices (a strategy that leaves some out): zero rows on them
        zero = np.zeros((1, *shape[1:]), dtype)
        for d in missing:
            rows[d] = jax.device_put(zero, d)
    return jax.make_array_from_single_device_arrays(shape, NamedSharding(state_mesh, P(FSDP)), [rows[d] for d in local])


def device_partials(mesh: Mesh, sums: dict):
    """A group's loss sums (replicated over its devices) as per-device partials with a leading axis
    over the group's devices (``P((dp, pp, sp))``): the group's first device holds them, the others
    zeros. (Its layers' and the rest's gradients come from the executor as such rows already.)"""
    out_spec = P(GROUP_AXES)

    def device_fn(sums):
        first = (jax.lax.axis_index(DP) == 0) & (jax.lax.axis_index(PP) == 0) & (jax.lax.axis_index(SP) == 0)
        return jax.tree.map(lambda x: jnp.where(first, x, jnp.zeros_like(x))[None], sums)

    return jax.shard_map(
        device_fn,
        mesh=mesh,
        in_specs=(jax.tree.map(lambda _: P(), sums),),
        out_specs=jax.tree.map(lambda _: out_spec, sums),
        check_vma=False,
    )(sums)
