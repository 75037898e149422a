"""What one pipeline stage computes for one chunk: layer forwards with stored residuals,
and backwards that rebuild each layer's ``vjp_fn`` from stored or recomputed residuals.

Device code that runs inside ``shard_map`` over ``pp``; shapes are per chunk: T tokens,
d model width, Ls layers of the stage, Sc context tokens, K kv heads, D head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvarlen.kernels.api import ATTENTION_RESIDUALS
from jvarlen.model import AttentionInputs
from jvarlen.model.layers import layer_with_context
from jvarlen.parallel import ulysses


@dataclasses.dataclass
class ResidualRecipe:
    """How a layer's ``vjp_fn`` is flattened: which leaves are shared inputs (layer
    parameters, context K/V: never stored) and which are per-chunk residuals (stored)."""

    treedef: Any = None
    sources: tuple = ()  # per leaf: ("in", i) shared input leaf i, or ("res", j) residual j
    shapes: tuple = ()  # ShapeDtypeStruct of each residual


def split_vjp(vjp_fn, shared_leaves, recipe: ResidualRecipe) -> list:
    """Residual leaves of ``vjp_fn``; records the recipe (trace-time identity of shared leaves)."""
    leaves, treedef = jax.tree.flatten(vjp_fn)
    sources, res = [], []
    for leaf in leaves:
        hit = next((i for i, s in enumerate(shared_leaves) if leaf is s), None)
        if hit is None:
            sources.append(("res", len(res)))
            res.append(leaf)
        else:
            sources.append(("in", hit))
    recipe.treedef = treedef
    recipe.sources = tuple(sources)
    recipe.shapes = tuple(jax.ShapeDtypeStruct(jnp.shape(r), jnp.result_type(r)) for r in res)
    return res


def join_vjp(recipe: ResidualRecipe, residuals, shared_leaves):
    leaves = [shared_leaves[i] if kind == "in" else residuals[i] for kind, i in recipe.sources]
    return jax.tree.unflatten(recipe.treedef, leaves)


@dataclasses.dataclass
class StageFns:
    """The per-layer function of a stage, closed over the chunk's attention inputs."""

    layer_graphdef: Any
    attention_fn: Callable
    compute_dtype: Any
    with_context: bool
    sp: int = 1  # Ulysses degree inside the stage (mesh axis ``sp``)
    kv_repeats: int = 1  # kv heads repeated so that sp divides them
    # None: a stored layer keeps every residual of its vjp; a jax.checkpoint_policies name
    # (e.g. "dots_with_no_batch_dims_saveable") keeps only what the policy saves and
    # recomputes the rest inside the backward (selective recomputation).
    residual_policy: Optional[str] = None
    # where the stage's weights live (jvarlen.parallel.pipeline.weights.StageWeights); sharded over
    # sp, a layer is gathered where it is used. None: replicated.
    weights: Any = None
    recipe: ResidualRecipe = dataclasses.field(default_factory=ResidualRecipe)

    def layer(self, inputs: AttentionInputs, rotary_positions):
        """f(layer_params, x [T/sp, d], ck [Sc,K',D], cv) -> (y [T/sp, d], k [T,K',D], v [T,K',D]).

        ``inputs`` describe all T tokens of the chunk (and its Sc context keys);
        K' = K * kv_repeats / sp kv heads per device (K' = K without sp). With sharded stage
        weights ``layer_params`` are this device's shards (:meth:`sharded_layer`).
        """
        if self.sharded:
            return self.sharded_layer(inputs, rotary_positions)
        return self.full_layer(inputs, rotary_positions)

    def full_layer(self, inputs: AttentionInputs, rotary_positions):
        """The layer on whole parameters, under the residual policy."""
        hooks = {}
        if self.sp > 1:

            def to_heads(q, k, v):
                k, v = ulysses.repeat_kv_heads(k, self.kv_repeats), ulysses.repeat_kv_heads(v, self.kv_repeats)
                return ulysses.seq_to_heads(q), ulysses.seq_to_heads(k), ulysses.seq_to_heads(v)

            hooks = dict(rotary_positions=rotary_positions[None], to_heads=to_heads, to_seq=ulysses.heads_to_seq)

        def f(lp, x, ck, cv):
            layer = nnx.merge(self.layer_graphdef, lp)
            ctx = (ck[None], cv[None]) if self.with_context else (None, None)
            y, k, v = layer_with_context(layer, x[None], inputs, self.attention_fn, self.compute_dtype, *ctx, **hooks)
            return y[0], k[0], v[0]

        if self.residual_policy:
            return jax.checkpoint(f, policy=residual_policy(self.residual_policy))
        return f

    @property
    def sharded(self) -> bool:
        return self.weights is not None and self.weights.sharded

    def sharded_layer(self, inputs: AttentionInputs, rotary_positions):
        """The layer on this device's weight shards (ZeRO-3 over sp): the forward gathers the layer,
        runs :meth:`full_layer` and keeps its residuals, the backward gathers it again and
        reduce-scatters its gradient. A custom VJP, so that no residual (stored across ticks, or of
        the fused op's scan over layers) is a gathered weight, whatever the residual policy."""
        recipe, gather = ResidualRecipe(), self.weights.gather_layer
        aux = (inputs.segment_ids, inputs.positions, inputs.kv_segment_ids, inputs.kv_positions, rotary_positions)

        def full(aux):
            return self.full_layer(AttentionInputs(*aux[:4]), aux[4])

        @jax.custom_vjp
        def f(lp, x, ck, cv, aux):
            return full(aux)(gather(lp), x, ck, cv)

        def f_fwd(lp, x, ck, cv, aux):
            whole = gather(lp)
            out, vjp_fn = jax.vjp(full(aux), whole, x, ck, cv)
            return out, (lp, ck, cv, aux, split_vjp(vjp_fn, _shared(whole, ck, cv), recipe))

        def f_bwd(saved, cotangents):
            lp, ck, cv, aux, res = saved
            d_whole, dx, dck, dcv = join_vjp(recipe, res, _shared(gather(lp), ck, cv))(cotangents)
            return self.weights.scatter_layer_grad(d_whole), dx, dck, dcv, jax.tree.map(_no_cotangent, aux)

        f.defvjp(f_fwd, f_bwd)
        return lambda lp, x, ck, cv: f(lp, x, ck, cv, aux)

    def forward(self, layers, x, ctx_k, ctx_v, inputs, rotary_positions, recompute):
        """Scan over the stage's layers, keeping the residuals of layers not in ``recompute [Ls]``
        (those run a plain forward and return zero residuals, which are not stored);
        ``recompute=None``: plain forwards, no residuals.

        layers: stacked [Ls, ...]; x [T, d]; ctx_k/v [Ls, Sc, K, D].
        -> (y [T, d], own k/v [Ls, T, K, D], residuals (list of [Ls, ...]), layer forwards run)
        """
        f = self.layer(inputs, rotary_positions)

        def body(x, xs):
            lp, ck, cv, again = xs

            def keep():
                (y, k, v), vjp_fn = jax.vjp(f, lp, x, ck, cv)
                return y, k, v, split_vjp(vjp_fn, _shared(lp, ck, cv), self.recipe)

            def plain():
                y, k, v = f(lp, x, ck, cv)
                return y, k, v, [jnp.zeros(r.shape, r.dtype) for r in self.recipe.shapes]

            y, k, v, res = jax.lax.cond(again, plain, keep)
            return y, (k, v, res)

        if recompute is None:  # nothing is stored in this signature: plain forwards only

            def plain_body(x, xs):
                y, k, v = f(*xs[:1], x, *xs[1:])
                return y, (k, v)

            y, (k, v) = jax.lax.scan(plain_body, x, (layers, ctx_k, ctx_v))
            return y, k, v, [], jnp.int32(jax.tree.leaves(layers)[0].shape[0])
        y, (k, v, residuals) = jax.lax.scan(body, x, (layers, ctx_k, ctx_v, recompute))
        return y, k, v, residuals, jnp.int32(jax.tree.leaves(layers)[0].shape[0])

    def backward(self, layers, x, dy, ctx_k, ctx_v, dk_own, dv_own, stored, recompute, inputs, rotary_positions):
        """Rebuilds every layer's vjp_fn — from ``stored`` residuals (list of [Ls, ...]) or, where
        ``recompute [Ls]`` is set (a prefix), by recomputing the layer — and runs them in reverse.
        ``stored=None``: every layer is recomputed.

        -> (dx [T, d], d layers [Ls, ...], d ctx_k/v [Ls, Sc, K, D], layers recomputed)
        """
        f = self.layer(inputs, rotary_positions)
        recipe = self.recipe

        def gather(x, xs):
            lp, ck, cv, res, again = xs

            def recompute_layer():
                (y, _, _), vjp_fn = jax.vjp(f, lp, x, ck, cv)
                return y, split_vjp(vjp_fn, _shared(lp, ck, cv), recipe), jnp.ones((), jnp.int32)

            def use_stored():
                return x, list(res), jnp.zeros((), jnp.int32)

            y, res, ran = jax.lax.cond(again, recompute_layer, use_stored)
            return y, (res, ran)

        if stored is None:  # nothing is stored in this signature: recompute every layer

            def recompute_all(x, xs):
                lp, ck, cv = xs
                (y, _, _), vjp_fn = jax.vjp(f, lp, x, ck, cv)
                return y, (split_vjp(vjp_fn, _shared(lp, ck, cv), recipe), jnp.ones((), jnp.int32))

            _, (residuals, ran) = jax.lax.scan(recompute_all, x, (layers, ctx_k, ctx_v))
        else:
            _, (residuals, ran) = jax.lax.scan(gather, x, (layers, ctx_k, ctx_v, list(stored), recompute))

        def back(dy, xs):
            lp, ck, cv, res, dk, dv = xs
            vjp_fn = join_vjp(recipe, res, _shared(lp, ck, cv))
            dlp, dx, dck, dcv = vjp_fn((dy, dk, dv))
            return dx, (dlp, dck, dcv)

        dx, (dlayers, dck, dcv) = jax.lax.scan(
            back, dy, (layers, ctx_k, ctx_v, residuals, dk_own, dv_own), reverse=True
        )
        return dx, dlayers, dck, dcv, jnp.sum(ran)


# What a stored layer keeps besides the policies of jax.checkpoint_policies: matmul outputs
# and the attention's output and logsumexp (so the backward recomputes only elementwise ops).
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


def _no_cotangent(x):
    """The zero cotangent of an integer input of a custom VJP."""
    return np.zeros(jnp.shape(x), jax.dtypes.float0)


def _shared(lp, ck, cv) -> list:
    return jax.tree.leaves(lp) + [ck, cv]


def residual_shapes(fns: StageFns, layers_one, x, ck, cv, inputs, rotary_positions) -> tuple:
    """ShapeDtypeStructs of one layer's stored residuals (traces the layer once, abstractly)."""

    def probe(lp, x, ck, cv, arrays, rotary_positions):
        (_, _, _), vjp_fn = jax.vjp(fns.layer(AttentionInputs(*arrays), rotary_positions), lp, x, ck, cv)
        return split_vjp(vjp_fn, _shared(lp, ck, cv), fns.recipe)

    arrays = (inputs.segment_ids, inputs.positions, inputs.kv_segment_ids, inputs.kv_positions)
    jax.eval_shape(probe, layers_one, x, ck, cv, arrays, rotary_positions)
    return fns.recipe.shapes


def maybe(pred, fn: Callable, zeros_like: Optional[Any] = None):
    """``fn()`` where ``pred`` holds, zeros of its result elsewhere (a ``lax.cond``)."""
    shapes = jax.eval_shape(fn) if zeros_like is None else zeros_like
    return jax.lax.cond(pred, fn, lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
