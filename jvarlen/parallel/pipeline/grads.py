"""A pipeline step's gradients: the tick program (:mod:`.executor`) of one plan, or of a step's
parts one after the other, under ``shard_map`` on the layout's mesh."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jvarlen.config import ModelConfig
from jvarlen.parallel.layouts import LAYOUT_AXES, PP
from jvarlen.parallel.pipeline.executor import DATA, StageProgram, split_params
from jvarlen.parallel.pipeline.rest import hand_rest, rest_specs
from jvarlen.parallel.pipeline.signature import PipelineSignature
from jvarlen.parallel.pipeline.stage import stage_shapes
from jvarlen.parallel.sharding import cast_pulled


def make_pipeline_grads(
    graphdef,
    cfg: ModelConfig,
    sig: PipelineSignature | tuple[PipelineSignature, ...],
    mesh,
    attention_fn=None,
    residual_policy: Optional[str] = None,
    stage_weights: str = "replicated",
    canonical: bool = True,
    group_axes=None,
    vocab_max_sp: Optional[int] = None,
    per_layer_grads: Optional[bool] = None,
):
    """The un-jitted ``grads(params, batch) -> (sums, grads, layer_forwards [dp, pp])``.

    ``grads`` are of the mean loss over every real target of all pipelines (like
    :func:`jvarlen.runtime.step.loss_and_grads`), accumulated over chunks and pipelines.
    ``sig``: a :class:`PipelineSignature`, or a tuple of them, the step's *parts* (one layout): each
    part's chunks padded to its own bucket and run with its own tables, one part after the other
    in one program, every part starting from the previous one's gradient accumulators (so the
    parts hold no second copy of them; docs/design/bucket-parts.md); ``batch`` is then a tuple of
    the parts' inputs and the loss is the mean over all of them.
    ``residual_policy``: what a stored layer keeps (see ``StageFns.residual_policy``).
    ``stage_weights``: ``"replicated"`` (every device of a stage holds its layers) or
    ``"sharded"`` (ZeRO-3 over the stage's sp devices and the dp pipelines: a device holds 1/(dp·sp)
    of each layer and of its gradient accumulator, and gathers each layer whole one layer ahead).
    The embedding table and an untied head are split by vocabulary over the stage's sp devices
    where sp divides the vocabulary and is at most ``vocab_max_sp`` (the devices of a node; None:
    any sp; :mod:`.rest`; with ``canonical=False`` each device's rest row holds its rows of them).
    ``canonical``: the layers arrive in the canonical placement over the mesh's devices (the
    pipeline strategy's), or each stage's whole, ``P(pp)`` (a device group's, pulled per stage);
    the layer gradients then come back as one ``[1, L/pp, ...]`` row per device, ``[n, L/pp, ...]``
    over ``(dp, pp, sp)``, which sum to the layout's gradient (``StageWeights.push_rows``), and the
    rest's as one ``[1, ...]`` row per device, ``[n, ...]``, unreduced as well.
    ``group_axes`` (with ``canonical=False`` and sharded stage weights): per layer leaf, the axis
    its stage arrives split on over the stage's sp devices (contiguous chunks; a group has dp = 1), or None;
    the rows are then each device's chunk of the stage's summed gradient. ``grads.layer_specs``:
    the layers' partition specs it takes.
    ``per_layer_grads``: a backward adds each layer's gradients into the accumulators as it goes
    (one layer's gradient held, not the stage's stack; ``StageProgram.per_layer``; stage weights
    sharded over more than one device keep their stacked reduce-scattered gradients); None: where
    the mesh is not XLA:CPU's.
    """
    parts = isinstance(sig, tuple)
    sigs = sig if parts else (sig,)
    if not sigs or len({(s.layout, s.num_layers) for s in sigs}) != 1:
        raise ValueError(f"a step's parts need one layout and model, got {sigs}")
    shapes = [
        stage_shapes(
            graphdef, cfg, s, attention_fn, residual_policy, stage_weights, canonical, group_axes, vocab_max_sp
        )
        for s in sigs
    ]
    weights = shapes[0].fns.weights  # the layout's: the same for every part
    compute_dtype = shapes[0].compute_dtype

    cpu = all(d.platform == "cpu" for d in getattr(mesh, "devices", np.empty(0)).flat)

    def device_fn(layers, rest, bs, scale):
        pulled, acc = weights.pull(layers), None
        for s, b in zip(shapes, bs):
            program = StageProgram(s, pulled, rest, b, scale, cpu, per_layer_grads)
            acc = program.accumulate(acc)
        return program.finish(acc)

    def grads(params, batch):
        batches = tuple(batch) if parts else (batch,)
        if len(batches) != len(sigs):
            raise ValueError(f"{len(batches)} batches for a step of {len(sigs)} parts")
        layers, rest = split_params(params)
        # the rest moves and is held as the stages compute with it: an untied head in the compute
        # dtype, the embedding table and norm scales in their own; its gradients still accumulate
        # in fp32 (a no-op for a device group's rest, pulled so already)
        rest = cast_pulled(rest, compute_dtype)
        if canonical and not cpu:  # XLA:CPU gathers the whole table either way (rest.hand_rest)
            rest = hand_rest(rest, mesh, shapes[0].vocab_shards)
        targets = sum(jnp.sum(b["loss_mask"]) for b in batches).astype(jnp.float32)
        scale = 1.0 / jnp.maximum(targets, 1.0)
        layer_spec = weights.specs()
        rest_spec = rest_specs(rest, shapes[0].vocab_shards)  # the table and head split by vocabulary over sp
        batch_spec = tuple({key: P(DATA) for key in b} for b in batches)
        rows = jax.tree.map(lambda _: P(LAYOUT_AXES), layer_spec)  # canonical=False: a row per device
        rest_rows = jax.tree.map(lambda _: P(LAYOUT_AXES), rest)
        g_layers, g_rest, loss, count = jax.shard_map(
            device_fn,
            mesh=mesh,
            in_specs=(layer_spec, rest_spec, batch_spec, P()),
            out_specs=(layer_spec if canonical else rows, rest_spec if canonical else rest_rows, P(), P(DATA, PP)),
            check_vma=False,
        )(layers, rest, batches, scale)
        grads = nnx.merge_state(g_rest, nnx.State({"layers": g_layers}))
        return {"loss_sum": loss, "target_tokens": targets}, grads, count

    grads.layer_specs = weights.specs()
    return grads
