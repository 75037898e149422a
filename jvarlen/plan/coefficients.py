"""What the cost model is made of: the model's shape and the fitted (or analytic) coefficients,
with their JSON form (InfiniPipe Eq. 1-11 terms; see docs/design/cost-model.md).

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

from jvarlen.plan.json_file import JsonFile


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The numbers of a LLaMA-style decoder that the cost model needs (no JAX, no config parsing)."""

    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    vocab_size: int
    tie_embeddings: bool = True

    def __post_init__(self):
        for name in ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, cfg: Any) -> "ModelShape":
        """From a :class:`jvarlen.config.ModelConfig` (or anything with the same fields)."""
        head_dim = cfg.head_dim if cfg.head_dim is not None else cfg.d_model // cfg.num_heads
        return cls(
            num_layers=cfg.num_layers,
            d_model=cfg.d_model,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=head_dim,
            mlp_dim=cfg.mlp_dim,
            vocab_size=cfg.vocab_size,
            tie_embeddings=cfg.tie_embeddings,
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V) per token: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q, k, v, o projections, SwiGLU (3 matrices), 2 RMSNorms."""
        d = self.d_model
        attn = d * self.q_dim + 2 * d * self.kv_dim + self.q_dim * d
        mlp = 3 * d * self.mlp_dim
        return attn + mlp + 2 * d

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.d_model

    @property
    def head_params(self) -> int:
        """Final norm plus the LM head matrix (0 extra matrix when tied to the embedding)."""
        return self.d_model + (0 if self.tie_embeddings else self.vocab_size * self.d_model)

    @property
    def param_count(self) -> int:
        return self.num_layers * self.layer_params + self.embed_params + self.head_params

    def stage_params(self, stage: int, pp: int) -> int:
        """Parameters a stage holds for propagation (stage 0: + embedding; last: + head, and the
        tied embedding matrix again when tied and pp > 1)."""
        n = self.num_layers // pp * self.layer_params
        if stage == 0:
            n += self.embed_params
        if stage == pp - 1:
            n += self.head_params
            if self.tie_embeddings and pp > 1:
                n += self.embed_params
        return n

    # FLOP counts for analytic profiles (forward; multiply-add = 2 FLOPs).
    @property
    def layer_linear_flops_per_token(self) -> float:
        """Forward matmul FLOPs of one layer per token (everything except the attention core)."""
        return 2.0 * (self.layer_params - 2 * self.d_model)

    @property
    def attention_flops_per_pair(self) -> float:
        """Forward FLOPs of the attention core per unit of ``ChunkShape.attention_pairs``.

        ``attention_pairs`` counts (C+s)² − C² (Eq. 1), i.e. twice the causal query-key pairs;
        each causal pair costs 2·2·H·hd FLOPs (QKᵀ and PV), hence 2·H·hd per unit.
        """
        return 2.0 * self.q_dim

    @property
    def head_flops_per_token(self) -> float:
        return 2.0 * self.vocab_size * self.d_model

    def key(self) -> str:
        """Stable string identifying the shape, used to key saved profiles."""
        return (
            f"L{self.num_layers}-d{self.d_model}-h{self.num_heads}-kv{self.num_kv_heads}-hd{self.head_dim}"
            f"-f{self.mlp_dim}-v{self.vocab_size}-{'tied' if self.tie_embeddings else 'untied'}"
        )


# --------------------------------------------------------------------------- coefficients


@dataclasses.dataclass(frozen=True)
class LayerTime:
    """Eq. 1 for ONE layer: ``(alpha1 * pairs + alpha2 * tokens) / sp + beta1`` seconds.

    ``alpha1`` is seconds per unit of ``ChunkShape.attention_pairs`` on one device,
    ``alpha2`` seconds per token on one device, ``beta1`` seconds per chunk (launch and
    framework overhead; not divided by ``sp``).
    """

    alpha1: float = 0.0
    alpha2: float = 0.0
    beta1: float = 0.0

    def __call__(self, pairs: float, tokens: float, sp: int = 1) -> float:
        return (self.alpha1 * pairs + self.alpha2 * tokens) / sp + self.beta1

    def scaled(self, factor: float) -> "LayerTime":
        return LayerTime(self.alpha1 * factor, self.alpha2 * factor, self.beta1 * factor)


@dataclasses.dataclass(frozen=True)
class Link:
    """Eq. 2: ``bytes / bandwidth + latency`` seconds; ``bandwidth`` in bytes/s per device."""

    bandwidth: float
    latency: float = 0.0

    def time(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return nbytes / self.bandwidth + self.latency


@dataclasses.dataclass(frozen=True)
class ProfileMeta:
    """Where a set of coefficients comes from; profiles are keyed by (model, backend, device)."""

    model_key: str = ""
    backend: str = ""  # "cpu", "gpu", "tpu", or "analytic"
    device_kind: str = ""  # e.g. "NVIDIA A800-SXM4-80GB", "cpu"
    analytic: bool = True  # True: derived from hardware figures, not measured
    source: str = ""  # free text: profiler grid, hardware profile name, refit count
    created: str = ""
    # CPU profiles: the clock reading of the reference probe (jvarlen.profile.clock, "Reference
    # units") when the calibration was timed, and the probe's chunks; 0.0 = none (plain seconds)
    reference_s: float = 0.0
    reference_probe: str = ""
    # probe calls each chunk's reading is the minimum over (the calibration's rounds); a reading
    # beside a measurement must be the same statistic (jvarlen.profile.clock); 0 = not recorded
    reference_calls: int = 0
    # measured profiles: what the profiled layers kept for their backward (a
    # ``parallel.residual_policy`` name); "" = not recorded (profiles before it: plain autodiff, "all")
    residual_policy: str = ""

    @property
    def profiled_residual_policy(self) -> str:
        """:attr:`residual_policy`, profiles from before it was recorded reading as ``"all"``."""
        return self.residual_policy or "all"


@dataclasses.dataclass(frozen=True)
class CostCoefficients(JsonFile):
    """All coefficients of Eq. 1-11. Times in seconds, sizes in bytes.

    * ``fwd`` / ``bwd``: per-layer forward / backward compute (Eq. 1). ``bwd=None`` means
      ``bwd_factor * fwd``. ``per_sp`` optionally overrides both per Ulysses degree (measured).
      ``recompute``: measured per-layer recomputation cost (Eq. 11); None means the forward.
      ``recompute_per_sp`` overrides it per Ulysses degree; a degree in ``per_sp`` but not in
      ``recompute_per_sp`` recomputes at that degree's forward cost.
    * ``head_fwd`` / ``head_bwd``: embedding + final norm + LM head + loss, charged to the last
      stage (the embedding lookup is negligible). ``head_per_sp`` overrides both per degree.
    * Measured per-sp layer coefficients from the profiler include the Ulysses all-to-all of the
      layer (it runs inside the profiled program); such a profile leaves ``alltoall_*`` empty
      for that degree, so Eq. 3 adds nothing on top (``ProfileMeta.source`` says so).
    * ``m_token``: activation bytes stored per token per layer on one device without
      checkpointing (Eq. 5 ``M_token / L``); divided by ``sp``. ``m_head_token``: bytes per row
      of a tile of the head's logits (``jvarlen.head_tiles``) while the head computes its loss and
      gradient: the fp32 logits and their gradient in the compute dtype, ``(4 + e)`` per
      vocabulary entry (``CostModel.head_memory``, ``scripts/head_memory.py``). ``m_stored_token``: bytes per
      token a *stored* layer of the pipeline executor keeps on one device under its residual policy
      (what ``jax.checkpoint`` saves: matmul outputs and the attention's output and logsumexp under
      ``dots_and_attention``), used for a stored layer by Eq. 10 and the executor's account
      (:func:`jvarlen.plan.executor_memory.executor_memory`); 0 where not measured (``m_token`` is
      used then: a measured profile's is XLA's figure for layers under the residual policy it was
      profiled with, ``meta.residual_policy``; the analytic one counts every residual).
    * ``m_context_token``: bytes per *context* token per un-checkpointed layer that the attention
      backward keeps on top of ``m_token``: with every residual kept, the ``[cached K/V; own K/V]``
      concatenation the kernel reads (``2·e·kv_dim``, the default); under a policy that saves
      matmul and attention outputs nothing (it is rebuilt from the cache). Measured by the
      profiler's memory grid (:func:`jvarlen.profile.measure.fit_memory`). Divided by ``sp``.
    * ``m_work_token`` / ``m_work_remat_token``: working memory per token of the backward in
      flight (cotangents and temporaries of one layer; with recomputation also the rebuilt
      residuals of one layer), measured from XLA's temp sizes; ``m_work_context_token`` per context
      token (the cotangent of the concatenated K/V and the context gradient cut from it:
      ``2 · 2·e·kv_dim``). Used by :meth:`CostModel.peak_memory` only, not by Eq. 10.
    * ``bytes_per_element`` (``e``): compute dtype size, used for K/V, dK/dV, checkpoints, P2P and
      all-to-all volumes. ``dkv_bytes_per_element``: accumulated dK/dV dtype (Eq. 5 M_dkv; the
      paper's fp32, 4, by default; jvarlen's executor accumulates in the compute dtype, and the
      analytic and measured profiles say so).
    * Model state (per device): ``master_bytes_per_param`` (fp32 params + Adam m, v) sharded over
      all devices; ``stage_bytes_per_param`` (compute copy + fp32 gradient accumulator) for the
      stage's own parameters, on every device of the stage. ``workspace_bytes``: constant.
    * ``alltoall_intra`` / ``alltoall_inter``: Eq. 3 bandwidth/latency keyed by sp degree
      (``alltoall_default`` when the degree is missing); ``p2p_intra`` / ``p2p_inter`` for Eq. 2,
      and per device for sharded stage weights' gathers (:meth:`CostModel.weight_comm_times`).
    * ``step_overhead``: seconds per iteration outside the pipeline (optimizer update, measured
      sync; ``step_overhead_per_sp`` overrides it per Ulysses degree); plus ``sync_bytes_per_param`` x the largest stage's parameters over ``sync_link``
      (gradient push to / parameter pull from the canonical sharded state, per layout).
    * ``token_buckets``: when the executor pads a chunk to the smallest bucket >= its tokens, the
      linear (matmul) term is charged on the padded count (empty: no padding).
    * ``bucket_token_scale``: ``{sp: {bucket: factor}}``, measured per-token cost of each token bucket
      relative to the fitted ``alpha2`` (whole-model calibration steps, see
      :func:`jvarlen.plan.cost_fit.fit_in_situ_scales`): small and large matmuls do not run at one
      speed per token. A chunk uses the factor of the smallest calibrated bucket ≥ its linear
      tokens (the largest beyond them); a degree without an entry uses 1.
    * ``attention_block``: when > 0, the quadratic term counts visited ``block x block`` tiles of a
      block-skipping kernel (see :func:`tile_pairs`) instead of exact query-key pairs.
    * ``tick_overhead`` + ``tick_token_overhead`` x the step's token bucket + ``tick_context_overhead``
      x its context bucket: seconds per tick of the lock-step executor outside the ops' compute (the
      ``ppermute`` pair, slot reads and writes, the branches' zero outputs: the last two grow with
      the buffers); ``op_overhead`` per op. Fitted on executor steps
      (:func:`jvarlen.plan.cost_fit.fit_tick_overhead`), 0 otherwise.
    * ``tick_recompute_factor``: the lock-step executor's extra cost of a recomputed layer, as a
      multiple of that layer's forward compute, on top of ``recompute``. The executor reruns the
      layer's forward in a backward of its own, from the stored input, where ``recompute`` is
      measured inside one fused forward + backward program (on CPU that costs nothing measurable,
      while the executor's separate backward does). Fitted on executor steps with the tick
      overheads, 0 otherwise.
    * ``executor_bucket_scale``: whether the lock-step executor's chunks (padded to the step's
      bucket) take ``bucket_token_scale`` too. Those factors come from whole-model steps, each chunk's
      forward and backward in one program; the executor runs them in ops of their own, where per-token
      cost may not vary with the bucket the same way. The executor fit keeps the factors or charges its
      chunks one per-token cost, whichever predicts its calibration steps better.

    The executor terms (the tick overheads, ``tick_recompute_factor``, ``executor_bucket_scale``)
    apply where ``pp > 1``: they are fitted on multi-stage steps, and one stage runs each chunk's
    forward and backward as one op, which the whole-model calibration prices (measured at the
    data-parallel step's cost, docs/benchmarks.md, "pp = 1 against the data-parallel step").
    """

    json_indent = 2  # (not a field: unannotated)

    fwd: LayerTime
    bwd: Optional[LayerTime] = None
    bwd_factor: float = 2.0
    per_sp: Mapping[int, tuple[LayerTime, LayerTime]] = dataclasses.field(default_factory=dict)
    recompute: Optional[LayerTime] = None
    recompute_per_sp: Mapping[int, LayerTime] = dataclasses.field(default_factory=dict)
    head_fwd: LayerTime = LayerTime()
    head_bwd: Optional[LayerTime] = None
    head_per_sp: Mapping[int, tuple[LayerTime, LayerTime]] = dataclasses.field(default_factory=dict)
    m_token: float = 0.0
    m_stored_token: float = 0.0
    m_head_token: float = 0.0
    m_context_token: float = 0.0
    m_work_token: float = 0.0
    m_work_remat_token: float = 0.0
    m_work_context_token: float = 0.0
    bytes_per_element: int = 2
    dkv_bytes_per_element: int = 4
    master_bytes_per_param: float = 12.0
    stage_bytes_per_param: float = 6.0
    workspace_bytes: float = 0.0
    memory_budget: float = 80e9
    gpus_per_node: int = 8
    alltoall_intra: Mapping[int, Link] = dataclasses.field(default_factory=dict)
    alltoall_inter: Mapping[int, Link] = dataclasses.field(default_factory=dict)
    alltoall_default: Link = Link(float("inf"), 0.0)
    p2p_intra: Link = Link(float("inf"), 0.0)
    p2p_inter: Link = Link(float("inf"), 0.0)
    step_overhead: float = 0.0
    step_overhead_per_sp: Mapping[int, float] = dataclasses.field(default_factory=dict)
    sync_bytes_per_param: float = 0.0
    sync_link: Link = Link(float("inf"), 0.0)
    token_buckets: tuple[int, ...] = ()
    bucket_token_scale: Mapping[int, Mapping[int, float]] = dataclasses.field(default_factory=dict)
    attention_block: int = 0
    tick_overhead: float = 0.0
    tick_token_overhead: float = 0.0
    tick_context_overhead: float = 0.0
    tick_recompute_factor: float = 0.0
    executor_bucket_scale: bool = True
    op_overhead: float = 0.0
    meta: ProfileMeta = ProfileMeta()

    def layer_times(self, sp: int) -> tuple[LayerTime, LayerTime]:
        """(forward, backward) per-layer compute coefficients for Ulysses degree ``sp``."""
        if sp in self.per_sp:
            return self.per_sp[sp]
        bwd = self.bwd if self.bwd is not None else self.fwd.scaled(self.bwd_factor)
        return self.fwd, bwd

    def head_times(self, sp: int = 1) -> tuple[LayerTime, LayerTime]:
        """(forward, backward) coefficients of the head for Ulysses degree ``sp``."""
        if sp in self.head_per_sp:
            return self.head_per_sp[sp]
        bwd = self.head_bwd if self.head_bwd is not None else self.head_fwd.scaled(self.bwd_factor)
        return self.head_fwd, bwd

    def recompute_times(self, sp: int = 1) -> LayerTime:
        """Per-layer recomputation coefficients (Eq. 11) for Ulysses degree ``sp``."""
        if sp in self.recompute_per_sp:
            return self.recompute_per_sp[sp]
        if self.recompute is None or sp in self.per_sp:
            return self.layer_times(sp)[0]
        return self.recompute

    def step_overhead_for(self, sp: int = 1) -> float:
        """``step_overhead`` for Ulysses degree ``sp`` (measured per degree when profiled)."""
        return self.step_overhead_per_sp.get(sp, self.step_overhead)

    def alltoall_link(self, sp: int) -> Link:
        table = self.alltoall_intra if sp <= self.gpus_per_node else self.alltoall_inter
        return table.get(sp, self.alltoall_default)

    def replace(self, **changes) -> "CostCoefficients":
        return dataclasses.replace(self, **changes)

    # ---- JSON
    def to_json(self) -> dict:
        def link(x: Link) -> dict:
            return {"bandwidth": _num_out(x.bandwidth), "latency": x.latency}

        out = {
            "fwd": dataclasses.asdict(self.fwd),
            "bwd": None if self.bwd is None else dataclasses.asdict(self.bwd),
            "bwd_factor": self.bwd_factor,
            "per_sp": {str(k): [dataclasses.asdict(f), dataclasses.asdict(b)] for k, (f, b) in self.per_sp.items()},
            "recompute": None if self.recompute is None else dataclasses.asdict(self.recompute),
            "recompute_per_sp": {str(k): dataclasses.asdict(v) for k, v in self.recompute_per_sp.items()},
            "head_per_sp": {
                str(k): [dataclasses.asdict(f), dataclasses.asdict(b)] for k, (f, b) in self.head_per_sp.items()
            },
            "step_overhead_per_sp": {str(k): v for k, v in self.step_overhead_per_sp.items()},
            "head_fwd": dataclasses.asdict(self.head_fwd),
            "head_bwd": None if self.head_bwd is None else dataclasses.asdict(self.head_bwd),
            "alltoall_intra": {str(k): link(v) for k, v in self.alltoall_intra.items()},
            "alltoall_inter": {str(k): link(v) for k, v in self.alltoall_inter.items()},
            "alltoall_default": link(self.alltoall_default),
            "p2p_intra": link(self.p2p_intra),
            "p2p_inter": link(self.p2p_inter),
            "sync_link": link(self.sync_link),
            "token_buckets": list(self.token_buckets),
            "bucket_token_scale": {
                str(k): {str(b): f for b, f in v.items()} for k, v in self.bucket_token_scale.items()
            },
            "meta": dataclasses.asdict(self.meta),
        }
        for name in (
            "m_token",
            "m_stored_token",
            "m_head_token",
            "m_context_token",
            "m_work_token",
            "m_work_remat_token",
            "m_work_context_token",
            "bytes_per_element",
            "dkv_bytes_per_element",
            "master_bytes_per_param",
            "stage_bytes_per_param",
            "workspace_bytes",
            "memory_budget",
            "gpus_per_node",
            "step_overhead",
            "attention_block",
            "sync_bytes_per_param",
            "tick_overhead",
            "tick_token_overhead",
            "tick_context_overhead",
            "tick_recompute_factor",
            "executor_bucket_scale",
            "op_overhead",
        ):
            out[name] = getattr(self, name)
        return out

    @classmethod
    def from_json(cls, data: Mapping) -> "CostCoefficients":
        def link(d) -> Link:
            return Link(_num_in(d["bandwidth"]), float(d["latency"]))

        def lt(d) -> Optional[LayerTime]:
            return None if d is None else LayerTime(**d)

        kwargs = dict(data)
        kwargs["fwd"] = lt(data["fwd"])
        kwargs["bwd"] = lt(data.get("bwd"))
        kwargs["recompute"] = lt(data.get("recompute"))
        kwargs["head_fwd"] = lt(data.get("head_fwd")) or LayerTime()
        kwargs["head_bwd"] = lt(data.get("head_bwd"))
        kwargs["per_sp"] = {int(k): (LayerTime(**f), LayerTime(**b)) for k, (f, b) in data.get("per_sp", {}).items()}
        # fields added after the first profiles were saved: absent means "no per-sp override"
        kwargs["recompute_per_sp"] = {int(k): LayerTime(**v) for k, v in data.get("recompute_per_sp", {}).items()}
        kwargs["head_per_sp"] = {
            int(k): (LayerTime(**f), LayerTime(**b)) for k, (f, b) in data.get("head_per_sp", {}).items()
        }
        kwargs["step_overhead_per_sp"] = {int(k): float(v) for k, v in data.get("step_overhead_per_sp", {}).items()}
        kwargs["alltoall_intra"] = {int(k): link(v) for k, v in data.get("alltoall_intra", {}).items()}
        kwargs["alltoall_inter"] = {int(k): link(v) for k, v in data.get("alltoall_inter", {}).items()}
        for name in ("alltoall_default", "p2p_intra", "p2p_inter", "sync_link"):
            if name in data:
                kwargs[name] = link(data[name])
        kwargs["token_buckets"] = tuple(int(b) for b in data.get("token_buckets", ()))
        kwargs["bucket_token_scale"] = {
            int(k): {int(b): float(f) for b, f in v.items()} for k, v in data.get("bucket_token_scale", {}).items()
        }
        kwargs["meta"] = ProfileMeta(**data.get("meta", {}))
        return cls(**kwargs)


def _num_out(x: float):
    return "inf" if math.isinf(x) else x


def _num_in(x) -> float:
    return float(x)  # float("inf") parses "inf"


def profile_filename(model: ModelShape, backend: str, device_kind: str) -> str:
    """File name under which a measured profile is saved: keyed by model shape, backend, device kind."""
    kind = "".join(c if c.isalnum() else "_" for c in device_kind.lower()).strip("_") or "unknown"
    return f"{model.key()}__{backend}__{kind}.json"


# --------------------------------------------------------------------------- cost model
