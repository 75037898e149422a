"""The pure training step ``train_step(state, batch) -> (state, metrics)``.

A batch is a dict of ``[B, T]`` arrays from the packer: ``tokens``, ``segment_ids``,
``positions``, ``targets``, ``loss_mask``. Metrics are sums plus token counts (token
counts vary per batch), reduced over data-parallel shards by the sharded jit.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jvarlen.model import AttentionInputs, cross_entropy_sums
from jvarlen.runtime.state import TrainState

BATCH_KEYS = ("tokens", "segment_ids", "positions", "targets", "loss_mask")


def loss_sums(graphdef, params, batch: dict, attention_fn=None) -> dict:
    """Forward pass and loss sums of one packed batch."""
    model = nnx.merge(graphdef, params)
    inputs = AttentionInputs(segment_ids=batch["segment_ids"], positions=batch["positions"])
    logits = model(batch["tokens"], inputs, attention_fn)
    return cross_entropy_sums(logits, batch["targets"], batch["loss_mask"])


def loss_and_grads(graphdef, params, batch: dict, attention_fn=None):
    """(sums, grads) where grads are of the *mean* loss over the batch's real targets."""

    def mean_loss(p):
        sums = loss_sums(graphdef, p, batch, attention_fn)
        return sums["loss_sum"] / jnp.maximum(sums["target_tokens"], 1.0), sums

    (_, sums), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
    return sums, grads


def make_train_step(
    graphdef,
    optimizer: optax.GradientTransformation,
    attention_fn: Optional[Callable] = None,
    *,
    pull: Optional[Callable] = None,
    push: Optional[Callable] = None,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """Returns the un-jitted step; callers jit it with their shardings and donation.

    ``attention_fn=None`` uses the model's configured implementation. ``pull(params)``
    maps the stored params to what propagation uses and ``push(grads, params)`` maps the
    gradients back (jvarlen.parallel.sharding); both default to the identity.
    """

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        params = state.params if pull is None else pull(state.params)
        sums, grads = loss_and_grads(graphdef, params, batch, attention_fn)
        if push is not None:
            grads = push(grads, state.params)
        return apply_gradients(optimizer, state, grads, sums, batch["segment_ids"])

    return train_step


def apply_gradients(optimizer, state: TrainState, grads, sums: dict, segment_ids) -> tuple[TrainState, dict]:
    """One optimizer update from the iteration's gradients, skipped when anything is not finite.

    The update is applied only if the loss sum, the gradient norm and the update's norm are all
    finite; otherwise parameters and optimizer state stay as they were (the step counter still
    advances) and ``metrics["nonfinite"]`` is 1. The check rides on the metrics the loop already
    fetches, so it costs no extra host sync. Metrics: the loss ``sums``, ``real_tokens``,
    ``grad_norm``, ``nonfinite``.
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
        "real_tokens": jnp.sum(segment_ids > 0).astype(jnp.float32),
        "grad_norm": grad_norm,
        "nonfinite": 1.0 - finite.astype(jnp.float32),
    }
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics
