"""Training state and optimizer: fp32 master parameters, AdamW, warmup + cosine."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jvarlen.config import Config, OptimizerConfig
from jvarlen.model import Transformer, abstract_model, build_model


@struct.dataclass
class TrainState:
    """Everything a step reads and writes. ``params`` is the nnx.Param state of the model."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array  # raw uint32 key data; folded with the step for any stochastic layer


def warmup_updates(cfg: OptimizerConfig, total_steps: int) -> int:
    """The warmup's updates: ``optimizer.warmup_steps``, at most ``total_steps - 1`` (the run's last
    update then starts the decay)."""
    return min(cfg.warmup_steps, max(total_steps - 1, 0))


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """The rate of update ``count`` (0-based) of a ``total_steps`` run: ``w`` warmup updates
    (:func:`warmup_updates`) rising linearly to the peak, the first at ``peak / w`` (none is
    wasted at zero), then a cosine decay from the peak at update ``w`` to ``min_lr_ratio · peak``
    at the last update, ``total_steps - 1`` (before 2026-11-28 the first update ran at zero and the
    decay ended one update after the run)."""
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup = warmup_updates(cfg, total_steps)
    span = max(total_steps - 1 - warmup, 1)

    def rate(count):
        count = jnp.asarray(count, jnp.float32)
        rising = peak * (count + 1) / max(warmup, 1)
        progress = jnp.clip((count - warmup) / span, 0.0, 1.0)
        decaying = end + (peak - end) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
        return jnp.where(count < warmup, rising, decaying)

    return rate


def _decay_mask(params):
    """Weight decay on matrices only, not on norm scales (named ``*norm*``) or biases (``*bias*``)."""

    def decays(path, _):
        names = [str(getattr(key, "key", "")) for key in path]
        return not any("norm" in name or "bias" in name for name in names)

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip_norm),
        optax.adamw(
            learning_rate_schedule(cfg, total_steps),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=_decay_mask,
        ),
    )


def split_model(model: Transformer):
    """(graphdef, params) where params is the pure nnx.Param state."""
    return nnx.split(model, nnx.Param)


def create_train_state(config: Config, model: Transformer | None = None):
    """Builds the model, the optimizer and the initial state; returns (graphdef, optimizer, state)."""
    if model is None:
        model = build_model(config.model, seed=config.train.seed)
    graphdef, params = split_model(model)
    optimizer = make_optimizer(config.optimizer, config.train.steps)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=jax.random.key_data(jax.random.key(config.train.seed)),
    )
    return graphdef, optimizer, state


def abstract_train_state(config: Config):
    """(graphdef, optimizer, state of ShapeDtypeStructs): the state's shapes without allocating it."""
    graphdef, params = split_model(abstract_model(config.model))
    optimizer = make_optimizer(config.optimizer, config.train.steps)

    def make(params):
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            rng=jax.random.key_data(jax.random.key(config.train.seed)),
        )

    return graphdef, optimizer, jax.eval_shape(make, params)


def train_state_around(config: Config, optimizer, params, state_sharding) -> TrainState:
    """The initial state for given (placed) ``params``: fresh optimizer moments, step 0, the run's
    rng, each created directly in ``state_sharding`` (a TrainState of shardings)."""

    def rest(params):
        return optimizer.init(params), jnp.zeros((), jnp.int32), jax.random.key_data(jax.random.key(config.train.seed))

    out = (state_sharding.opt_state, state_sharding.step, state_sharding.rng)
    opt_state, step, rng = jax.jit(rest, out_shardings=out)(params)
    return TrainState(step=step, params=params, opt_state=opt_state, rng=rng)
