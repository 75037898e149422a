"""The cost model's memory terms against XLA: the activation memory it predicts for a chunk
(InfiniPipe Eq. 5/9/10 plus the working memory of the backward in flight) against
``compile().memory_analysis()`` of the real decoder's forward+backward programs
(``scripts/validate_cost_memory.py``)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import numpy as np

from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, ModelShape


@dataclasses.dataclass(frozen=True)
class MemoryCase:
    """One compiled program whose XLA memory is compared with the cost model: ``layers`` decoder
    layers of the profiler's harness (the first ``remat`` recomputed), forward + backward of
    ``chunk``; ``head=True``: the whole model's chunk step (embedding, all layers, head, loss,
    gradient accumulation) instead of a layer slice."""

    chunk: ChunkShape
    layers: int
    remat: int = 0
    head: bool = False


def predict_memory(shape: ModelShape, coeffs: CostCoefficients, case: MemoryCase) -> dict:
    """Cost-model prediction for ``case`` (bytes): Eq. 10 stored activations, the working memory
    of the backward in flight, and their sum, the predicted peak (``CostModel.peak_memory``).

    The harness keeps no K/V for later slices and receives no dK/dV from them (those buffers
    belong to the pipeline executor), so the chunk is charged as a tail chunk (I = 1 in Eq. 5/9).
    """
    from jvarlen.plan.cost import CostModel

    model = shape if case.head else dataclasses.replace(shape, num_layers=case.layers)
    cost = CostModel(model, Layout(1, 1, 1), coeffs)
    chunk = dataclasses.replace(case.chunk, tail=True)
    stage = 0 if case.head else None
    eq10 = cost.activation_memory(chunk, case.remat, stage)
    work = cost.working_memory(chunk, case.remat)
    return {"eq10": eq10, "work": work, "peak": eq10 + work}


def measure_memory_case(harness, case: MemoryCase) -> Optional[dict]:
    """XLA's ``memory_analysis()`` of the case's program on this backend (compiled, not run)."""
    from jvarlen.profile.measure import program_memory

    if case.head:
        batch = harness.chunk_inputs(case.chunk)
        return program_memory(
            harness.chunk_step_program(case.remat), harness.params, harness.zeros_like_params(), batch
        )
    batch = harness.layer_inputs(case.chunk)
    return program_memory(harness.layers_program(case.layers, "fwdbwd", case.remat), harness.params, batch)


def layer_residual_bytes(harness, chunk: ChunkShape) -> int:
    """Bytes autodiff saves for the backward of one decoder layer on ``chunk`` (``jax.vjp``'s
    residual leaves minus what its caller holds anyway: the layer's parameters, the chunk's context
    K/V and its segment metadata; by ``jax.eval_shape``, nothing is compiled) under the harness's
    residual policy. Independent of XLA's buffer assignment: what Eq. 5's ``M_token`` should count."""
    from flax import nnx

    from jvarlen.model import AttentionInputs
    from jvarlen.model.transformer import layer_body

    batch = harness.layer_inputs(chunk)
    model = nnx.merge(harness.graphdef, harness.params)
    gdef, stacked = nnx.split(model.layers)
    state0 = jax.tree.map(lambda a: a[0], stacked)

    def residuals(state, x, ck, cv, metadata):
        inputs = AttentionInputs(*metadata)
        attn = harness._attention_fn(ck, cv)
        body = layer_body(
            gdef, inputs, attn, compute_dtype=harness.dtype, remat=False, residual=harness.residual_policy
        )
        _, vjp = jax.vjp(lambda s, y: body(y, s)[0], state, x)
        held = {id(p) for p in jax.tree.leaves((state, ck, cv, metadata))}
        return [r for r in jax.tree.leaves(vjp) if id(r) not in held]

    metadata = tuple(batch[k] for k in ("seg", "pos", "kv_seg", "kv_pos"))
    shapes = jax.eval_shape(residuals, state0, batch["x"], batch["ctx_k"], batch["ctx_v"], metadata)
    return int(sum(np.prod(s.shape) * s.dtype.itemsize for s in shapes))


def memory_check(harness, coeffs: CostCoefficients, cases: Sequence[MemoryCase]) -> list[dict]:
    """Measured (XLA) vs predicted (cost model) memory of each case; ``rel_err`` of the predicted
    peak against ``temp_size_in_bytes``. Empty when the backend reports no memory analysis."""
    rows = []
    for case in cases:
        measured = measure_memory_case(harness, case)
        if measured is None:
            return []
        pred = predict_memory(harness.shape, coeffs, case)
        rows.append(
            {
                "context": case.chunk.context,
                "slices": list(case.chunk.slices),
                "layers": case.layers,
                "remat": case.remat,
                "head": case.head,
                **{f"measured_{k}": v for k, v in measured.items()},
                **{f"predicted_{k}": v for k, v in pred.items()},
                "rel_err": (pred["peak"] - measured["temp"]) / measured["temp"],
            }
        )
    return rows
