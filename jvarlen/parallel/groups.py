"""Device groups of a heterogeneous strategy: pull from and push to the one canonical state.

Groups run their own programs on disjoint sets of the run's devices. Data moves between the
canonical fully-sharded state (the 1-D ``fsdp`` mesh over all devices) and the groups only inside
programs that span *all* devices, so every transfer is a collective of one program — which is
what multi-controller JAX supports (a ``device_put`` between different device sets is not) — and
the hand-over between a group's program and an all-device program re-labels device buffers
without copying them:

* **pull** (:func:`pull_replicated`, one program on all devices): the fp32 parameters are
  all-gathered so that every device holds all of them; :func:`for_group` then views the buffers
  of a group's devices as an array replicated over the group's mesh (no copy, no transfer);
* **push**: a group's program ends with :func:`device_partials`: every device of the group returns
  its share of the iteration's gradient with a leading axis of one (its stage's layers placed in
  the full stack, zeros elsewhere; one replica of each stage contributes), scaled by the group's
  share of the iteration's target tokens; :func:`gather_partials` views those buffers of all
  groups as one ``[N, ...]`` array sharded over the ``fsdp`` axis (no copy), and the update
  program (all devices) sums the axis into the canonical sharding (a reduce-scatter) and applies
  one optimizer update.

Bytes per device per iteration: the pull receives the whole parameter set once (fp32,
``4·P`` bytes, like the all-gather of a homogeneous ZeRO-3 step); the push sends ``4·P`` bytes of
partial gradients into the reduce-scatter (a homogeneous step's reduce-scatter of the full
gradient). docs/design/heterogeneous.md discusses the trade-offs.
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


def device_partials(mesh: Mesh, layer_grads, rest_grads, sums: dict, weight, num_layers: int):
    """A group's gradients (layers stacked ``[L/pp, ...]`` sharded over ``pp``, the rest replicated,
    as the pipeline executor returns them after its reductions) as per-device partials with a
    leading axis over the group's devices (``P((dp, pp, sp))``): one replica of each stage puts
    its layers, scaled by ``weight``, at the stage's place in the full ``[L, ...]`` stack; the
    group's first device adds the rest and the loss sums. Summing the partials of all groups gives
    the iteration's gradient."""
    pp = mesh.shape[PP]
    layer_spec = jax.tree.map(lambda _: P(PP), layer_grads)
    rest_spec = jax.tree.map(lambda _: P(), rest_grads)
    sums_spec = jax.tree.map(lambda _: P(), sums)
    out_spec = P(GROUP_AXES)

    def device_fn(layers, rest, sums, weight):
        stage = jax.lax.axis_index(PP)
        replica0 = (jax.lax.axis_index(DP) == 0) & (jax.lax.axis_index(SP) == 0)
        first = replica0 & (stage == 0)
        per_stage = num_layers // pp

        def place(x):
            full = jnp.zeros((num_layers, *x.shape[1:]), x.dtype)
            full = jax.lax.dynamic_update_slice_in_dim(full, x * weight.astype(x.dtype), stage * per_stage, 0)
            return jnp.where(replica0, full, jnp.zeros_like(full))[None]

        layers = jax.tree.map(place, layers)
        rest = jax.tree.map(lambda x: jnp.where(first, x * weight.astype(x.dtype), jnp.zeros_like(x))[None], rest)
        sums = jax.tree.map(lambda x: jnp.where(first, x, jnp.zeros_like(x))[None], sums)
        return layers, rest, sums

    return jax.shard_map(
        device_fn,
        mesh=mesh,
        in_specs=(layer_spec, rest_spec, sums_spec, P()),
        out_specs=(
            jax.tree.map(lambda _: out_spec, layer_grads),
            jax.tree.map(lambda _: out_spec, rest_grads),
            jax.tree.map(lambda _: out_spec, sums),
        ),
        check_vma=False,
    )(layer_grads, rest_grads, sums, weight)
