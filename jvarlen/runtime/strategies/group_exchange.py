"""The groups strategy's exchange with the canonical state: the ``pull``, the groups' ``rows``
resizes and the ``update`` programs (device code: :mod:`jvarlen.parallel.groups`).

Every device's buffers in the pull's output and the update's input have one shape: ``K`` layer
rows (the iteration's largest stage) and, where a group shards its stage weights (the plan's
``stage_weights``), ``1/parts`` of each weight axis (``parts``: the smallest number of chunks any
group splits its stage into, :func:`jvarlen.parallel.groups.stage_shards`; 1 where some group holds
its stage whole), starting at the device's own chunk. A group whose
stage has fewer layers or smaller chunks cuts its pulled buffers and pads its gradient rows in
small ``rows`` programs on its own devices, so that its compiled step serves any ``K`` and
``parts``. A group whose executor splits the embedding table and head by vocabulary keeps each
device's rows of the pulled copy (``rest_in``, before its program) and returns each device's rows
of their gradients, made whole in a small ``rest_out`` program on its devices.
Cache keys: ``("pull", K, parts, chunked)``, ``("update", K, parts, chunked)`` (``chunked``: some
group splits its stage, so the exchange reads each device's chunk from the stage table), ``("rest_in" | "rest_out", pp, sp, devices)``,
``("rows", pp, sp, devices, "stage" | "partial", rows in, rows out, chunks in, chunks out)``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jvarlen.layout import Layout
from jvarlen.model.transformer import resolve_compute_dtype
from jvarlen.parallel.groups import (
    GROUP_AXES,
    fsdp_axis,
    group_mesh,
    pull_stages,
    stage_shards,
    stage_view,
    sum_stage_rows,
)
from jvarlen.parallel.layouts import DP, FSDP, PP, SP
from jvarlen.parallel.pipeline import split_params
from jvarlen.parallel.pipeline.rest import rest_specs, vocab_axes
from jvarlen.parallel.sharding import pulled_dtypes, push
from jvarlen.plan.memo import MethodCaches, method_cache
from jvarlen.runtime.step import CompiledStep
from jvarlen.runtime.strategy import StepContext

SUM_KEYS = ("loss_sum", "target_tokens", "real_tokens")


class Exchange(MethodCaches):
    """The pull, resize and update programs of one run (``vocab_max_sp``: as the groups' executors
    split the vocabulary, ``Layout.vocab_shards``). A group holds its stage's layers whole on every
    device or, ``sharded`` (its plan's ``stage_weights``), split over them, so the exchange moves
    chunks. What a group holds is asked every step (its views), so it is memoized per layout."""

    def __init__(self, ctx: StepContext, vocab_max_sp=None):
        self.ctx, self.vocab_max_sp = ctx, vocab_max_sp
        layers, _ = split_params(ctx.placement.state_sharding.params)
        self.axes = [fsdp_axis(s) for s in jax.tree.leaves(layers)]  # each layer leaf's canonical axis

    # ---- shapes
    @functools.cached_property
    def pulled(self):
        """The layers and the rest as the pull moves them (abstract, whole): weight matrices in the
        compute dtype (:func:`jvarlen.parallel.sharding.pulled_dtypes`), as a stage computes with
        them."""
        compute = resolve_compute_dtype(self.ctx.model.compute_dtype)
        out = []
        for part in split_params(self.ctx.abstract_state.params):
            leaves, treedef = jax.tree.flatten(part)
            dtypes = pulled_dtypes(part, compute)
            out.append(treedef.unflatten([jax.ShapeDtypeStruct(a.shape, d) for a, d in zip(leaves, dtypes)]))
        return tuple(out)

    def vocab_shards(self, layout: Layout) -> int:
        """Over how many devices a group of ``layout`` splits the embedding table and head by
        vocabulary (``Layout.vocab_shards`` within :attr:`vocab_max_sp`); 1: whole."""
        return layout.vocab_shards(self.ctx.model.vocab_size, self.vocab_max_sp)

    @method_cache()
    def shards(self, layout: Layout, sharded: bool) -> int:
        """Chunks a group of ``layout`` splits its stage into (1: whole)."""
        return stage_shards(layout, self.pulled[0], self.axes, sharded)

    def group_axes(self, layout: Layout, sharded: bool):
        """Per layer leaf, the axis a group of ``layout`` shards its stage on (None: whole), or None
        where the stage is whole (``make_pipeline_grads``' ``group_axes``)."""
        return [a or None for a in self.axes] if self.shards(layout, sharded) > 1 else None

    def _widths(self, chunks: int) -> list:
        """Per layer leaf, its shape on one device of a stage split into ``chunks`` (whole rows)."""
        return [
            tuple(n // chunks if i == a else n for i, n in enumerate(x.shape[1:], 1))
            for x, a in zip(jax.tree.leaves(self.pulled[0]), self.axes)
        ]

    @method_cache()
    def stage_specs(self, layout: Layout, sharded: bool) -> tuple:
        """Per layer leaf, how a group of ``layout`` holds its stage: its ``P(pp)`` stack, a sharded
        stage's leaves split on their axis over ``(dp, sp)`` too."""
        chunked = self.shards(layout, sharded) > 1
        return tuple(P(PP, *([None] * (a - 1)), (DP, SP)) if chunked and a else P(PP) for a in self.axes)

    def views(self, layers: list, mesh, layout: Layout, sharded: bool) -> list:
        """A group's view of the pulled layer leaves (no copy), as :meth:`stage_specs`."""
        return [
            stage_view(x, mesh, len(spec) - 1 if len(spec) > 1 else None)
            for x, spec in zip(layers, self.stage_specs(layout, sharded))
        ]

    def partial_shapes(self, rows: int, parts: int) -> dict:
        """The update's per-device partials, name -> (shape, dtype): every device's ``K`` = ``rows``
        layer rows (``l/i``, ``[N, K, *layer]``, weight axes ``1/parts``), its row of the rest
        (``r/i``, ``[N, *param]``) and of the loss sums (``s/key``, ``[N]``)."""
        n = len(self.ctx.placement.devices)
        layers, rest = split_params(self.ctx.abstract_state.params)
        widths = self._widths(parts)
        out = {f"l/{i}": ((n, rows, *w), a.dtype) for i, (a, w) in enumerate(zip(jax.tree.leaves(layers), widths))}
        out.update({f"r/{i}": ((n, *a.shape), a.dtype) for i, a in enumerate(jax.tree.leaves(rest))})
        out.update({f"s/{key}": ((n,), np.float32) for key in SUM_KEYS})
        return out

    def state_bytes_per_device(self) -> int:
        """Bytes of the canonical train state (master weights, optimizer moments) on one device."""
        return sum(
            math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
            for a in jax.tree.leaves(self.ctx.abstract_state)
            if getattr(a, "sharding", None) is not None
        )

    # ---- programs
    def compile_pull(self, key):
        _, rows, parts, chunked = key
        placement = self.ctx.placement
        mesh, replicated, axes = placement.state_mesh, placement.replicated, self.axes
        moved = self.pulled

        def pull(params, table, shards):
            layers, rest = jax.tree.map(lambda x, a: x.astype(a.dtype), split_params(params), moved)
            rest = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), rest)
            return pull_stages(layers, table, axes, mesh, shards if chunked else None, parts), rest

        abstract = self.ctx.abstract_state.params
        layers, rest = split_params(abstract)
        layer_rows = NamedSharding(mesh, P(FSDP))
        out = (jax.tree.map(lambda _: layer_rows, layers), jax.tree.map(lambda _: replicated, rest))
        n = len(placement.devices)
        tables = (jax.ShapeDtypeStruct((n, rows), np.int32), jax.ShapeDtypeStruct((n, 2), np.int32))
        fn = jax.jit(pull, in_shardings=(placement.state_sharding.params, replicated, replicated), out_shardings=out)
        return fn.lower(abstract, *tables).compile(compiler_options=self.ctx.compiler_options)

    def compile_rows(self, key):
        """A group's per-device layer buffers resized, a copy on each device (no transfer): the
        pulled ``K`` rows of ``1/parts`` (``"stage"``, its view) cut to its stage's layers and
        chunks, or its gradient rows (``"partial"``, ``[n, rows, ...]`` over the group's devices)
        padded with zeros to ``K`` and ``1/parts``. Outside the group's program, so that its
        memory holds its own stage only."""
        _, pp, sp, devices, what, rows_in, rows_out, chunks_in, chunks_out = key
        layout = Layout(len(devices) // (pp * sp), pp, sp)
        mesh = group_mesh(layout, [self.ctx.placement.devices[i] for i in devices])
        layers, _ = self.pulled if what == "stage" else split_params(self.ctx.abstract_state.params)
        leaves = jax.tree.leaves(layers)
        w_in, w_out = self._widths(chunks_in), self._widths(chunks_out)
        if what == "stage":  # the view's and the group's own specs
            specs, shapes = list(self.stage_specs(layout, chunks_out > 1)), []  # chunks_out: the group's
            for spec, w in zip(specs, w_in):  # global: [pp·K, ...], a split axis over (dp, sp)
                shape = [pp * rows_in, *w]
                if len(spec) > 1:
                    shape[len(spec) - 1] *= layout.dp * sp
                shapes.append(tuple(shape))
            want = [(rows_out, *w) for w in w_out]
        else:
            specs = [P(GROUP_AXES)] * len(leaves)
            shapes = [(len(devices), rows_in, *w) for w in w_in]
            want = [(1, rows_out, *w) for w in w_out]

        def resize(x, shape):
            x = x[tuple(slice(0, min(a, b)) for a, b in zip(x.shape, shape))]
            return jnp.pad(x, [(0, b - a) for a, b in zip(x.shape, shape)])

        fn = jax.jit(
            jax.shard_map(
                lambda xs: [resize(x, s) for x, s in zip(xs, want)], mesh=mesh, in_specs=(specs,), out_specs=specs
            ),
            donate_argnums=0,
        )
        args = [
            jax.ShapeDtypeStruct(shape, a.dtype, sharding=NamedSharding(mesh, spec))
            for shape, a, spec in zip(shapes, leaves, specs)
        ]
        return fn.lower(args).compile(compiler_options=self.ctx.compiler_options)

    @method_cache()
    def rest_in_specs(self, layout: Layout) -> tuple:
        """Per leaf of the rest, how a group of ``layout`` takes it (``rest.rest_specs``): the table
        and an untied head split by vocabulary over sp where its executor splits them
        (:meth:`vocab_shards`), everything else whole. Asked every step: memoized per layout."""
        return tuple(
            jax.tree.leaves(rest_specs(self.pulled[1], self.vocab_shards(layout)), is_leaf=lambda x: isinstance(x, P))
        )

    def compile_rest_in(self, key):
        """A group's share of the pulled rest: where its executor splits the table and head by
        vocabulary over sp, each device keeps its rows of its view of the pulled copy (a slice on
        each device, no transfer), so that the group's program and its arguments hold ``1/sp`` of
        them; the view goes once this has read it (``GroupsStep`` keeps no other reference; a
        donation would not free it, the output being smaller). Takes and returns the split leaves
        only (:meth:`rest_in_specs`)."""
        _, pp, sp, devices = key
        layout = Layout(len(devices) // (pp * sp), pp, sp)
        mesh = group_mesh(layout, [self.ctx.placement.devices[i] for i in devices])
        split = [(x, p) for x, p in zip(jax.tree.leaves(self.pulled[1]), self.rest_in_specs(layout)) if len(p)]
        fn = jax.jit(lambda xs: xs, out_shardings=[NamedSharding(mesh, p) for _, p in split])
        args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())) for x, _ in split]
        return fn.lower(args).compile(compiler_options=self.ctx.compiler_options)

    def compile_rest_out(self, key):
        """A group's rows of the rest's gradients made whole, as the update takes them: where its
        executor splits the table and head by vocabulary over sp (``Layout.vocab_shards``), each
        device's row holds its own vocabulary rows, which land at their offset in a row of zeros
        (a copy on each device, no transfer). Outside the group's program, so that its memory holds
        its share only."""
        _, pp, sp, devices = key
        layout = Layout(len(devices) // (pp * sp), pp, sp)
        mesh = group_mesh(layout, [self.ctx.placement.devices[i] for i in devices])
        _, rest = split_params(self.ctx.abstract_state.params)
        axes = vocab_axes(rest, self.vocab_shards(layout))
        leaves, spec = jax.tree.leaves(rest), P(GROUP_AXES)

        def place(x, axis):  # x: [1, *param] with 1/sp of the vocabulary axis
            if axis is None:
                return x
            size = x.shape[axis + 1]
            whole = jnp.zeros((*x.shape[: axis + 1], size * sp, *x.shape[axis + 2 :]), x.dtype)
            return jax.lax.dynamic_update_slice_in_dim(whole, x, jax.lax.axis_index(SP) * size, axis + 1)

        fn = jax.jit(
            jax.shard_map(
                lambda xs: [place(x, a) for x, a in zip(xs, axes)],
                mesh=mesh,
                in_specs=([spec] * len(leaves),),
                out_specs=[spec] * len(leaves),
            ),
            donate_argnums=0,
        )
        shapes = [
            (len(devices), *(n // sp if i == a else n for i, n in enumerate(x.shape))) for x, a in zip(leaves, axes)
        ]
        args = [
            jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(mesh, spec)) for shape, x in zip(shapes, leaves)
        ]
        return fn.lower(args).compile(compiler_options=self.ctx.compiler_options)

    def compile_update(self, key) -> CompiledStep:
        _, rows, parts, chunked = key
        ctx = self.ctx
        placement = ctx.placement
        n, num_layers, axes = len(placement.devices), ctx.model.num_layers, self.axes
        layers, rest = split_params(ctx.abstract_state.params)
        layer_def, rest_def = jax.tree.structure(layers), jax.tree.structure(rest)
        layers, rest = jax.tree.leaves(layers), jax.tree.leaves(rest)
        canonical = placement.state_sharding.params

        def sum_partials(params, batch):
            stage_rows = layer_def.unflatten([batch[f"l/{i}"] for i in range(len(layers))])
            weights, shards = batch["w"], batch["c"] if chunked else None
            mesh = placement.state_mesh
            summed = sum_stage_rows(stage_rows, batch["t"], weights, axes, mesh, num_layers, shards, parts)
            scale = lambda x: x * weights.astype(x.dtype).reshape((n,) + (1,) * (x.ndim - 1))  # noqa: E731
            summed_rest = rest_def.unflatten([scale(batch[f"r/{i}"]).sum(0) for i in range(len(rest))])
            grads = push(nnx.merge_state(summed_rest, nnx.State({"layers": summed})), canonical, params)
            return {k: batch[f"s/{k}"].sum(0) for k in SUM_KEYS}, grads, {}

        by_device = NamedSharding(placement.state_mesh, P(FSDP))
        partials = self.partial_shapes(rows, parts)
        shapes = {k: jax.ShapeDtypeStruct(shape, dtype) for k, (shape, dtype) in partials.items()}
        shardings = {k: by_device for k in shapes}
        shapes["t"], shardings["t"] = jax.ShapeDtypeStruct((n, rows), np.int32), placement.replicated
        shapes["c"], shardings["c"] = jax.ShapeDtypeStruct((n, 2), np.int32), placement.replicated
        shapes["w"], shardings["w"] = jax.ShapeDtypeStruct((n,), np.float32), placement.replicated
        return ctx.compile(sum_partials, shapes, shardings)


__all__ = ["SUM_KEYS", "Exchange"]
