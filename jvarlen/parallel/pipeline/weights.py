"""Where a pipeline stage's layer weights live, and how they move between the canonical state and
the stages (docs/design/pipeline.md, "Stage weights").

The canonical state splits a stacked layer leaf ``[L, ...]`` over all ``N = dp·pp·sp`` devices on
one axis ``a`` (``STATE_RULES``); device ``i = (d·pp + p)·sp + s`` holds chunk ``i`` of ``a``. A
stage needs its ``L/pp`` layers: whole on every device (``replicated``), or sharded (ZeRO-3) over
its ``sp`` devices and over the ``dp`` pipelines (``sharded``). Inside the executor's
``shard_map`` (device code):

* :meth:`StageWeights.pull`: an all-to-all over ``pp`` trades layers for chunks of ``a``: device
  ``(d, p, s)`` then holds chunks ``(d, q, s)`` of its stage's layers, which is what a sharded
  stage keeps when ``dp > 1``. Otherwise an all-gather over ``dp`` completes the chunks ``(d', q)``
  of this ``s`` (the sp shard, *interleaved*), and a replicated stage gathers over ``sp`` too.
* :meth:`StageWeights.gather` / :meth:`StageWeights.reduce`: sharded, one layer's all-gather over
  the stage's ``dp × sp`` devices (one flat buffer, one collective) and its gradient's
  reduce-scatter, run by :meth:`StageWeights.layer_pass` outside the ops' conditionals (the
  ``dp`` pipelines run different ops in a tick), the next layer's gather and the previous
  layer's reduce-scatter free to overlap this layer's compute.
* :meth:`StageWeights.push`: the way back for the gradients, as reduce-scatters (over ``sp``
  where the stage is replicated, then ``dp`` where it is not sharded over it) and the inverse
  all-to-all over ``pp``.

No device ever holds more of a leaf than its stage's share, and GSPMD is not asked to reshard
between the 1-D state mesh and the layout mesh (which it does by rebuilding each weight whole on
every device). Leaves whose canonical axis is the layer axis or none (small vectors whose axes
``N`` does not divide) are left to GSPMD: spec ``P(pp)`` (``sp`` on the first axis it divides
when sharded), gradients summed with ``psum``; they are never sharded over ``dp``.
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
    on a stage (None: replicated; where it is ``canon`` a device's shard is interleaved, chunks
    ``s, s + sp, ...``, else contiguous); ``dp_shard``, whether the stage keeps only this
    pipeline's ``1/dp`` of ``canon``. Sharded leaves are gathered whole per layer
    (:meth:`StageWeights.gather`)."""

    canon: Optional[int]
    shard: Optional[int]
    dp_shard: bool = False
    dtype: Any = None  # the canonical (parameter) dtype: of the gradient accumulator
    compute_dtype: Any = None  # of the stage's copy (weight matrices in the compute dtype)
    local: bool = False  # a device group's sharded stage: ``shard`` split over sp (dp = 1), contiguous


class StageWeights:
    """The stage weights of ``layout`` for a layer state (abstract, stacked ``[L, ...]``) with its
    logical ``axes`` per leaf (``jvarlen.parallel.sharding.param_axes``). With ``compute_dtype``
    the stage holds its weight matrices in it (cast before they move: half the bytes for bf16),
    and accumulates their gradients in the parameters' dtype (the planner's
    ``stage_bytes_per_param``: a bf16 copy and an fp32 accumulator, 6 bytes). ``canonical=False``:
    the layers arrive as each stage's own, whole (spec ``P(pp)``: a device group's, pulled per
    stage by :func:`jvarlen.parallel.groups.pull_stages`), so no leaf is managed here, and each
    device returns its own contribution to its stage's gradient (:meth:`push_rows`). With
    ``mode="sharded"`` and ``group_axes`` (per leaf an axis, or None) such a stage arrives sharded
    instead (a device group's: one pipeline, dp = 1): device ``(0, p, s)`` holds the contiguous
    chunk ``s`` of the stage's layers on that axis (``local`` leaves, gathered over sp per layer
    like the canonical ones) and returns its chunk of their reduce-scattered gradient."""

    def __init__(
        self,
        layer_state,
        axes,
        layout: Layout,
        mode: str = "replicated",
        compute_dtype=None,
        canonical: bool = True,
        group_axes=None,
    ):
        if mode not in STAGE_WEIGHTS:
            raise ValueError(f"stage_weights must be one of {STAGE_WEIGHTS}, got {mode!r}")
        self.layout, self.mode, self.canonical = layout, mode, canonical
        self.sharded = mode == "sharded" and layout.sp > 1  # over the stage's sp devices
        dp_sharded = mode == "sharded" and layout.dp > 1
        state_mesh = jax.sharding.AbstractMesh((layout.num_devices,), (FSDP,))
        local_mode = mode == "sharded" and not canonical and group_axes is not None and layout.sp > 1
        if local_mode and layout.dp > 1:  # a device group is one pipeline (Scheme: pp x sp devices)
            raise ValueError(f"a device group's sharded stage needs dp = 1, got {layout}")
        group_axes = group_axes if local_mode else [None] * len(axes)
        leaves = []
        for leaf, leaf_axes, local in zip(jax.tree.leaves(layer_state), axes, group_axes):
            spec = tuple(logical_to_spec(leaf_axes, leaf.shape, STATE_RULES, state_mesh))
            canon = next((i for i, entry in enumerate(spec) if entry is not None), None)
            canon = canon if canon and canonical else None  # the layer axis itself: left to GSPMD
            shard = None
            if self.sharded:
                shard = canon if canon is not None else _first_divided(leaf.shape, layout.sp)
            cast = (
                compute_dtype is not None and is_compute_weight(leaf_axes) and jnp.issubdtype(leaf.dtype, jnp.floating)
            )
            dp_shard = dp_sharded and canon is not None
            if local:
                if leaf.shape[local] % layout.sp:
                    raise ValueError(f"sp = {layout.sp} does not divide axis {local} of {leaf.shape}")
                shard = local
            compute = compute_dtype if cast else leaf.dtype
            leaves.append(LeafLayout(canon, shard, dp_shard, leaf.dtype, compute, bool(local)))
        self.leaves = tuple(leaves)
        self.dp_sharded = any(leaf.dp_shard for leaf in self.leaves)  # over the dp pipelines
        # the devices a sharded stage's layer is gathered from: its dp pipelines' and its sp devices
        self._dg = layout.dp if mode == "sharded" else 1
        self._sg = layout.sp if mode == "sharded" else 1
        self.group = tuple(axis for axis, n in ((DP, self._dg), (SP, self._sg)) if n > 1)
        self.treedef = jax.tree.structure(layer_state)

    # ---- specs of the executor's shard_map
    def specs(self):
        """Per leaf: the canonical placement named on the layout mesh (managed leaves), else the
        stage's own spec."""
        out = []
        for leaf in self.leaves:
            if leaf.canon is not None:
                out.append(P(*([None] * leaf.canon), LAYOUT_AXES))
            elif leaf.local:
                out.append(P(PP, *([None] * (leaf.shard - 1)), (DP, SP)))
            elif leaf.shard is not None:
                out.append(P(PP, *([None] * (leaf.shard - 1)), SP))
            else:
                out.append(P(PP))
        return self.treedef.unflatten(out)

    # ---- device code
    def pull(self, layers):
        """Canonical local chunks -> this device's stage weights (sharded: interleaved shards, over dp
        as well: chunks ``(d, q, s)`` of this pipeline ``d``)."""
        out = []
        for x, leaf in zip(jax.tree.leaves(layers), self.leaves):
            x = x.astype(leaf.compute_dtype)
            if leaf.canon is not None:
                a = leaf.canon
                x = jax.lax.all_to_all(x, PP, 0, a, tiled=True)  # my stage's layers, chunks (d, q, s)
                if not leaf.dp_shard:
                    x = jax.lax.all_gather(x, DP, axis=a, tiled=True)  # chunks (d', q) of this s
                if leaf.shard is None:  # replicated: every s, back in canonical order
                    x = _interleaved_to_natural(jax.lax.all_gather(x, SP, axis=a, tiled=True), a, self.layout)
            out.append(x)
        return self.treedef.unflatten(out)

    def push(self, grads):
        """This device's stage gradients (sharded: already summed over the stage's ``dp × sp``
        devices by :meth:`reduce`, layer by layer) -> the canonical local chunks of the summed
        gradient."""
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
                if not leaf.dp_shard:
                    g = jax.lax.psum_scatter(g, DP, scatter_dimension=a, tiled=True)  # chunks (d, q, s)
                g = jax.lax.all_to_all(g, PP, a, 0, tiled=True)  # every layer, chunk (d, p, s)
            out.append(g)
        return self.treedef.unflatten(out)

    def push_rows(self, grads):
        """``canonical=False``: this device's contribution to its stage's gradient, whole layers (the
        gradients of all devices of all stages sum to the layout's): its own accumulators where the
        stage is replicated (no reduction here: the groups' update adds every device's rows), and
        where a leaf is sharded over ``sp`` (already summed over the ``sp`` devices by
        :meth:`reduce`) the whole sum on ``sp`` index 0, zeros on the others; a ``local`` leaf's
        chunk of the sum over the stage's ``dp × sp`` devices as it is (a row of the chunk)."""
        out = []
        for g, leaf in zip(jax.tree.leaves(grads), self.leaves):
            if leaf.shard is not None and not leaf.local:
                whole = jax.lax.all_gather(g, SP, axis=leaf.shard, tiled=True)
                g = jnp.where(jax.lax.axis_index(SP) == 0, whole, jnp.zeros_like(whole))
            out.append(g)
        return self.treedef.unflatten(out)

    def reduced_zeros(self, layers):
        """Zeros shaped and typed as :meth:`layer_pass` returns this device's reduced gradients of its
        stage weights ``layers`` (an idle op's): the parameters' dtype where :meth:`reduce`
        reduce-scatters, else the stage copy's."""
        return self.treedef.unflatten(
            [
                jnp.zeros(x.shape, leaf.dtype if self.group and (leaf.canon, leaf.shard) != (None, None) else x.dtype)
                for x, leaf in zip(jax.tree.leaves(layers), self.leaves)
            ]
        )

    def accumulators(self, layers):
        """Zero gradient accumulators for this device's stage weights ``layers``, in the parameters'
        dtype."""
        return self.treedef.unflatten(
            [jnp.zeros(x.shape, leaf.dtype) for x, leaf in zip(jax.tree.leaves(layers), self.leaves)]
        )

    def gather(self, lp):
        """One layer's parameters (leaves without the layer axis) from this device's chunks -> the
        whole layer, as an op uses it. Sharded, the chunks of every managed leaf travel as one flat
        byte buffer in one all-gather over the stage's ``dp × sp`` devices (one collective per
        layer: it can be in flight over the previous layer's compute, where XLA keeps at most one
        collective in flight); the small leaves sharded over ``sp`` only are gathered one by one.
        Called on every device of the group alike: outside the ops' conditionals where the
        pipelines of a ``dp`` group run different ops."""
        if not self.group:
            return lp
        leaves, treedef = jax.tree.flatten(lp)
        flat = [i for i, leaf in enumerate(self.leaves) if leaf.canon is not None or leaf.local]
        out = list(leaves)
        if flat:
            packed = jnp.concatenate([_to_bytes(leaves[i]) for i in flat])
            got = jax.lax.all_gather(packed, self.group, axis=0, tiled=False)  # [dg·sg, bytes], (d, s)
            at = 0
            for i in flat:
                x, leaf = leaves[i], self.leaves[i]
                n = x.size * x.dtype.itemsize
                part = _from_bytes(got[:, at : at + n], x.dtype).reshape((self._dg, self._sg) + x.shape)
                out[i] = self._chunks_to_whole(part, *self._chunk_axis(leaf))
                at += n
        for i, leaf in enumerate(self.leaves):
            if leaf.canon is None and leaf.shard is not None and not leaf.local:
                out[i] = jax.lax.all_gather(leaves[i], SP, axis=leaf.shard - 1, tiled=True)
        return treedef.unflatten(out)

    def reduce(self, grads):
        """The transpose of :meth:`gather`: one whole layer's gradient on each device of the group ->
        this device's chunks of their sum, reduce-scattered in one collective per parameter dtype,
        summed and returned in the parameters' dtype (the accumulator's: a bf16 copy of each chunk's
        sum would round every chunk's share of the gradient, which the replicated stage, summing
        fp32 accumulators once, does not)."""
        if not self.group:
            return grads
        leaves, treedef = jax.tree.flatten(grads)
        out = list(leaves)
        by_dtype: dict = {}
        for i, leaf in enumerate(self.leaves):
            if leaf.canon is not None or leaf.local:
                by_dtype.setdefault(jnp.dtype(leaf.dtype), []).append(i)
            elif leaf.shard is not None:
                out[i] = jax.lax.psum_scatter(
                    leaves[i].astype(leaf.dtype), SP, scatter_dimension=leaf.shard - 1, tiled=True
                )
        for dtype, idx in by_dtype.items():
            rows = [self._whole_to_chunks(leaves[i].astype(dtype), *self._chunk_axis(self.leaves[i])) for i in idx]
            summed = jax.lax.psum_scatter(
                jnp.concatenate([r.reshape(r.shape[0], -1) for r in rows], axis=1),
                self.group,
                scatter_dimension=0,
                tiled=False,
            )
            at = 0
            for i, r in zip(idx, rows):
                n = r[0].size
                out[i] = summed[at : at + n].reshape(r.shape[1:])
                at += n
        return treedef.unflatten(out)

    def _chunk_axis(self, leaf: LeafLayout) -> tuple[int, int]:
        """A gathered leaf's axis within one layer, and the pipeline stages its chunks interleave
        (a ``local`` leaf's chunk is contiguous: 1)."""
        return (leaf.shard - 1, 1) if leaf.local else (leaf.canon - 1, self.layout.pp)

    def _chunks_to_whole(self, x, a: int, pp: int):
        """[dg, sg, ..., pp·c (axis ``a`` of a chunk, order (q, c)), ...] -> the whole leaf, axis ``a``
        in canonical order (d, q, s, c)."""
        dg, sg = self._dg, self._sg
        shape = x.shape[2:]
        x = x.reshape((dg, sg) + shape[:a] + (pp, shape[a] // pp) + shape[a + 1 :])
        # (dg, sg, pre..., pp, c, post...) -> (pre..., dg, pp, sg, c, post...)
        pre = tuple(range(2, 2 + a))
        post = tuple(range(4 + a, x.ndim))
        x = x.transpose(pre + (0, 2 + a, 1, 3 + a) + post)
        return x.reshape(shape[:a] + (dg * sg * shape[a],) + shape[a + 1 :])

    def _whole_to_chunks(self, g, a: int, pp: int):
        """The inverse of :meth:`_chunks_to_whole`, flattened per device: [dg·sg, (d, s)] of chunks."""
        dg, sg = self._dg, self._sg
        shape = g.shape
        c = shape[a] // (dg * pp * sg)
        g = g.reshape(shape[:a] + (dg, pp, sg, c) + shape[a + 1 :])
        # (pre..., dg, pp, sg, c, post...) -> (dg, sg, pre..., pp, c, post...)
        pre = tuple(range(a))
        post = tuple(range(a + 4, g.ndim))
        g = g.transpose((a, a + 2) + pre + (a + 1, a + 3) + post)
        return g.reshape((dg * sg,) + shape[:a] + (pp * c,) + shape[a + 1 :])

    def layer_pass(self, shards, step, init, xs, reverse=False, ordered=True, reduce=False):
        """``step(carry, lp, x_j) -> (carry, y_j)`` over a stage's layers in order (``reverse``: from
        the last), ``lp`` layer j's weights as an op uses them (whole), from this device's ``shards``
        [Ls, ...]. Sharded, each layer is gathered here (:meth:`gather`): the next layer's gather
        in the loop body of this one, independent of its compute and outside its conditionals, so
        that XLA can keep it in flight over the compute (``ordered``: after it, for XLA:CPU, see
        the executor's tick). The last layer's body gathers that layer again rather than put the
        gather in a conditional, whose collectives cannot overlap anything outside it: ``Ls + 1``
        gathers per pass.
        ``reduce``: ``step`` returns ``(carry, (y_j, g_j))``, ``g_j`` the gradient with respect to
        ``lp`` (its shapes and dtypes), which the pass reduce-scatters (:meth:`reduce`) one layer
        later, in the next layer's body, so that it too is in flight over compute rather than at the
        end of its own layer, where nothing is left to overlap (the last one after the loop; the first body reduces zeros: ``Ls + 1``
        reduce-scatters per pass, and one more whole-layer gradient in flight).
        -> (carry, ys stacked [Ls, ...] in layer order; with ``reduce``, (ys, this device's reduced
        gradients [Ls, ...]))."""
        if not self.group:
            return jax.lax.scan(lambda c, xj: step(c, *xj), init, (shards, xs), reverse=reverse)
        last = jax.tree.leaves(shards)[0].shape[0] - 1

        def gather(j):
            return self.gather(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, False), shards))

        def body(carry, xj):
            c, lp, g_prev = carry
            j, x = xj
            nxt = jnp.clip(j - 1 if reverse else j + 1, 0, last)
            if not ordered:  # issued ahead of the compute, which does not need them
                ahead, reduced = gather(nxt), self.reduce(g_prev) if reduce else None
            c, y = step(c, lp, x)
            y, g = y if reduce else (y, None)
            if ordered:  # after the compute, the reduce-scatter first, the same order on every device
                nxt, c, y, g = jax.lax.optimization_barrier((nxt, c, y, g))
                reduced = self.reduce(g_prev) if reduce else None
                nxt, reduced = jax.lax.optimization_barrier((nxt, reduced))
                ahead = gather(nxt)
            return (c, ahead, g), (y, reduced)

        if ordered:  # the first gather after what the pass starts from (a collective may make it)
            shards, init = jax.lax.optimization_barrier((shards, init))
        first = gather(last if reverse else 0)
        g0 = jax.tree.map(jnp.zeros_like, first) if reduce else None  # a gradient has lp's shapes
        (c, _, g_end), (ys, reduced) = jax.lax.scan(
            body, (init, first, g0), (jnp.arange(last + 1), xs), reverse=reverse
        )
        if not reduce:
            return c, ys
        # body j reduced the layer before it in the pass (j + 1 going down, j - 1 going up)
        end = jax.tree.map(lambda a: a[None], self.reduce(g_end))
        if reverse:
            reduced = jax.tree.map(lambda e, r: jnp.concatenate([e, r[:-1]]), end, reduced)
        else:
            reduced = jax.tree.map(lambda e, r: jnp.concatenate([r[1:], e]), end, reduced)
        return c, (ys, reduced)


def _to_bytes(x):
    """``x`` as a flat uint8 vector (its bytes)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(b, dtype):
    """[..., n bytes] uint8 -> [..., n / itemsize] of ``dtype`` (the inverse of :func:`_to_bytes`)."""
    size = jnp.dtype(dtype).itemsize
    if size == 1:
        return jax.lax.bitcast_convert_type(b, dtype)
    return jax.lax.bitcast_convert_type(b.reshape(b.shape[:-1] + (b.shape[-1] // size, size)), dtype)


def _first_divided(shape, n: int) -> Optional[int]:
    return next((axis for axis in range(1, len(shape)) if shape[axis] % n == 0), None)


def _interleaved_to_natural(x, axis: int, layout: Layout):
    """Axis ``axis`` of ``x`` in order ``(s, d, q, c)`` (gathered over sp from interleaved shards)
    -> canonical order ``(d, q, s, c)``. The identity with one sp device (then ``x`` may hold only
    its pipeline's ``1/dp``, which the reshape below could not split)."""
    sp, m = layout.sp, layout.dp * layout.pp
    if sp == 1:
        return x
    shape = x.shape
    x = x.reshape(shape[:axis] + (sp, m, shape[axis] // (sp * m)) + shape[axis + 1 :])
    x = jax.numpy.swapaxes(x, axis, axis + 1)
    return x.reshape(shape)


def _natural_to_interleaved(x, axis: int, layout: Layout):
    """The inverse of :func:`_interleaved_to_natural`."""
    sp, m = layout.sp, layout.dp * layout.pp
    if sp == 1:
        return x
    shape = x.shape
    x = x.reshape(shape[:axis] + (m, sp, shape[axis] // (sp * m)) + shape[axis + 1 :])
    x = jax.numpy.swapaxes(x, axis, axis + 1)
    return x.reshape(shape)
