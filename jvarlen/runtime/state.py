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


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )


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
