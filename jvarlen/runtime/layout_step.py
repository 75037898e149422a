"""The train step for one :class:`~jvarlen.layout.Layout` over the canonical state.

The state comes in and goes out in the canonical FSDP sharding (on the state mesh); the
batch comes in split ``P('dp', 'sp')`` on the layout's mesh. Inside, parameters are
pulled (cast + resharded), attention runs Ulysses-style, gradients are pushed back.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jvarlen.config import ModelConfig
from jvarlen.layout import Layout
from jvarlen.model.transformer import resolve_compute_dtype
from jvarlen.parallel.layouts import batch_sharding, layout_mesh, state_mesh
from jvarlen.parallel.sharding import pull, push, state_shardings
from jvarlen.parallel.ulysses import ulysses_attention_fn
from jvarlen.runtime.step import BATCH_KEYS, loss_and_grads, make_train_step


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

    def mesh(self, layout: Layout) -> Mesh:
        return layout_mesh(layout, self.devices)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.state_mesh, P())


def make_layout_step(graphdef, optimizer, placement: Placement, layout: Layout, model_cfg: ModelConfig) -> Callable:
    """The step for ``layout``, jitted with canonical state in/out (donated) and a split batch."""
    mesh = placement.mesh(layout)
    dtype = resolve_compute_dtype(model_cfg.compute_dtype)
    step = make_train_step(
        graphdef,
        optimizer,
        ulysses_attention_fn(mesh, model_cfg.attention),
        pull=lambda params: pull(params, mesh, dtype),
        push=lambda grads, params: push(grads, placement.state_sharding.params, params, mesh),
    )
    batch = {key: batch_sharding(mesh) for key in BATCH_KEYS}
    return jax.jit(
        step,
        in_shardings=(placement.state_sharding, batch),
        out_shardings=(placement.state_sharding, placement.replicated),
        donate_argnums=0,
    )


def layout_loss_and_grads(
    graphdef, params, params_sharding, batch: dict, mesh: Mesh, *, attention: str = "auto", compute_dtype: str = "auto"
):
    """(loss sums, canonical grads) of ``batch`` computed in the layout of ``mesh``."""
    dtype = resolve_compute_dtype(compute_dtype)
    attention_fn = ulysses_attention_fn(mesh, attention)

    def run(p, b):
        sums, grads = loss_and_grads(graphdef, pull(p, mesh, dtype), b, attention_fn)
        return sums, push(grads, params_sharding, p, mesh)

    b_sharding = {key: batch_sharding(mesh) for key in batch}
    return jax.jit(run, in_shardings=(params_sharding, b_sharding), out_shardings=(None, params_sharding))(
        params, batch
    )


def place_global(tree, shardings):
    """Host values (identical on every process) -> global arrays with ``shardings``.

    Works with one or many processes: each process fills only its addressable shards.
    """

    def place(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(place, tree, shardings)
