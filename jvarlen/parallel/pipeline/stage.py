"""What one pipeline stage computes for one chunk, one layer at a time: forwards that keep a layer's
residuals or not, and backwards that rebuild its ``vjp_fn`` from stored or recomputed residuals.
The executor runs them in its passes over the stage's layers.

Device code that runs inside ``shard_map`` over ``pp``; shapes are per chunk: T tokens,
d model width, Ls layers of the stage, Sc context tokens, K kv heads, D head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jvarlen.config import ModelConfig
from jvarlen.model import AttentionInputs, make_attention_fn
from jvarlen.model.layers import layer_with_context
from jvarlen.model.transformer import abstract_model, residual_policy, resolve_compute_dtype
from jvarlen.parallel import ulysses
from jvarlen.parallel.pipeline.signature import PipelineSignature
from jvarlen.parallel.pipeline.weights import StageWeights
from jvarlen.parallel.sharding import param_axes


@dataclasses.dataclass
class ResidualRecipe:
    """How a layer's ``vjp_fn`` is flattened: which leaves are shared inputs (layer
    parameters, context K/V: never stored) and which are per-chunk residuals (stored)."""

    treedef: Any = None
    sources: tuple = ()  # per leaf: ("in", i) shared input leaf i, or ("res", j) residual j
    shapes: tuple = ()  # ShapeDtypeStruct of each residual
    kv: Any = None  # ShapeDtypeStruct of the layer's own keys (and values) [T, K', D]


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
    # where the stage's weights live (jvarlen.parallel.pipeline.weights.StageWeights): the passes
    # over the layers gather sharded layers and reduce-scatter their gradients
    weights: Any = None
    recipe: ResidualRecipe = dataclasses.field(default_factory=ResidualRecipe)

    def layer(self, inputs: AttentionInputs, rotary_positions):
        """f(layer_params, x [T/sp, d], ck [Sc,K',D], cv) -> (y [T/sp, d], k [T,K',D], v [T,K',D]).

        ``inputs`` describe all T tokens of the chunk (and its Sc context keys);
        K' = K * kv_repeats / sp kv heads per device (K' = K without sp). ``layer_params`` are
        whole (sharded stage weights are gathered by the pass over the layers,
        ``StageWeights.layer_pass``). Under the residual policy.
        """
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
            # as the model's layer body: a stored layer's forward and backward run in separate loops
            # or ops, which keep its recomputation apart; CSE barriers only slowed the backward (4 %, CPU)
            return jax.checkpoint(f, prevent_cse=False, policy=residual_policy(self.residual_policy))
        return f

    def ascend(self, f, mode, lp, x, ck, cv):
        """One layer of an ascending pass (``f``: :meth:`layer`), by ``mode`` (data, int32, or a
        static int): :data:`NONE` passes ``x`` on (an idle op, or a backward's layer whose residuals
        are stored: the descending pass reads them), :data:`PLAIN` runs the layer, :data:`KEEP` runs
        it and returns its residuals. Zeros stand for what a mode does not produce.

        lp: the layer's weights as :meth:`layer` takes them; x [T/sp, d]; ck/cv [Sc, K', D].
        -> (y [T/sp, d], own k/v [T, K', D], residuals (list))
        """
        zeros = [jnp.zeros(r.shape, r.dtype) for r in self.recipe.shapes]
        kv0 = jnp.zeros(self.recipe.kv.shape, self.recipe.kv.dtype)

        def none():
            return x, kv0, kv0, zeros

        def plain():
            y, k, v = f(lp, x, ck, cv)
            return y, k, v, zeros

        def keep():
            (y, k, v), vjp_fn = jax.vjp(f, lp, x, ck, cv)
            return y, k, v, split_vjp(vjp_fn, _shared(lp, ck, cv), self.recipe)

        branches = [none, plain, keep]
        return branches[mode]() if isinstance(mode, int) else jax.lax.switch(mode, branches)

    def descend(self, active, lp, ck, cv, residuals, dy, dk, dv):
        """One layer of a backward, where ``active`` (data, or a static bool): its ``vjp_fn`` rebuilt
        from ``residuals`` and applied to (dy [T/sp, d], dk/dv of its own keys [T, K', D]).
        -> (d lp, dx, d ck, d cv), zeros where not ``active``."""

        def run():
            return join_vjp(self.recipe, residuals, _shared(lp, ck, cv))((dy, dk, dv))

        return maybe(active, run)

    def rebuild(self, f, active, lp, x, ck, cv, dy, dk, dv):
        """One recomputed layer of a backward, where ``active``: its forward from its input ``x``
        [T/sp, d] under ``jax.vjp`` (``f``: :meth:`layer`), applied at once to (dy, dk, dv) as in
        :meth:`descend`. -> (d lp, dx, d ck, d cv), zeros where not ``active``."""

        def run():
            return jax.vjp(f, lp, x, ck, cv)[1]((dy, dk, dv))

        return maybe(active, run)


# Modes of :meth:`StageFns.ascend`, per layer
NONE, PLAIN, KEEP = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class StageShapes:
    """Static sizes of one signature, per device: T tokens per chunk (Tl = T/sp of them on one device
    of an sp group), d model width, Ls layers per stage, K kv heads and D head dim after the
    Ulysses all_to_all, Sc context tokens a chunk reads, R rows of the context pools;
    ``vocab_shards``: the sp devices the embedding table and head are split over by vocabulary
    (:mod:`.rest`), or 1 (whole on every device)."""

    sig: PipelineSignature
    graphdef: Any
    fns: StageFns
    compute_dtype: Any
    d: int
    D: int
    K: int
    vocab_shards: int = 1

    @property
    def pp(self) -> int:
        return self.sig.layout.pp

    @property
    def ls(self) -> int:
        return self.sig.layers_per_stage

    @property
    def T(self) -> int:
        return self.sig.bucket

    @property
    def Tl(self) -> int:
        return self.sig.bucket // self.sig.layout.sp

    @property
    def Sc(self) -> int:
        return self.sig.context

    @property
    def R(self) -> int:
        return self.sig.ctx_rows

    @property
    def stores(self) -> bool:
        """Static: a signature without residual slots recomputes every layer."""
        return self.sig.n_res > 0

    def dummy(self, kind: str) -> int:
        """The slot meaning "nothing": one past the last real slot of a buffer."""
        return getattr(self.sig, "n_" + kind)


def stage_shapes(
    graphdef,
    cfg: ModelConfig,
    sig: PipelineSignature,
    attention_fn=None,
    residual_policy=None,
    stage_weights: str = "replicated",
    canonical: bool = True,
    group_axes=None,
    vocab_max_sp: Optional[int] = None,
):
    """The static sizes and per-layer functions of ``sig`` (see :class:`StageShapes`); ``canonical``
    and ``group_axes``: see :class:`~jvarlen.parallel.pipeline.weights.StageWeights`;
    ``vocab_max_sp``: the largest sp that splits the vocabulary (``Layout.vocab_shards``)."""
    sp = sig.layout.sp
    if sig.bucket % sp or cfg.num_heads % sp:
        raise ValueError(f"sp={sp} must divide the chunk bucket ({sig.bucket}) and num_heads ({cfg.num_heads})")
    repeats = ulysses.kv_repeats(cfg.num_kv_heads, sp)
    cdt = resolve_compute_dtype(cfg.compute_dtype)
    layer_graphdef, layer_state = nnx.split(abstract_model(cfg).layers, nnx.Param)
    fns = StageFns(
        layer_graphdef,
        attention_fn or make_attention_fn(cfg.attention),
        cdt,
        with_context=sig.context > 0,
        sp=sp,
        kv_repeats=repeats,
        residual_policy=residual_policy,
        weights=StageWeights(
            layer_state, param_axes(layer_state), sig.layout, stage_weights, cdt, canonical, group_axes
        ),
    )
    return StageShapes(
        sig,
        graphdef,
        fns,
        cdt,
        d=cfg.d_model,
        D=cfg.head_dim or cfg.d_model // cfg.num_heads,
        K=cfg.num_kv_heads * repeats // sp,  # kv heads per device after the Ulysses all_to_all
        vocab_shards=sig.layout.vocab_shards(cfg.vocab_size, vocab_max_sp),
    )


def _shared(lp, ck, cv) -> list:
    return jax.tree.leaves(lp) + [ck, cv]


def residual_shapes(fns: StageFns, layers_one, x, ck, cv, inputs, rotary_positions) -> tuple:
    """ShapeDtypeStructs of one layer's stored residuals (traces the layer once, abstractly; also
    records the shape of its own keys in ``fns.recipe.kv``)."""

    def probe(lp, x, ck, cv, arrays, rotary_positions):
        (_, k, _), vjp_fn = jax.vjp(fns.layer(AttentionInputs(*arrays), rotary_positions), lp, x, ck, cv)
        return k, split_vjp(vjp_fn, _shared(lp, ck, cv), fns.recipe)

    arrays = (inputs.segment_ids, inputs.positions, inputs.kv_segment_ids, inputs.kv_positions)
    fns.recipe.kv = jax.eval_shape(probe, layers_one, x, ck, cv, arrays, rotary_positions)[0]
    return fns.recipe.shapes


def maybe(pred, fn: Callable, zeros_like: Optional[Any] = None):
    """``fn()`` where ``pred`` holds, zeros of its result elsewhere (a ``lax.cond``; no conditional
    where ``pred`` is a static bool)."""
    if pred is True:
        return fn()
    shapes = jax.eval_shape(fn) if zeros_like is None else zeros_like
    zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
    return zeros() if pred is False else jax.lax.cond(pred, fn, zeros)


def stored_token_bytes(cfg: ModelConfig, residual: Optional[str], tokens: int = 128) -> float:
    """Bytes per token that a stored layer of the pipeline executor keeps under the residual
    policy ``residual`` (the name :func:`residual_policy` takes; None or ``"all"``: every
    residual), on one device without sequence parallelism (``sp`` devices hold ``1/sp`` of it
    each): the cost model's ``m_stored_token``, from the layer's residual shapes (abstract, no
    compile)."""
    from jvarlen.layout import Layout

    sig = PipelineSignature(Layout(1, 1, 1), cfg.num_layers, tokens, 1, 1, 0, 0, 0, 0, 1)
    policy = None if residual in (None, "all") else residual
    s = stage_shapes(None, cfg, sig, residual_policy=policy)
    _, stacked = nnx.split(abstract_model(cfg).layers, nnx.Param)
    # one layer as the stage holds it: weight matrices in the compute dtype (StageWeights.pull), so
    # that a cast of them is not taken for a residual
    leaves, treedef = jax.tree.flatten(stacked)
    dtypes = [leaf.compute_dtype for leaf in s.fns.weights.leaves]
    one = treedef.unflatten([jax.ShapeDtypeStruct(a.shape[1:], dt) for a, dt in zip(leaves, dtypes)])
    layer = jax.eval_shape(s.fns.weights.gather, one)
    x = jax.ShapeDtypeStruct((tokens, s.d), s.compute_dtype)
    ctx = jax.ShapeDtypeStruct((0, s.K, s.D), s.compute_dtype)
    ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    inputs = AttentionInputs(ids, ids)
    shapes = residual_shapes(s.fns, layer, x, ctx, ctx, inputs, jax.ShapeDtypeStruct((tokens,), jnp.int32))
    return sum(r.size * r.dtype.itemsize for r in shapes) / tokens
