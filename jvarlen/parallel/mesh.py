"""Device meshes for data parallelism (and, through Layout, for dp × pp × sp)."""

from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"


def data_mesh(num_devices: int | None = None) -> jax.sharding.Mesh:
    """A 1-D mesh over all (or the first ``num_devices``) devices, axis ``data``."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    return jax.make_mesh((n,), (DATA_AXIS,), axis_types=(AxisType.Auto,), devices=devices[:n])


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharded(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Rows of a ``[B, T]`` batch split over the data axis."""
    return NamedSharding(mesh, P(DATA_AXIS))
