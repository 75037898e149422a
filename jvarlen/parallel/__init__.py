"""Meshes, layouts, the canonical sharded state, Ulysses SP (and the pipeline executor).

Layouts: :func:`layout_mesh` arranges the devices as ``(dp, pp, sp)`` for one iteration;
:data:`STATE_RULES` / :data:`COMPUTE_RULES` map the model's logical axes to mesh axes;
:func:`state_shardings` is the one canonical FSDP sharding of the train state, and
:func:`pull` / :func:`push` move parameters and gradients between it and a layout inside
the jitted step; :func:`ulysses_attention_fn` is the model's attention with tokens
sharded over ``sp``.
"""

from jvarlen.parallel.layouts import (
    COMPUTE_RULES,
    STATE_RULES,
    batch_sharding,
    layout_mesh,
    logical_to_spec,
    state_mesh,
)
from jvarlen.parallel.sharding import Placement, param_shardings, place_global, pull, push, state_shardings
from jvarlen.parallel.ulysses import ulysses_attention_fn

__all__ = [
    "COMPUTE_RULES",
    "Placement",
    "STATE_RULES",
    "batch_sharding",
    "layout_mesh",
    "logical_to_spec",
    "param_shardings",
    "place_global",
    "pull",
    "push",
    "state_mesh",
    "state_shardings",
    "ulysses_attention_fn",
]
