"""Meshes for a :class:`~jvarlen.layout.Layout` and the logical-axis → mesh-axis rules.

Every layout arranges the *same* ordered device list as a ``(dp, pp, sp)`` mesh with
``sp`` fastest varying (an SP group is a run of consecutive devices: one node when the
list is in host order). The canonical state lives on a separate 1-D ``fsdp`` mesh over
that same list, so its sharding never changes when the layout does.

Model code names logical axes only (``vocab``, ``embed``, ``heads``, ``kv_heads``,
``head_dim``, ``mlp``; stacked layer weights get a leading ``layers``); activations use
``batch`` and ``seq``. The tables below are the only place where they meet mesh axes.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jvarlen.layout import Layout

DP, PP, SP = "dp", "pp", "sp"
LAYOUT_AXES = (DP, PP, SP)
FSDP = "fsdp"  # the one axis of the canonical-state mesh (all devices)

# A rule is (logical axis, mesh axes or None). Rules are tried in order; a mesh axis is
# used at most once per array and only where it divides the dimension.
Rules = tuple[tuple[str, Optional[tuple[str, ...]]], ...]

# Canonical state (ZeRO-3/FSDP): each parameter and optimizer moment is split over all
# devices along the first listed logical axis whose size the device count divides;
# arrays with no such axis (tiny vectors) are replicated.
STATE_RULES: Rules = (
    ("embed", (FSDP,)),
    ("mlp", (FSDP,)),
    ("vocab", (FSDP,)),
    ("heads", (FSDP,)),
    ("kv_heads", (FSDP,)),
    ("head_dim", (FSDP,)),
    ("layers", (FSDP,)),
)

# Propagation inside a layout (no tensor parallelism): weights whole on every device
# (pulled by an all-gather), token rows over dp, tokens of a row over sp. Inside
# Ulysses attention the heads move to sp (see jvarlen.parallel.ulysses).
COMPUTE_RULES: Rules = (
    ("batch", (DP,)),
    ("seq", (SP,)),
    ("layers", None),
    ("vocab", None),
    ("embed", None),
    ("mlp", None),
    ("heads", None),
    ("kv_heads", None),
    ("head_dim", None),
)


def layout_mesh(layout: Layout, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """The ``(dp, pp, sp)`` mesh of ``layout`` over ``devices`` (default: all, host order)."""
    devices = _device_list(devices)
    layout.validate(len(devices))
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return Mesh(grid.reshape(layout.dp, layout.pp, layout.sp), LAYOUT_AXES, axis_types=(AxisType.Auto,) * 3)


def state_mesh(devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """The 1-D ``fsdp`` mesh of the canonical state, over the same device order."""
    devices = _device_list(devices)
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return Mesh(grid, (FSDP,), axis_types=(AxisType.Auto,))


def _device_list(devices) -> list[jax.Device]:
    """``devices`` as a list; by default all devices by process, then id (host order)."""
    if devices is None:
        return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return list(devices)


def logical_to_spec(axes: Iterable[Optional[str]], shape: Sequence[int], rules: Rules, mesh: Mesh) -> P:
    """PartitionSpec of an array with logical ``axes`` under ``rules`` on ``mesh``.

    Rules are applied in order; each mesh axis is used once, and only on a dimension it
    divides (otherwise that dimension stays whole).
    """
    axes = tuple(axes)
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {tuple(shape)}")
    spec: list = [None] * len(shape)
    used: set[str] = set()
    for name, mesh_axes in rules:
        if mesh_axes is None or any(a in used for a in mesh_axes):
            continue
        size = math.prod(mesh.shape[a] for a in mesh_axes)
        for dim, axis in enumerate(axes):
            if axis == name and spec[dim] is None and shape[dim] % size == 0:
                spec[dim] = mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes
                used.update(mesh_axes)
                break
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def batch_spec() -> P:
    """``[B, T]`` batch arrays: rows over dp, tokens over sp."""
    return P(DP, SP)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, batch_spec())
