"""jvarlen for research code: the compiled train step of a layout or of a plan, the shardings its
inputs need, and the host-side preparation of a batch of documents — the same pieces the
training loop runs (:mod:`jvarlen.runtime.strategy`), without the loop::

    from jvarlen import api
    session = api.Session.from_config(config)                  # model, AdamW, canonical state
    step = session.layout_step(Layout(dp=8), rows=8, seq_len=1024)
    batch = step.prepare(documents)                            # a Prepared: packed rows and their key
    state, metrics = step(session.state, batch)                # compiled once per signature

A step consumes the state it is given (its buffers are donated): pass the state it returned to the
next step, not ``session.state`` again.

``session.plan_step(layout)`` does the same for the elastic pipeline: ``step.prepare(plans,
documents)`` with one :class:`~jvarlen.plan.plan.Plan` and one list of documents per pipeline.
Documents are token arrays or :class:`~jvarlen.data.packer.Piece` s.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import jax
import numpy as np

from jvarlen.config import Config, ModelConfig
from jvarlen.data.packer import Piece, place
from jvarlen.layout import Layout
from jvarlen.parallel.sharding import Placement, place_global
from jvarlen.plan.plan import PlanError
from jvarlen.runtime.checkpoint import abstract_like
from jvarlen.runtime.compile_cache import CompileCache
from jvarlen.runtime.feed import Iteration
from jvarlen.runtime.state import create_train_state
from jvarlen.runtime.strategy import ExecutionStrategy, Prepared, StepContext


def as_pieces(documents: Sequence, vocab_size: Optional[int] = None) -> list[Piece]:
    """Token arrays (or pieces) as :class:`Piece` s: document i is corpus document i, whole. Ids
    outside ``[0, vocab_size)`` and documents that are not 1-D are refused (an id past the
    vocabulary made the loss NaN and skipped the update; a negative one wrapped around)."""
    pieces = [
        d._replace(tokens=np.asarray(d.tokens)) if isinstance(d, Piece) else Piece(np.asarray(d), i, -1)
        for i, d in enumerate(documents)
    ]
    for i, p in enumerate(pieces):
        tokens = p.tokens
        if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
            raise ValueError(
                f"document {i}: expected a 1-D array of integer token ids, got {tokens.dtype} {tokens.shape}"
            )
        if vocab_size is not None and tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
            bad = int(tokens.min()) if tokens.min() < 0 else int(tokens.max())
            raise ValueError(f"document {i}: token id {bad} is outside the model's vocabulary [0, {vocab_size})")
        if vocab_size is not None and p.next_token >= vocab_size:  # -1: no next token
            raise ValueError(f"document {i}: next_token {p.next_token} is outside the model's vocabulary")
    return [p if p.tokens.dtype == np.int32 else p._replace(tokens=p.tokens.astype(np.int32)) for p in pieces]


def require_targets(pieces: Sequence[Piece]) -> None:
    """Refuses a step's documents when they hold no token to predict: its update would still move
    the parameters (momentum, weight decay) and count a step."""
    if not sum(max(p.tokens.size - 1, 0) + (p.next_token >= 0) for p in pieces):
        raise ValueError(f"{len(pieces)} documents with no token to predict (an empty batch): nothing to train on")


class Step:
    """One strategy's compiled steps: ``prepare`` builds host arrays, calling runs the compiled step
    of their signature (compiled on first use, cached per signature)."""

    def __init__(self, strategy: ExecutionStrategy, cache: CompileCache):
        self.strategy, self.cache = strategy, cache
        strategy.attach(cache)

    def compiled(self, prepared: Prepared):
        """The executable of ``prepared``'s signature (its ``batch_shardings``, ``compiled``)."""
        return self.cache.get(prepared.key, self.strategy.compile)

    def batch_shardings(self, prepared: Prepared) -> dict:
        return self.compiled(prepared).batch_shardings

    def __call__(self, state, prepared: Prepared):
        """-> (state, metrics): one optimizer update; ``state`` is donated (consumed): the next step
        takes the state this one returns. A consumed state is refused (before: JAX read the freed
        buffers; on several CPU devices the process crashed)."""
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state)):
            raise ValueError(
                "this train state was consumed by an earlier step (its buffers are donated): pass the state "
                "that step returned"
            )
        return self.compiled(prepared)(state, prepared.arrays)


class LayoutStep(Step):
    def __init__(self, strategy, cache, rows: int, seq_len: int):
        super().__init__(strategy, cache)
        self.rows, self.seq_len = rows, seq_len

    def evaluate(self, state, prepared: Prepared) -> dict:
        """The loss sums (``loss_sum``, ``target_tokens``, ``real_tokens``) of ``prepared`` under
        ``state``: the step's forward pass without the update (held-out evaluation). ``state`` is
        read, not consumed."""
        compiled = self.cache.get(self.strategy.eval_key(prepared), self.strategy.compile_eval)
        return compiled(state, prepared.arrays)

    def prepare(self, documents: Sequence) -> Prepared:
        """Packs whole documents into ``rows x seq_len`` (best fit; raises if they do not fit)."""
        pieces = as_pieces(documents, self.strategy.ctx.model.vocab_size)
        require_targets(pieces)
        rows = place(np.array([len(p.tokens) for p in pieces]), self.rows, self.seq_len)
        return self.strategy.prepare(Iteration(0, pieces, rows, {}), self.cache.keys())

    def from_arrays(self, arrays: dict) -> Prepared:
        """A batch packed elsewhere (``[rows, seq_len]`` arrays named as
        :data:`jvarlen.runtime.step.BATCH_KEYS`) as this step's input; rows are padded with
        all-padding rows up to a multiple of dp, as :meth:`prepare` pads them. Raises ValueError for
        missing or other keys, arrays of different or non-2-D shapes, and a ``seq_len`` sp does not
        divide (before: JAX's sharding errors)."""
        from jvarlen.runtime.step import BATCH_KEYS
        from jvarlen.runtime.strategies.layouts import pad_rows, shape_bucket

        layout = self.strategy.policy.fixed
        if set(arrays) != set(BATCH_KEYS):
            raise ValueError(f"from_arrays needs the arrays {', '.join(BATCH_KEYS)}; got {', '.join(sorted(arrays))}")
        shapes = {k: np.shape(v) for k, v in arrays.items()}
        if len(set(shapes.values())) != 1 or len(shapes["tokens"]) != 2:
            raise ValueError(f"from_arrays needs [rows, seq_len] arrays of one shape; got {shapes}")
        if shapes["tokens"][1] % layout.sp:
            raise ValueError(f"seq_len ({shapes['tokens'][1]}) must be divisible by sp ({layout.sp})")
        _check_packed(arrays, self.strategy.ctx.model.vocab_size)
        arrays = {k: v if isinstance(v, jax.Array) else np.asarray(v) for k, v in arrays.items()}
        batch = pad_rows(arrays, layout.dp)  # as given where dp divides the rows (global arrays too)
        return Prepared(("layout", layout, shape_bucket(batch)), batch)


def _check_packed(arrays: dict, vocab_size: int) -> None:
    """What :meth:`LayoutStep.prepare` guarantees of the rows it packs, asked of rows packed
    elsewhere: integer ids, token ids in the vocabulary (and targets where the loss counts them),
    something to predict (before: an id past the vocabulary made the loss NaN and skipped the
    update, a negative one wrapped around, an empty batch still moved the parameters)."""
    host = {k: np.asarray(v) for k, v in arrays.items()}
    for key in ("tokens", "targets", "positions", "segment_ids"):
        if not np.issubdtype(host[key].dtype, np.integer):
            raise ValueError(f"from_arrays: {key} must hold integers, got {host[key].dtype}")
    counted = host["loss_mask"] != 0
    if not counted.any():
        raise ValueError("from_arrays: loss_mask is zero everywhere (an empty batch): nothing to train on")
    for key, where in (("tokens", host["segment_ids"] > 0), ("targets", counted)):
        ids = host[key][where]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise ValueError(f"from_arrays: {key} holds id {bad}, outside the model's vocabulary [0, {vocab_size})")


class PlanStep(Step):
    def prepare(self, plans: Sequence, documents: Sequence[Sequence]) -> Prepared:
        """One plan and the list of its documents per pipeline (``len(plans) == layout.dp``). Raises
        :class:`~jvarlen.plan.plan.PlanError` for a plan whose chunks do not cover each of its
        documents' tokens exactly once (a token left out is never trained, one in two chunks twice)
        or whose schedule is not valid, as the training loop refuses it."""
        if len(plans) != len(documents):
            raise ValueError(f"{len(plans)} plans but {len(documents)} lists of documents: one per pipeline")
        groups = [as_pieces(docs, self.strategy.ctx.model.vocab_size) for docs in documents]
        require_targets([p for group in groups for p in group])
        for plan, group in zip(plans, groups):
            lengths = [len(p.tokens) for p in group]
            if tuple(lengths) == tuple(plan.lengths):  # other documents: refused below, naming them
                plan.validate(lengths)
        pieces = [p for g in groups for p in g]
        it = Iteration(0, pieces, np.zeros(len(pieces), np.int64), {}, groups=groups, plans=list(plans))
        return self.strategy.prepare(it, self.cache.keys())


class StrategyStep(Step):
    def prepare(self, plan, documents: Sequence) -> Prepared:
        """A :class:`~jvarlen.plan.strategy.StrategyPlan` over ``documents`` (its groups' plans index them).
        Raises :class:`~jvarlen.plan.plan.PlanError` for a plan that is not of these documents (each exactly
        once) or of more devices than the session has: a document in two groups would train twice."""
        pieces = as_pieces(documents, self.strategy.ctx.model.vocab_size)
        require_targets(pieces)
        devices = len(self.strategy.ctx.placement.devices)
        if plan.num_devices > devices:
            raise PlanError(f"the strategy plan is for {plan.num_devices} devices, the session has {devices}")
        plan.validate([len(p.tokens) for p in pieces])
        it = Iteration(0, pieces, np.zeros(len(pieces), np.int64), {}, groups=[pieces], plans=[plan])
        return self.strategy.prepare(it, self.cache.keys())


class _SessionDefault:
    def __repr__(self) -> str:
        return "SESSION_DEFAULT"


SESSION_DEFAULT = _SessionDefault()  # a step's residual policy: the session's (``Session.residual_policy``)


def _check_state_matches(model: ModelConfig, state) -> None:
    """Refuses a train state whose embedding is not ``[vocab_size, d_model]`` of ``model`` (a
    vocabulary the config says is larger would let ids past the table through)."""
    params = getattr(state, "params", None)
    shape = getattr(params.get("embed") if hasattr(params, "get") else None, "shape", None)
    if shape is not None and tuple(shape) != (model.vocab_size, model.d_model):
        raise ValueError(
            f"the train state's embedding is {tuple(shape)}, the model config's [vocab_size, d_model] is "
            f"({model.vocab_size}, {model.d_model}): the state belongs to another model"
        )


class Session:
    """The model, its optimizer and the train state in the canonical sharding over ``devices``."""

    def __init__(
        self,
        graphdef,
        model: ModelConfig,
        optimizer,
        state,
        *,
        devices=None,
        compiler_options=None,
        placed=False,
        residual_policy: Optional[str] = "dots_and_attention",
    ):
        """``placed``: ``state`` is already in the canonical sharding over ``devices``.
        ``residual_policy``: what a step's layers that are not rematerialised keep, unless the step
        names its own (:meth:`from_config`: the config's ``parallel.residual_policy``)."""
        self.residual_policy = residual_policy
        model = copy.deepcopy(model)  # the caller's config may change later; the compiled steps may not
        _check_state_matches(model, state)
        self.placement = Placement.for_state(state, optimizer, devices)
        self.state = state if placed else place_global(state, self.placement.state_sharding)
        self.context = StepContext(
            graphdef, model, optimizer, self.placement, abstract_like(self.state), compiler_options=compiler_options
        )
        self.cache = CompileCache(say=lambda _: None)
        self._caches: dict[tuple, CompileCache] = {}

    def _cache_for(self, options: tuple) -> CompileCache:
        """Steps whose programs differ beyond their signature (a residual policy, stage weights)
        keep separate caches: keyed by the signature alone, one would run the other's executable.
        The first options requested use :attr:`cache`."""
        if not self._caches:
            self._caches[options] = self.cache
        return self._caches.setdefault(options, CompileCache(say=lambda _: None))

    @classmethod
    def from_config(cls, config: Config, devices=None, **kwargs) -> "Session":
        """A fresh model, or ``config.model.init_from``'s weights streamed into their shardings; its
        steps keep the residuals of ``config.parallel.residual_policy`` unless they name their own."""
        kwargs.setdefault("residual_policy", config.parallel.residual_policy)
        if config.model.init_from is not None:
            from jvarlen.hf.load import initial_state

            graphdef, optimizer, _, state, _ = initial_state(config, devices)
            return cls(graphdef, config.model, optimizer, state, devices=devices, placed=True, **kwargs)
        graphdef, optimizer, state = create_train_state(config)
        return cls(graphdef, config.model, optimizer, state, devices=devices, **kwargs)

    def _residual(self, policy):
        return self.residual_policy if policy is SESSION_DEFAULT else policy

    @property
    def state_sharding(self):
        return self.placement.state_sharding

    def layout_step(
        self, layout: Layout, rows: int, seq_len: int, *, residual_policy: Optional[str] = SESSION_DEFAULT
    ) -> LayoutStep:
        """The data-parallel step on ``layout`` (``dp · sp`` = the session's devices) for batches of
        ``rows`` rows of ``seq_len`` tokens (``residual_policy``: what a layer that is not
        rematerialised keeps, as :meth:`plan_step`'s)."""
        from jvarlen.runtime.strategies.layouts import LayoutPolicy, LayoutStrategy

        residual_policy = self._residual(residual_policy)

        layout.validate(len(self.placement.devices), num_heads=self.context.model.num_heads)
        if layout.pp != 1:
            raise ValueError(f"{layout}: the data-parallel step has no pipeline stages (pp = 1); use plan_step")
        if rows < 1 or seq_len < 1 or seq_len % layout.sp:
            raise ValueError(
                f"rows ({rows}) and seq_len ({seq_len}) must be >= 1, seq_len divisible by sp ({layout.sp})"
            )
        policy = LayoutPolicy(len(self.placement.devices), self.context.model.num_heads, 1, layout)
        strategy = LayoutStrategy(self.context, policy, rows, seq_len, residual=residual_policy)
        return LayoutStep(strategy, self._cache_for(("layouts", residual_policy)), rows, seq_len)

    def plan_step(
        self,
        layout: Layout,
        *,
        bucket: Optional[int] = None,
        chunk_multiple: int = 2,
        residual_policy: Optional[str] = SESSION_DEFAULT,
        stage_weights: str = "replicated",
        vocab_max_sp: Optional[int] = None,
    ) -> PlanStep:
        """The elastic pipeline step on ``layout`` for plans of that layout (chunks padded to
        ``bucket`` tokens, or to quarter steps of a power of two; chunk counts to a multiple of
        ``chunk_multiple``; ``stage_weights="sharded"``: ZeRO-3 over each stage's sp devices and the dp pipelines;
        ``vocab_max_sp``: the largest sp that splits the embedding and head by vocabulary, as
        :meth:`strategy_step`'s)."""
        from jvarlen.runtime.strategies.pipeline import PipelineStrategy

        residual_policy = self._residual(residual_policy)

        model = self.context.model
        layout.validate(len(self.placement.devices), num_heads=model.num_heads, num_layers=model.num_layers)
        strategy = PipelineStrategy.for_given_plans(
            self.context,
            layout,
            residual=residual_policy,
            stage_weights=stage_weights,
            chunk_multiple=chunk_multiple,
            bucket=bucket,
            vocab_max_sp=vocab_max_sp,
        )
        return PlanStep(strategy, self._cache_for(("pipeline", residual_policy, stage_weights, vocab_max_sp)))

    def strategy_step(
        self,
        *,
        residual_policy: Optional[str] = SESSION_DEFAULT,
        stage_weights: str = "replicated",
        chunk_multiple: int = 2,
        vocab_max_sp: Optional[int] = None,
    ) -> StrategyStep:
        """The heterogeneous-groups step: ``step.prepare(strategy_plan, documents)`` runs each group of a
        :class:`~jvarlen.plan.strategy.StrategyPlan` on its devices and updates the state once.
        ``vocab_max_sp``: the largest group sp that splits the embedding and head by vocabulary
        (pass the planner's ``costs.coeffs.gpus_per_node``, as its memory and time account assume;
        None: any sp that divides the vocabulary)."""
        from jvarlen.runtime.strategies.groups import GroupsStrategy

        residual_policy = self._residual(residual_policy)

        strategy = GroupsStrategy(
            self.context,
            None,
            "",
            ahead=0,
            residual=residual_policy,
            stage_weights=stage_weights,
            chunk_multiple=chunk_multiple,
            vocab_max_sp=vocab_max_sp,
        )
        key = ("groups", residual_policy, stage_weights, vocab_max_sp)
        return StrategyStep(strategy, self._cache_for(key))

    def put(self, tree, shardings):
        """Host values -> global arrays with ``shardings`` (each process fills its own shards)."""
        return place_global(tree, shardings)


__all__ = ["SESSION_DEFAULT", "LayoutStep", "PlanStep", "Session", "Step", "StrategyStep", "as_pieces"]
