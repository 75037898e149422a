"""The pure training step ``train_step(state, batch) -> (state, metrics)``.

A batch is a dict of ``[B, T]`` arrays from the packer: ``tokens``, ``segment_ids``,
``positions``, ``targets``, ``loss_mask``. Metrics are sums plus token counts (token
counts vary per batch), reduced over data-parallel shards by the sharded jit.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jvarlen.model import AttentionInputs
from jvarlen.model.layers import fp32_weight_gradients
from jvarlen.runtime.state import TrainState

BATCH_KEYS = ("tokens", "segment_ids", "positions", "targets", "loss_mask")


def loss_sums(graphdef, params, batch: dict, attention_fn=None, spmd=None, residual=None, position_edges=()) -> dict:
    """Forward pass and loss sums of one packed batch (``spmd``: the head's token shards,
    :class:`jvarlen.parallel.sharding.TokenShards`; ``residual``: what a layer that is not
    rematerialised keeps, :func:`jvarlen.model.transformer.layer_body`; ``position_edges``: also
    the sums by position, forward only, :meth:`jvarlen.model.Transformer.loss_sums_by_position`)."""
    model = nnx.merge(graphdef, params)
    inputs = AttentionInputs(segment_ids=batch["segment_ids"], positions=batch["positions"])
    x = model.hidden(batch["tokens"], inputs, attention_fn, residual)
    if position_edges:
        return model.loss_sums_by_position(
            x, batch["targets"], batch["loss_mask"], batch["positions"], tuple(position_edges), spmd
        )
    return model.loss_sums(x, batch["targets"], batch["loss_mask"], spmd)


def loss_and_grads(graphdef, params, batch: dict, attention_fn=None, spmd=None, residual=None):
    """(sums, grads) where grads are of the *mean* loss over the batch's real targets."""

    def mean_loss(p):
        sums = loss_sums(graphdef, p, batch, attention_fn, spmd, residual)
        return sums["loss_sum"] / jnp.maximum(sums["target_tokens"], 1.0), sums

    (_, sums), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
    return sums, grads


GradsFn = Callable[[object, dict], tuple]  # (params, batch) -> (loss sums, grads, extra metrics)
SumsFn = Callable[[object, dict], dict]  # (params, batch) -> loss sums: the forward pass only


def single_program_sums(
    graphdef, attention_fn: Optional[Callable] = None, *, pull=None, spmd=None, position_edges=()
) -> SumsFn:
    """The loss sums of one packed batch in one program, forward only (evaluation): ``pull`` and
    ``spmd`` as in :func:`single_program_grads`; ``position_edges``: also by position (:func:`loss_sums`)."""

    def sums_fn(params, batch):
        pulled = params if pull is None else pull(params)
        return loss_sums(graphdef, pulled, batch, attention_fn, spmd, position_edges=position_edges)

    return sums_fn


def single_program_grads(
    graphdef,
    attention_fn: Optional[Callable] = None,
    *,
    pull: Optional[Callable] = None,
    push: Optional[Callable] = None,
    fp32_weight_sums: bool = False,
    spmd=None,
    residual: Optional[str] = None,
) -> GradsFn:
    """Gradients of one packed batch in one program (the data-parallel layouts' way): ``pull(params)``
    maps the stored parameters to what propagation uses and ``push(grads, params)`` maps the
    gradients back (jvarlen.parallel.sharding); both default to the identity.
    ``fp32_weight_sums``: the layer matmuls' weight gradients get an fp32 output, so that the
    partitioner sums them over the layout's devices in fp32 (:func:`jvarlen.model.layers.fp32_weight_gradients`).
    ``spmd``: the layout's token shards, over which the head tiles each device's own tokens
    (:class:`jvarlen.parallel.sharding.TokenShards`). ``residual``: what a layer that is not
    rematerialised keeps (``parallel.residual_policy``; None: every residual)."""

    def grads_fn(params, batch):
        with fp32_weight_gradients() if fp32_weight_sums else contextlib.nullcontext():
            pulled = params if pull is None else pull(params)
            sums, grads = loss_and_grads(graphdef, pulled, batch, attention_fn, spmd, residual)
        return sums, grads if push is None else push(grads, params), {}

    return grads_fn


def make_train_step(grads_fn: GradsFn, optimizer: optax.GradientTransformation) -> Callable:
    """The one train step of every execution strategy: ``train_step(state, batch) -> (state,
    metrics)``. A strategy supplies only how an iteration's gradients are computed (``grads_fn``:
    one program, pipeline ticks, device groups); the update is :func:`apply_gradients`. Un-jitted:
    :func:`compile_train_step` jits it with the strategy's shardings and donation."""

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        sums, grads, extra = grads_fn(state.params, batch)
        state, metrics = apply_gradients(optimizer, state, grads, _with_real_tokens(sums, batch))
        return state, {**metrics, **extra}

    return train_step


def make_eval_step(sums_fn: SumsFn) -> Callable:
    """The train step without its backward pass and update: ``eval_step(state, batch) -> loss sums``
    (``loss_sum``, ``target_tokens``, ``real_tokens``). The state is read, not changed (and not
    donated: :func:`lower_train_step` with ``forward_only``)."""

    def eval_step(state: TrainState, batch: dict) -> dict:
        return _with_real_tokens(sums_fn(state.params, batch), batch)

    return eval_step


def _with_real_tokens(sums: dict, batch: dict) -> dict:
    if "real_tokens" in sums:
        return sums
    return {**sums, "real_tokens": jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32)}


class CompiledStep:
    """An executable ``(state, host arrays) -> (state, metrics)``: places the numpy inputs with the
    shardings it was compiled for (each process fills only its own shards) and runs it."""

    def __init__(self, compiled, batch_shardings: dict):
        self.compiled = compiled
        self.batch_shardings = batch_shardings

    def __call__(self, state, arrays: dict):
        from jvarlen.parallel.sharding import place_global

        host = {k: v for k, v in arrays.items() if not isinstance(v, jax.Array)}
        placed = place_global(host, {k: self.batch_shardings[k] for k in host})
        return self.compiled(state, {k: placed.get(k, v) for k, v in arrays.items()})

    def memory_analysis(self):
        return self.compiled.memory_analysis()


def lower_train_step(
    train_step: Callable,
    abstract_state,
    state_sharding,
    batch_shapes: dict,
    batch_shardings: dict,
    metrics_sharding,
    forward_only: bool = False,
):
    """``train_step`` jitted with canonical state in and out (donated), the batch
    (``{key: ShapeDtypeStruct}``) placed with ``batch_shardings`` and metrics replicated, lowered
    for those inputs (``jax.stages.Lowered``). ``forward_only``: an evaluation step
    (:func:`make_eval_step`), which returns the metrics only and leaves the state to the run."""
    jitted = jax.jit(
        train_step,
        in_shardings=(state_sharding, batch_shardings),
        out_shardings=metrics_sharding if forward_only else (state_sharding, metrics_sharding),
        donate_argnums=() if forward_only else 0,
    )
    abstract_batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_shardings[k]) for k, v in batch_shapes.items()
    }
    return jitted.lower(abstract_state, abstract_batch)


def compile_train_step(*args, compiler_options: Optional[dict] = None, check_memory: bool = True) -> CompiledStep:
    """:func:`lower_train_step` compiled ahead of time (same arguments); refuses a step that cannot
    fit the device (:mod:`jvarlen.runtime.memory_fit`) before it runs."""
    from jvarlen.runtime.memory_fit import ensure_fits

    compiled = lower_train_step(*args).compile(compiler_options=compiler_options)
    if check_memory:
        ensure_fits(compiled)
    return CompiledStep(compiled, args[4])


def apply_gradients(optimizer, state: TrainState, grads, sums: dict) -> tuple[TrainState, dict]:
    """One optimizer update from the iteration's gradients, skipped when anything is not finite.

    The update is applied only if the loss sum, the gradient norm and the update's norm are all
    finite; otherwise parameters and optimizer state stay as they were (the step counter still
    advances) and ``metrics["nonfinite"]`` is 1. The check rides on the metrics the loop already
    fetches, so it costs no extra host sync. Metrics: the ``sums`` (loss sum, target and real
    token counts), ``grad_norm``, ``nonfinite``.
    """
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    finite = jnp.isfinite(sums["loss_sum"]) & jnp.isfinite(grad_norm) & jnp.isfinite(optax.tree.norm(updates))
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    params = jax.tree.map(keep, params, state.params)
    opt_state = jax.tree.map(keep, opt_state, state.opt_state)
    metrics = {
        **sums,
        "grad_norm": grad_norm,
        "nonfinite": 1.0 - finite.astype(jnp.float32),
    }
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics
