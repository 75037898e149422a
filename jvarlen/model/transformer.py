"""The decoder: embedding, a stack of identical layers applied with ``lax.scan``, head.

The layers are stored stacked along a leading ``layers`` axis (one pytree whose leaves
are ``[L, ...]``) so that a pipeline stage is a slice of that axis and the forward is
one compiled loop body regardless of depth.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jvarlen.config import ModelConfig
from jvarlen.kernels import ATTENTION_RESIDUALS
from jvarlen.kernels.gpu_config import compiles_for_gpu
from jvarlen.model.attention import AttentionFn, AttentionInputs, make_attention_fn
from jvarlen.model.head import head_loss_bins, head_loss_sum
from jvarlen.model.layers import DecoderLayer, RMSNorm, _param

# What a rematerialised layer keeps: attention's output and logsumexp (kernels.api names them).
REMAT_POLICY = jax.checkpoint_policies.save_only_these_names(*ATTENTION_RESIDUALS)

# What a layer that is not rematerialised keeps by default (``parallel.residual_policy``), in the
# fused step and in the pipeline's stored layers alike: matmul outputs and the attention's output and
# logsumexp; the backward recomputes the elementwise rest (norms, rotary, the MLP's activation),
# whose fp32 intermediates plain autodiff would keep (docs/design/residuals.md).
DOTS_AND_ATTENTION = "dots_and_attention"


def residual_policy(name: str):
    """A ``jax.checkpoint`` policy by name: ``"all"``, :data:`DOTS_AND_ATTENTION` or any policy
    of ``jax.checkpoint_policies``."""
    cp = jax.checkpoint_policies
    if name == "all":
        return cp.everything_saveable
    if name == DOTS_AND_ATTENTION:
        return cp.save_from_both_policies(
            cp.dots_with_no_batch_dims_saveable, cp.save_only_these_names(*ATTENTION_RESIDUALS)
        )
    if not hasattr(cp, name):
        raise ValueError(
            f"unknown residual policy {name!r}: use 'all', {DOTS_AND_ATTENTION!r} or a jax.checkpoint_policies name"
        )
    return getattr(cp, name)


class Transformer(nnx.Module):
    """LLaMA-style decoder on packed documents.

    ``__call__(tokens [B, T], inputs)`` returns fp32 logits ``[B, T, V]``.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        dtype = jnp.dtype(cfg.param_dtype)
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), dtype, cfg.d_model**-0.5)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, rngs=rngs)

        self.layers = make_layers(rngs)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dtype)
        if not cfg.tie_embeddings:
            self.head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), dtype, cfg.d_model**-0.5)

    @property
    def compute_dtype(self):
        return resolve_compute_dtype(self.config.compute_dtype)

    def embed_tokens(self, tokens_bt: jax.Array) -> jax.Array:
        return jnp.take(self.embed[...], tokens_bt, axis=0).astype(self.compute_dtype)

    def apply_layers(
        self,
        x_btd: jax.Array,
        inputs: AttentionInputs,
        attention_fn: AttentionFn,
        *,
        remat: Optional[bool] = None,
        residual: Optional[str] = None,
    ) -> jax.Array:
        """Runs every stacked layer over ``x`` with one ``lax.scan`` (``residual``: what a layer
        keeps for the backward where it is not rematerialised, :func:`layer_body`)."""
        graphdef, stacked = nnx.split(self.layers)
        return apply_stacked_layers(
            graphdef,
            stacked,
            x_btd,
            inputs,
            attention_fn,
            compute_dtype=self.compute_dtype,
            remat=self.config.remat if remat is None else remat,
            residual=residual,
        )

    def head_weights(self) -> jax.Array:
        """The head ``[d, V]`` in the compute dtype (the table's transpose when tied)."""
        if self.config.tie_embeddings:
            return self.embed[...].astype(self.compute_dtype).T
        return self.head[...].astype(self.compute_dtype)

    def logits(self, x_btd: jax.Array) -> jax.Array:
        """fp32 logits ``[B, T, V]`` of the last layer's outputs (evaluation; training takes
        :meth:`loss_sums`, which never holds them all)."""
        return jnp.einsum(
            "btd,dv->btv", self.final_norm(x_btd), self.head_weights(), preferred_element_type=jnp.float32
        )

    def loss_sums(self, x_btd: jax.Array, targets_bt: jax.Array, loss_mask_bt: jax.Array, spmd=None) -> dict:
        """:func:`jvarlen.model.cross_entropy_sums` of :meth:`logits`, computed a tile of tokens at a
        time with its gradient (:func:`jvarlen.model.head.head_loss_sum`; ``spmd``: its mesh)."""
        loss = head_loss_sum(self.final_norm(x_btd), self.head_weights(), targets_bt, loss_mask_bt, spmd)
        return {"loss_sum": loss, "target_tokens": jnp.sum(loss_mask_bt.astype(jnp.float32))}

    def loss_sums_by_position(self, x_btd, targets_bt, loss_mask_bt, positions_bt, edges: tuple, spmd=None) -> dict:
        """:meth:`loss_sums` and the same split by the position of each input token in its piece (the
        context its prediction had): bin k holds ``edges[k-1] <= position < edges[k]``, len(edges) + 1
        bins, ``loss_sum_by_position`` and ``targets_by_position`` ``[bins]`` (one pass over the head,
        forward only: :func:`jvarlen.model.head.head_loss_bins`)."""
        bins = jnp.searchsorted(jnp.asarray(edges, jnp.int32), positions_bt, side="right")
        h = self.final_norm(x_btd)
        sums, counts = head_loss_bins(h, self.head_weights(), targets_bt, loss_mask_bt, bins, len(edges) + 1, spmd)
        return {
            "loss_sum": jnp.sum(sums),
            "target_tokens": jnp.sum(counts),
            "loss_sum_by_position": sums,
            "targets_by_position": counts,
        }

    def hidden(
        self,
        tokens_bt: jax.Array,
        inputs: AttentionInputs,
        attention_fn: Optional[AttentionFn] = None,
        residual: Optional[str] = None,
    ):
        """The last layer's outputs ``[B, T, d]`` (before the final norm; ``residual``: see
        :func:`layer_body`)."""
        if attention_fn is None:
            attention_fn = make_attention_fn(self.config.attention)
            inputs = inputs.with_block_info(self.config.attention)
        return self.apply_layers(self.embed_tokens(tokens_bt), inputs, attention_fn, residual=residual)

    def __call__(
        self,
        tokens_bt: jax.Array,
        inputs: AttentionInputs,
        attention_fn: Optional[AttentionFn] = None,
    ) -> jax.Array:
        return self.logits(self.hidden(tokens_bt, inputs, attention_fn))


def apply_stacked_layers(
    graphdef, stacked, x_btd, inputs, attention_fn, *, compute_dtype, remat: bool, residual: Optional[str] = None
):
    """Scans ``x`` through layers whose state leaves are stacked ``[L, ...]``."""
    body = layer_body(graphdef, inputs, attention_fn, compute_dtype=compute_dtype, remat=remat, residual=residual)
    x_btd, _ = jax.lax.scan(body, x_btd, stacked)
    return x_btd


def layer_body(graphdef, inputs, attention_fn, *, compute_dtype, remat: bool, residual: Optional[str] = None):
    """The scan body ``(x, layer_state) -> (x, None)`` of one layer. ``remat``: recomputed in the
    backward but for attention's residuals; otherwise ``residual`` (a :func:`residual_policy` name)
    says what the layer keeps: None or ``"all"`` every residual of plain autodiff."""

    def body(x, layer_state):
        layer = nnx.merge(graphdef, layer_state)
        return layer(x, inputs, attention_fn, compute_dtype), None

    if remat:
        # Recompute the layer in the backward pass except attention's output and softmax
        # statistics: the attention backward needs them, and recomputing them would run the
        # attention forward a second time (the costliest part of a long-context layer).
        body = jax.checkpoint(body, prevent_cse=False, policy=REMAT_POLICY)
    elif residual not in (None, "all"):
        body = jax.checkpoint(body, prevent_cse=False, policy=residual_policy(residual))
    return body


def resolve_compute_dtype(name: str):
    """ "auto": bfloat16 when compiling for a GPU (a default GPU backend, or inside
    ``kernels.compile_for``) or TPU, float32 on CPU."""
    if name == "auto":
        on_cpu = jax.default_backend() == "cpu" and not compiles_for_gpu()
        return jnp.dtype(jnp.float32 if on_cpu else jnp.bfloat16)
    return jnp.dtype(name)


def build_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Initialises the parameters in one compiled program (eager init compiles per op)."""
    return nnx.jit(lambda: Transformer(cfg, rngs=nnx.Rngs(params=seed)))()


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with ShapeDtypeStruct leaves: nothing is allocated (for big configs)."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))


def parameter_count(model: nnx.Module) -> int:
    state = nnx.state(model, nnx.Param)
    return sum(int(x.size) for x in jax.tree.leaves(state))
