"""Time and memory cost model of one pipeline stage (InfiniPipe §3.1, Eq. 1-11; Hydraulis App. B).

Units everywhere: **seconds** for time, **bytes per device** for memory. A *stage* is
``num_layers / pp`` decoder layers run by one Ulysses group of ``sp`` devices; stage 0
also holds the embedding, the last stage the final norm, LM head and loss.

Pure Python/numpy: the planner imports this module, so it never imports JAX.
Coefficients come from the profiler (``jvarlen.profile``), from analytic hardware
figures (``jvarlen.plan.hardware``) or from an online refit (``jvarlen.plan.cost_fit``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, Mapping, Optional

import numpy as np

from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --------------------------------------------------------------------------- model shape


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


@dataclasses.dataclass(frozen=True)
class CostCoefficients:
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
      checkpointing (Eq. 5 ``M_token / L``); divided by ``sp``. ``m_head_token``: bytes per token
      the last stage keeps for the head (logits) until its backward.
    * ``m_context_token``: bytes per *context* token per un-checkpointed layer that the attention
      backward keeps on top of ``m_token`` (the kernel reads ``[cached K/V; own K/V]`` as one
      concatenated array and autodiff saves it: ``2·e·kv_dim`` here; 0 for a kernel that reads the
      cache in place). Divided by ``sp``.
    * ``m_work_token`` / ``m_work_remat_token``: working memory per token of the backward in
      flight (cotangents and temporaries of one layer; with recomputation also the rebuilt
      residuals of one layer), measured from XLA's temp sizes; ``m_work_context_token`` per context
      token (the cotangent of the concatenated K/V and the context gradient cut from it:
      ``2 · 2·e·kv_dim``). Used by :meth:`CostModel.peak_memory` only, not by Eq. 10.
    * ``bytes_per_element`` (``e``): compute dtype size, used for K/V, dK/dV, checkpoints, P2P and
      all-to-all volumes. ``dkv_bytes_per_element``: accumulated dK/dV dtype (Eq. 5 M_dkv).
    * Model state (per device): ``master_bytes_per_param`` (fp32 params + Adam m, v) sharded over
      all devices; ``stage_bytes_per_param`` (compute copy + fp32 gradient accumulator) for the
      stage's own parameters, on every device of the stage. ``workspace_bytes``: constant.
    * ``alltoall_intra`` / ``alltoall_inter``: Eq. 3 bandwidth/latency keyed by sp degree
      (``alltoall_default`` when the degree is missing); ``p2p_intra`` / ``p2p_inter`` for Eq. 2.
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
    """

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

    def save(self, path: str | os.PathLike) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostCoefficients":
        with open(path) as f:
            return cls.from_json(json.load(f))


def _num_out(x: float):
    return "inf" if math.isinf(x) else x


def _num_in(x) -> float:
    return float(x)  # float("inf") parses "inf"


def profile_filename(model: ModelShape, backend: str, device_kind: str) -> str:
    """File name under which a measured profile is saved: keyed by model shape, backend, device kind."""
    kind = "".join(c if c.isalnum() else "_" for c in device_kind.lower()).strip("_") or "unknown"
    return f"{model.key()}__{backend}__{kind}.json"


# --------------------------------------------------------------------------- cost model


@functools.lru_cache(maxsize=65536)
def tile_pairs(chunk: ChunkShape, block: int) -> float:
    """Attention work of a block-skipping kernel in units of ``attention_pairs``.

    Layout assumed (and used by the profiler's harness): the chunk's slices are consecutive
    from a block boundary, the ``C`` context keys fill whole blocks right before it. A
    ``block x block`` tile is visited when some document has a query in its row block and a
    visible key (causal) in its column block; it costs ``2·block²`` (``attention_pairs`` counts
    ``(C+s)² − C²``, twice the causal pairs). For one slice of ``n`` whole blocks this is
    ``block²·n(n+1) ≈ T² + T·block``.
    """
    b = block
    nq = -(-chunk.tokens // b)
    nctx = -(-chunk.context // b)
    if len(chunk.slices) == 1:  # the planner's hot path: one slice, nq(nq+1)/2 causal tiles
        return 2.0 * b * b * (nq * (nq + 1) // 2 + nctx * nq)
    # Row block i sees the columns [first(i), i], first(i) being the first block of the earliest
    # slice with a query in row block i (every slice's visible columns end at the diagonal):
    # O(blocks) instead of a blocks² mask (a 2M-token slice has 15,625 blocks of 128).
    ends = np.cumsum(chunk.slices)
    first = np.empty(nq, np.int64)
    for start, end in reversed(list(zip(ends - np.asarray(chunk.slices), ends))):
        first[start // b : (end - 1) // b + 1] = start // b
    tiles = int((np.arange(nq) - first + 1).sum())
    if chunk.context:
        tiles += nctx * ((chunk.slices[0] - 1) // b + 1)
    return 2.0 * b * b * tiles


class CostModel:
    """Per-stage time (s) and memory (bytes per device) of chunks for a given layout.

    ``stage`` arguments select the head/embedding extras of the first and last stage;
    ``stage=None`` means a middle stage (decoder layers only). With ``pp == 1`` the single
    stage is both first and last.
    """

    def __init__(
        self, model: ModelShape, layout: Layout, coeffs: CostCoefficients, state_devices: Optional[int] = None
    ):
        """``state_devices``: the devices the fp32 master parameters and optimizer moments are sharded
        over (the canonical state of the whole run); default the layout's. A device group of a
        heterogeneous strategy runs on fewer devices than hold the state."""
        if model.num_layers % layout.pp:
            raise ValueError(f"{layout}: num_layers ({model.num_layers}) must be divisible by pp ({layout.pp})")
        if model.num_heads % layout.sp:
            raise ValueError(f"{layout}: num_heads ({model.num_heads}) must be divisible by sp ({layout.sp})")
        self.model = model
        self.layout = layout
        self.coeffs = coeffs
        self.state_devices = layout.num_devices if state_devices is None else int(state_devices)
        if self.state_devices < layout.num_devices:
            raise ValueError(
                f"state_devices ({self.state_devices}) must be >= the layout's {layout.num_devices} devices"
            )
        self.layers_per_stage = model.num_layers // layout.pp
        self._fwd, self._bwd = coeffs.layer_times(layout.sp)
        self._head_fwd, self._head_bwd = coeffs.head_times(layout.sp)
        self._recompute = coeffs.recompute_times(layout.sp)
        self._bucket_scale = sorted(coeffs.bucket_token_scale.get(layout.sp, {}).items())

    def with_layout(self, layout: Layout, state_devices: Optional[int] = None) -> "CostModel":
        return CostModel(self.model, layout, self.coeffs, state_devices)

    def _is_last(self, stage: Optional[int]) -> bool:
        return stage is not None and stage == self.layout.pp - 1

    # ---- time (seconds)
    def pairs(self, chunk: ChunkShape) -> float:
        """The quadratic quantity of Eq. 1: exact pairs, or visited tiles (``attention_block``)."""
        b = self.coeffs.attention_block
        return chunk.attention_pairs if b <= 0 else tile_pairs(chunk, b)

    def linear_tokens(self, chunk: ChunkShape) -> int:
        """Tokens the matmuls run over: the chunk padded to its bucket (``token_buckets``)."""
        t = chunk.tokens
        for b in sorted(self.coeffs.token_buckets):
            if b >= t:
                return b
        return t

    def time_tokens(self, chunk: ChunkShape) -> float:
        """The token count the linear term of Eq. 1 is charged on: :meth:`linear_tokens` times the
        measured per-token factor of its bucket (``bucket_token_scale``)."""
        t = self.linear_tokens(chunk)
        if not self._bucket_scale:
            return float(t)
        factor = next((f for b, f in self._bucket_scale if b >= t), self._bucket_scale[-1][1])
        return t * factor

    def layer_fwd_compute(self, chunk: ChunkShape) -> float:
        """Eq. 1 for one layer on the stage's sp group (no all-to-all)."""
        return self._fwd(self.pairs(chunk), self.time_tokens(chunk), self.layout.sp)

    def layer_bwd_compute(self, chunk: ChunkShape) -> float:
        return self._bwd(self.pairs(chunk), self.time_tokens(chunk), self.layout.sp)

    def layer_alltoall_time(self, chunk: ChunkShape) -> float:
        """Eq. 3 for one layer and one direction: four all-to-alls (q, k, v in; output back).

        Each device holds ``tokens/sp`` tokens and sends ``(sp-1)/sp`` of them:
        volume = e · tokens/sp · (sp-1)/sp · (2·q_dim + 2·kv_dim) bytes.
        """
        sp = self.layout.sp
        if sp == 1:
            return 0.0
        e = self.coeffs.bytes_per_element
        m = self.model
        per_token = [m.q_dim, m.kv_dim, m.kv_dim, m.q_dim]
        link = self.coeffs.alltoall_link(sp)
        local = chunk.tokens / sp * (sp - 1) / sp
        return sum(link.time(e * local * w) for w in per_token)

    def alltoall_time(self, chunk: ChunkShape) -> float:
        """Eq. 3 for the whole stage, one direction (forward; backward moves the same volume)."""
        return self.layers_per_stage * self.layer_alltoall_time(chunk)

    def fwd_compute_time(self, chunk: ChunkShape, stage: Optional[int] = None) -> float:
        t = self.layers_per_stage * self.layer_fwd_compute(chunk)
        if self._is_last(stage):
            t += self._head_fwd(0, self.time_tokens(chunk), self.layout.sp)
        return t

    def bwd_compute_time(self, chunk: ChunkShape, stage: Optional[int] = None) -> float:
        t = self.layers_per_stage * self.layer_bwd_compute(chunk)
        if self._is_last(stage):
            t += self._head_bwd(0, self.time_tokens(chunk), self.layout.sp)
        return t

    def fwd_time(self, chunk: ChunkShape, stage: Optional[int] = None) -> float:
        """Eq. 4 = Eq. 1 + Eq. 3 for the stage's layers (+ head on the last stage)."""
        return self.fwd_compute_time(chunk, stage) + self.alltoall_time(chunk)

    def bwd_time(self, chunk: ChunkShape, stage: Optional[int] = None) -> float:
        """Backward of the stage without recomputation (add :meth:`recompute_time`)."""
        return self.bwd_compute_time(chunk, stage) + self.alltoall_time(chunk)

    def recompute_time(self, chunk: ChunkShape, layers: int) -> float:
        """Eq. 11: re-running the forward of ``layers`` checkpointed layers in the backward
        (measured ``coeffs.recompute`` when the profile has it, else the forward)."""
        if not 0 <= layers <= self.layers_per_stage:
            raise ValueError(f"recompute layers must be in [0, {self.layers_per_stage}], got {layers}")
        if layers == 0:
            return 0.0
        compute = self._recompute(self.pairs(chunk), self.time_tokens(chunk), self.layout.sp)
        return layers * (compute + self.layer_alltoall_time(chunk))

    def p2p_time(self, chunk: ChunkShape, stage: int = 0) -> float:
        """Eq. 2: activations (forward) or their gradient (backward) of one chunk crossing the
        boundary between ``stage`` and ``stage + 1``: ``e · D · tokens / sp`` bytes per device.

        The boundary is inter-node when the two stages' devices sit in different nodes
        (mesh order ``(dp, pp, sp)``, ``sp`` fastest, ``gpus_per_node`` devices per node).
        """
        if not 0 <= stage < self.layout.pp - 1:
            raise ValueError(f"p2p boundary stage must be in [0, {self.layout.pp - 1}), got {stage}")
        sp, pp, g = self.layout.sp, self.layout.pp, self.coeffs.gpus_per_node
        firsts = [(d * pp + stage) * sp for d in range(self.layout.dp)]
        intra = all(f // g == (f + 2 * sp - 1) // g for f in firsts)  # worst replica decides
        link = self.coeffs.p2p_intra if intra else self.coeffs.p2p_inter
        return link.time(self.coeffs.bytes_per_element * self.model.d_model * chunk.tokens / sp)

    def step_overhead(self) -> float:
        """Seconds per iteration outside the pipeline: ``step_overhead`` + gradient/parameter sync of
        the largest stage (``sync_bytes_per_param`` over ``sync_link``)."""
        c = self.coeffs
        base = c.step_overhead_for(self.layout.sp)
        if c.sync_bytes_per_param <= 0:
            return base
        params = max(self.model.stage_params(p, self.layout.pp) for p in range(self.layout.pp))
        return base + c.sync_link.time(c.sync_bytes_per_param * params)

    # ---- memory (bytes per device)
    def activation_memory(self, chunk: ChunkShape, ckpt_layers: int = 0, stage: Optional[int] = None) -> float:
        """Eq. 10 for one stage: bytes one device of the stage keeps for ``chunk`` from the start
        of its forward to the end of its backward.

        ``(L_s - l) · M_token · T/sp``  (Eq. 5 Act, un-checkpointed layers)
        ``+ (L_s - l) · m_context_token · C/sp``  (attention residual over the chunk's C context
        keys: the concatenated K/V the kernel reads; not in the paper's Eq. 5, measured here)
        ``+ (1 - I) · 2 · e_dkv · kv_dim · L_s · T/sp``  (Eq. 5 M_dkv)
        ``+ l · e · (D + (1 - I) · 2 · kv_dim) · T/sp``  (Eq. 9 M_ckpt: input, plus K/V kept for
        later slices; with MHA this is ``(3 - 2I) e D``)
        ``+ m_head_token · T/sp`` on the last stage.
        """
        Ls = self.layers_per_stage
        if not 0 <= ckpt_layers <= Ls:
            raise ValueError(f"ckpt_layers must be in [0, {Ls}], got {ckpt_layers}")
        c, m = self.coeffs, self.model
        t = chunk.tokens / self.layout.sp
        not_tail = 0 if chunk.tail else 1
        act = (Ls - ckpt_layers) * (c.m_token * t + c.m_context_token * chunk.context / self.layout.sp)
        dkv = not_tail * 2 * c.dkv_bytes_per_element * m.kv_dim * Ls * t
        ckpt = ckpt_layers * c.bytes_per_element * (m.d_model + not_tail * 2 * m.kv_dim) * t
        head = c.m_head_token * t if self._is_last(stage) else 0.0
        return act + dkv + ckpt + head

    def working_memory(self, chunk: ChunkShape, ckpt_layers: int = 0) -> float:
        """Transient bytes of the backward of ``chunk`` while it runs (cotangents and temporaries of
        one layer; with ``ckpt_layers > 0`` also the residuals of the layer being recomputed):
        ``m_work_token · T/sp`` (or ``m_work_remat_token · T/sp``) ``+ m_work_context_token · C/sp``.
        Only one chunk's backward runs at a time on a stage, so this is added once, not per chunk
        in flight."""
        c = self.coeffs
        per_token = c.m_work_remat_token if ckpt_layers > 0 else c.m_work_token
        return (per_token * chunk.tokens + c.m_work_context_token * chunk.context) / self.layout.sp

    def peak_memory(self, chunk: ChunkShape, ckpt_layers: int = 0, stage: Optional[int] = None) -> float:
        """Peak activation bytes of one device while ``chunk``'s backward runs with no other chunk in
        flight: Eq. 10 (:meth:`activation_memory`) plus :meth:`working_memory`. This is what XLA's
        ``memory_analysis().temp_size_in_bytes`` of a forward+backward program measures
        (``scripts/validate_cost_model.py --memory``)."""
        return self.activation_memory(chunk, ckpt_layers, stage) + self.working_memory(chunk, ckpt_layers)

    def model_state_memory(self, stage: int) -> float:
        """Model states on one device of ``stage`` (Hydraulis B.1 (b)): fp32 master params and
        Adam moments fully sharded over all devices, plus the stage's compute copy and gradient
        accumulator, plus a constant workspace."""
        if not 0 <= stage < self.layout.pp:
            raise ValueError(f"stage must be in [0, {self.layout.pp}), got {stage}")
        c, m = self.coeffs, self.model
        sharded = c.master_bytes_per_param * m.param_count / self.state_devices
        local = c.stage_bytes_per_param * m.stage_params(stage, self.layout.pp)
        return sharded + local + c.workspace_bytes

    @property
    def memory_budget(self) -> float:
        return self.coeffs.memory_budget

    def max_tokens(self, stage: Optional[int] = None, in_flight: int = 1, tail: bool = False) -> int:
        """Hydraulis MaxLen: the largest chunk (tokens) that fits ``in_flight`` times on ``stage``
        (all stages when None) with full recomputation (``ckpt_layers = L_s``), Eq. 8 + 10.

        ``tail=False`` charges the K/V and dK/dV terms of a non-tail slice (the worst case).
        Returns 0 when even the model states do not fit.
        """
        stages = range(self.layout.pp) if stage is None else [stage]
        best = None
        for p in stages:
            free = self.memory_budget - self.model_state_memory(p)
            per_token = self.activation_memory(ChunkShape(0, (self.layout.sp,), tail=tail), self.layers_per_stage, p)
            per_token /= self.layout.sp  # bytes per chunk token
            n = 0 if free <= 0 else int(free // (in_flight * per_token))
            best = n if best is None else min(best, n)
        return best
