"""One canonical, fully sharded train state; pull/push between it and a layout.

* **Canonical**: fp32 parameters and optimizer moments split over *all* devices
  (ZeRO-3/FSDP) on the 1-D ``fsdp`` mesh, by :data:`~jvarlen.parallel.layouts.STATE_RULES`.
  It is the sharding of the state between steps, in checkpoints, for the whole run.
* **Pull** (inside the jitted step): weight matrices cast to the compute dtype, then
  constrained to the layout's compute sharding (whole weights: XLA emits the
  all-gather, in the compute dtype).
* **Push**: gradients cast back to the parameter dtype and constrained to the canonical
  sharding (XLA turns the data-parallel all-reduce + slice into a reduce-scatter).

Only shardings and ``with_sharding_constraint`` are used; no transfer code.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jvarlen.parallel.layouts import (
    COMPUTE_RULES,
    DP,
    SP,
    STATE_RULES,
    Rules,
    batch_spec,
    layout_mesh,
    logical_to_spec,
    state_mesh,
)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_axes(params) -> list[tuple[str, ...]]:
    """Logical axes of every parameter leaf (leaf order); stacked layers get ``layers`` first."""
    out = []
    for var in jax.tree.leaves(params, is_leaf=_is_variable):
        axes = tuple(var.get_metadata().get("axes") or ()) if _is_variable(var) else ()
        ndim = len(var.shape)
        if len(axes) == ndim - 1:
            axes = ("layers", *axes)
        elif len(axes) != ndim:
            axes = (None,) * ndim  # unnamed parameter: replicated
        out.append(axes)
    return out


def _param_tree(params, values: list) -> Any:
    return jax.tree.structure(params).unflatten(values)


def param_shardings(params, mesh: Mesh, rules: Rules = STATE_RULES):
    """NamedShardings of ``params`` (same tree) under ``rules`` on ``mesh``."""
    leaves = jax.tree.leaves(params)
    specs = [logical_to_spec(axes, x.shape, rules, mesh) for axes, x in zip(param_axes(params), leaves)]
    return _param_tree(params, [NamedSharding(mesh, s) for s in specs])


def state_shardings(state, optimizer, mesh: Mesh):
    """Canonical shardings of a ``TrainState``: params and moments FSDP, scalars replicated.

    ``state`` may be concrete or abstract (``jax.eval_shape``); ``mesh`` is the state mesh.
    """
    params = param_shardings(state.params, mesh)
    replicated = NamedSharding(mesh, P())
    # moments follow their parameter; counts etc. stay replicated
    opt_state = _moments_like_params(optimizer, state.opt_state, params, replicated)
    return state.replace(
        step=replicated,
        params=params,
        opt_state=opt_state,
        rng=replicated,
    )


def _moments_like_params(optimizer, opt_state, param_sharding_tree, replicated):
    import optax

    return optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        opt_state,
        param_sharding_tree,
        transform_non_params=lambda _: replicated,
    )


def is_compute_weight(axes: tuple) -> bool:
    """Weight matrices are cast for compute; vectors (norm scales) stay in fp32."""
    return len([a for a in axes if a not in (None, "layers")]) >= 2


# The token embedding table is gathered, not multiplied: its gradient is a scatter-add over every
# occurrence of a token, which in bf16 stops growing once it is a few hundred times one occurrence
# (a frequent token's updates are lost). It stays fp32; the model casts the rows it gathers (and a
# tied head casts the table at its matmul).
GATHERED_TABLES = (("vocab", "embed"),)


def pulled_dtypes(params, compute_dtype) -> list:
    """Per leaf of ``params`` (leaf order), the dtype a pull moves it in: weight matrices in the
    compute dtype, vectors and the embedding table (:data:`GATHERED_TABLES`) in their own."""
    out = []
    for axes, x in zip(param_axes(params), jax.tree.leaves(params)):
        cast = is_compute_weight(axes) and tuple(axes) not in GATHERED_TABLES
        out.append(jnp.dtype(compute_dtype) if cast and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype)
    return out


def cast_pulled(params, compute_dtype):
    """``params`` cast to :func:`pulled_dtypes`, their placement unchanged."""
    leaves = jax.tree.leaves(params)
    return _param_tree(params, [x.astype(d) for x, d in zip(leaves, pulled_dtypes(params, compute_dtype))])


def pull(params, layout_mesh: Mesh, compute_dtype, rules: Rules = COMPUTE_RULES):
    """Canonical params -> params as the layout's propagation sees them (cast to
    :func:`pulled_dtypes`, resharded)."""
    compute = jax.tree.leaves(param_shardings(params, layout_mesh, rules))
    cast = jax.tree.leaves(cast_pulled(params, compute_dtype))
    return _param_tree(params, [jax.lax.with_sharding_constraint(x, s) for x, s in zip(cast, compute)])


def push(grads, canonical_params_sharding, params, layout_mesh: Mesh | None = None, rules: Rules = COMPUTE_RULES):
    """Layout gradients -> canonical: cast to the dtype of ``params``, reshard to FSDP.

    With ``layout_mesh`` the gradients are first pinned to the layout's compute sharding
    (where the backward pass produces them). Without that pin GSPMD pulls the FSDP
    sharding back into the backward pass and, for the embedding's scatter-add, reshards
    the activations with a full rematerialisation (measured on CPU: the warning goes away
    and the step needs 6 instead of 8 all-reduces).
    """
    shardings = jax.tree.leaves(canonical_params_sharding)
    compute = [None] * len(shardings)
    if layout_mesh is not None:
        compute = jax.tree.leaves(param_shardings(params, layout_mesh, rules))
    out = []
    for g, s, c, p in zip(jax.tree.leaves(grads), shardings, compute, jax.tree.leaves(params)):
        if c is not None:
            g = jax.lax.with_sharding_constraint(g, c)
        out.append(jax.lax.with_sharding_constraint(g.astype(p.dtype), s))
    return jax.tree.structure(grads).unflatten(out)


@dataclasses.dataclass(frozen=True)
class TokenShards:
    """The ``spmd`` of :func:`jvarlen.model.head.head_loss_sum` on a layout's ``mesh``: the head runs
    on each device's rows and tokens of ``[B, T]`` (``batch_spec``) inside ``shard_map``, so that
    each device tiles its own tokens' logits (under the partitioner a tile of global tokens would
    span devices); the loss and the head's gradient are summed over the devices in fp32."""

    mesh: Mesh

    def __call__(self, fn: Callable, grads: bool) -> Callable:
        rows, axes = batch_spec(), (DP, SP)
        in_specs = (P(*rows, None), P(), rows, rows)

        def body(*args):
            out = fn(*args)
            if not grads:
                return jax.lax.psum(out, axes)
            loss, dw, dh = out
            return jax.lax.psum(loss, axes), jax.lax.psum(dw, axes), dh

        out_specs = (P(), P(), P(*rows, None)) if grads else P()
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The run's devices and the canonical state sharding on them (fixed for the run)."""

    devices: tuple
    state_sharding: object  # TrainState of NamedSharding on the 1-D fsdp mesh

    @classmethod
    def for_state(cls, state, optimizer, devices: Optional[Sequence[jax.Device]] = None) -> "Placement":
        mesh = state_mesh(devices)
        return cls(tuple(mesh.devices.flat), state_shardings(state, optimizer, mesh))

    @property
    def state_mesh(self) -> Mesh:
        return jax.tree.leaves(self.state_sharding)[0].mesh

    def mesh(self, layout) -> Mesh:
        """The ``(dp, pp, sp)`` mesh of ``layout`` over the first ``layout.num_devices`` devices."""
        if len(self.devices) < layout.num_devices:
            raise ValueError(f"{layout} needs {layout.num_devices} devices, the run has {len(self.devices)}")
        return layout_mesh(layout, self.devices[: layout.num_devices])

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.state_mesh, P())


def place_global(tree, shardings):
    """Host values (identical on every process) -> global arrays with ``shardings``.

    Works with one or many processes: each process fills only its addressable shards.
    """

    def place(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(place, tree, shardings)
