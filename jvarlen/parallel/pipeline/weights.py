"""Where a pipeline stage's layer weights live, and how they move between the canonical state and
the stages (docs/design/pipeline.md, "Stage weights").

The canonical state splits a stacked layer leaf ``[L, ...]`` over all ``N = dp·pp·sp`` devices on
one axis ``a`` (``STATE_RULES``); device ``i = (d·pp + p)·sp + s`` holds chunk ``i`` of ``a``. A
stage needs its ``L/pp`` layers, whole (``replicated``) or split over its ``sp`` devices
(``sharded``, ZeRO-3 over the sp group). Inside the executor's ``shard_map`` (device code):

* :meth:`StageWeights.pull`: an all-to-all over ``pp`` trades layers for chunks of ``a``, an
  all-gather over ``dp`` completes the chunks ``(d', q)`` of this ``s``: the sharded stage holds
  every ``sp``-th canonical chunk of ``a`` (*interleaved*; :meth:`gather_layer` undoes the order
  after its all-gather over ``sp``). Replicated stages gather over ``sp`` too.
* :meth:`StageWeights.push`: the way back for the gradients, as reduce-scatters (over ``sp``
  where the stage is replicated, then ``dp``) and the inverse all-to-all over ``pp``.

No device ever holds more of a leaf than its stage's share, and GSPMD is not asked to reshard
between the 1-D state mesh and the layout mesh (which it does by rebuilding each weight whole on
every device). Leaves whose canonical axis is the layer axis or none (small vectors whose axes
``N`` does not divide) are left to GSPMD: spec ``P(pp)`` (``sp`` on the first axis it divides
when sharded), gradients summed with ``psum``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jvarlen.config import STAGE_WEIGHTS
from jvarlen.layout import Layout
from jvarlen.parallel.layouts import DP, FSDP, LAYOUT_AXES, PP, SP, STATE_RULES, logical_to_spec
from jvarlen.parallel.sharding import is_compute_weight


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """One stacked layer leaf ``[L, ...]``: ``canon``, the axis split over all devices in the
    canonical state (None: this leaf is resharded by GSPMD); ``shard``, the axis split over ``sp``
    on a stage (None: replicated); ``interleave``, how many canonical chunks of ``shard`` lie
    between two of one device's (``dp·pp`` when ``shard == canon``, else 1: contiguous)."""

    canon: Optional[int]
    shard: Optional[int]
    interleave: int = 1
    dtype: Any = None  # the canonical (parameter) dtype: of the gradient accumulator
    compute_dtype: Any = None  # of the stage's copy (weight matrices in the compute dtype)


class StageWeights:
    """The stage weights of ``layout`` for a layer state (abstract, stacked ``[L, ...]``) with its
    logical ``axes`` per leaf (``jvarlen.parallel.sharding.param_axes``). With ``compute_dtype``
    the stage holds its weight matrices in it (cast before they move: half the bytes for bf16),
    and accumulates their gradients in the parameters' dtype (the planner's
    ``stage_bytes_per_param``: a bf16 copy and an fp32 accumulator, 6 bytes)."""

    def __init__(self, layer_state, axes, layout: Layout, mode: str = "replicated", compute_dtype=None):
        if mode not in STAGE_WEIGHTS:
            raise ValueError(f"stage_weights must be one of {STAGE_WEIGHTS}, got {mode!r}")
        self.layout, self.mode = layout, mode
        self.sharded = mode == "sharded" and layout.sp > 1
        state_mesh = jax.sharding.AbstractMesh((layout.num_devices,), (FSDP,))
        leaves = []
        for leaf, leaf_axes in zip(jax.tree.leaves(layer_state), axes):
            spec = tuple(logical_to_spec(leaf_axes, leaf.shape, STATE_RULES, state_mesh))
            canon = next((i for i, entry in enumerate(spec) if entry is not None), None)
            canon = canon if canon else None  # the layer axis itself: left to GSPMD
            shard = None
            if self.sharded:
                shard = canon if canon is not None else _first_divided(leaf.shape, layout.sp)
            interleave = layout.dp * layout.pp if shard is not None and shard == canon else 1
            cast = (
                compute_dtype is not None and is_compute_weight(leaf_axes) and jnp.issubdtype(leaf.dtype, jnp.floating)
            )
            leaves.append(LeafLayout(canon, shard, interleave, leaf.dtype, compute_dtype if cast else leaf.dtype))
        self.leaves = tuple(leaves)
        self.treedef = jax.tree.structure(layer_state)

    # ---- specs of the executor's shard_map
    def specs(self):
        """Per leaf: the canonical placement named on the layout mesh (managed leaves), else the
        stage's own spec."""
        out = []
        for leaf in self.leaves:
            if leaf.canon is not None:
                out.append(P(*([None] * leaf.canon), LAYOUT_AXES))
            elif leaf.shard is not None:
                out.append(P(PP, *([None] * (leaf.shard - 1)), SP))
            else:
                out.append(P(PP))
        return self.treedef.unflatten(out)

    # ---- device code
    def pull(self, layers):
        """Canonical local chunks -> this device's stage weights (sharded: interleaved shards)."""
        out = []
        for x, leaf in zip(jax.tree.leaves(layers), self.leaves):
            x = x.astype(leaf.compute_dtype)
            if leaf.canon is not None:
                a = leaf.canon
                x = jax.lax.all_to_all(x, PP, 0, a, tiled=True)  # my stage's layers, chunks (d, q, s)
                x = jax.lax.all_gather(x, DP, axis=a, tiled=True)  # chunks (d', q) of this s
                if leaf.shard is None:  # replicated: every s, back in canonical order
                    x = _interleaved_to_natural(jax.lax.all_gather(x, SP, axis=a, tiled=True), a, self.layout)
            out.append(x)
        return self.treedef.unflatten(out)

    def push(self, grads):
        """This device's stage gradients (not yet summed over ``dp``; over ``sp`` only where the
        stage is sharded) -> the canonical local chunks of the summed gradient."""
        out = []
        for g, leaf in zip(jax.tree.leaves(grads), self.leaves):
            if leaf.canon is None:
                g = jax.lax.psum(g, DP if leaf.shard is not None else (DP, SP))
            else:
                a = leaf.canon
                if leaf.shard is None:  # full stage gradient: reduce-scatter over sp first
                    g = jax.lax.psum_scatter(
                        _natural_to_interleaved(g, a, self.layout), SP, scatter_dimension=a, tiled=True
                    )
                g = jax.lax.psum_scatter(g, DP, scatter_dimension=a, tiled=True)  # chunks (d, q, s)
                g = jax.lax.all_to_all(g, PP, a, 0, tiled=True)  # every layer, chunk (d, p, s)
            out.append(g)
        return self.treedef.unflatten(out)

    def accumulators(self, layers):
        """Zero gradient accumulators for this device's stage weights ``layers``, in the parameters'
        dtype."""
        return self.treedef.unflatten(
            [jnp.zeros(x.shape, leaf.dtype) for x, leaf in zip(jax.tree.leaves(layers), self.leaves)]
        )

    def gather_layer(self, lp):
        """One layer's parameters (leaves without the layer axis) from this device's shards
        (:meth:`scatter_layer_grad` is its transpose)."""
        if not self.sharded:
            return lp
        leaves, treedef = jax.tree.flatten(lp)
        full = []
        for x, leaf in zip(leaves, self.leaves):
            if leaf.shard is not None:
                axis = leaf.shard - 1
                x = jax.lax.all_gather(x, SP, axis=axis, tiled=True)
                if leaf.interleave > 1:
                    x = _interleaved_to_natural(x, axis, self.layout)
            full.append(x)
        return treedef.unflatten(full)

    def scatter_layer_grad(self, grads):
        """The transpose of :meth:`gather_layer`: a whole layer's gradient on each device of the sp
        group -> this device's shard of their sum (summed in the parameters' dtype, returned in the
        shard's)."""
        leaves, treedef = jax.tree.flatten(grads)
        out = []
        for g, leaf in zip(leaves, self.leaves):
            if leaf.shard is not None:
                axis = leaf.shard - 1
                if leaf.interleave > 1:
                    g = _natural_to_interleaved(g, axis, self.layout)
                g = jax.lax.psum_scatter(g.astype(leaf.dtype), SP, scatter_dimension=axis, tiled=True)
                g = g.astype(leaf.compute_dtype)
            out.append(g)
        return treedef.unflatten(out)


def _first_divided(shape, n: int) -> Optional[int]:
    return next((axis for axis in range(1, len(shape)) if shape[axis] % n == 0), None)


def _interleaved_to_natural(x, axis: int, layout: Layout):
    """Axis ``axis`` of ``x`` in order ``(s, d, q, c)`` (gathered over sp from interleaved shards)
    -> canonical order ``(d, q, s, c)``."""
    sp, m = layout.sp, layout.dp * layout.pp
    shape = x.shape
    x = x.reshape(shape[:axis] + (sp, m, shape[axis] // (sp * m)) + shape[axis + 1 :])
    x = jax.numpy.swapaxes(x, axis, axis + 1)
    return x.reshape(shape)


def _natural_to_interleaved(x, axis: int, layout: Layout):
    """The inverse of :func:`_interleaved_to_natural`."""
    sp, m = layout.sp, layout.dp * layout.pp
    shape = x.shape
    x = x.reshape(shape[:axis] + (m, sp, shape[axis] // (sp * m)) + shape[axis + 1 :])
    x = jax.numpy.swapaxes(x, axis, axis + 1)
    return x.reshape(shape)
