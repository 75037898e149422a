"""Typed configuration: one dataclass per concern, composed into :class:`Config`.

YAML files in ``configs/`` set values; the command line overrides them with dotted
keys (``--model.num_layers=4``), parsed by draccus. Every invariant is checked in
``__post_init__`` and the message names the field and what to change.

This module is longer than 500 lines on purpose: every setting of a run and the check that
refuses its bad values sit together, the one file a user reads to learn what a flag means.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import math
import os
import pathlib
from typing import Literal, Optional

import draccus
import yaml


class ConfigError(ValueError):
    """A configuration value breaks an invariant; the message says which and how to fix it."""


def _strict_number(kind: type):
    """draccus turns ``true`` into 1 for an int or float field (``int(True)``): ``train.steps: true``
    would train one step. A number field refuses a boolean instead; the rest is draccus' own parse."""

    def decode(raw_value, path=()):
        if isinstance(raw_value, bool):
            raise draccus.utils.DecodingError(path, f"expected a number, got the boolean {str(raw_value).lower()}")
        if kind is int and isinstance(raw_value, float):
            raise draccus.utils.DecodingError(path, f"expected an int, got the float {raw_value}")
        try:
            return kind(raw_value)
        except ValueError as error:
            article = "an" if kind is int else "a"
            raise draccus.utils.DecodingError(
                path, f"Couldn't parse '{raw_value}' into {article} {kind.__name__}"
            ) from error

    return decode


for _kind in (int, float):
    draccus.decode.register(_kind, _strict_number(_kind))
draccus.parsers.decoding.get_decoding_fn.cache_clear()  # in case a decoder for int was looked up before


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive(owner: str, **values: int | float) -> None:
    for name, value in values.items():
        _require(value > 0 and math.isfinite(value), f"{owner}.{name} must be > 0 and finite, got {value}")


# The choice fields' types, named: draccus finds a field's help comment only on a line whose
# annotation has no quotes (``x: Literal["a"]`` is not recognised, and the comment above it then
# becomes the next field's help).
RopeType = Literal["linear", "llama3"]
ParamDtype = Literal["float32", "bfloat16"]
ComputeDtype = Literal["auto", "float32", "bfloat16"]
AttentionImpl = Literal["auto", "xla", "pallas", "reference"]
DataSource = Literal["stdlib", "jsonl", "text_dir", "parquet"]
LongDocPolicy = Literal["split", "truncate"]
PlanPolicy = Literal[
    "epp",
    "epp-fast",
    "wo-wbc",
    "wo-ckpt",
    "full-ckpt",
    "seq1f1b",
    "seq1f1b-tuned",
    "dapple",
    "hydraulis",
    "flexsp",
    "dcp",
    "dcp-inter",
    "homogeneous",
    "epp-pipelines",
    "auto",
]


@dataclasses.dataclass(frozen=True)
class RopeScalingConfig:
    """A rule that rescales the rotary frequencies for a longer context (Hugging Face's
    ``rope_scaling``): ``linear`` divides every frequency by ``factor`` (position
    interpolation); ``llama3`` divides the low frequencies by ``factor``, keeps the high ones
    and blends in between (``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings`` place the band; see docs/design/hf-interop.md)."""

    rope_type: RopeType = "llama3"  # "linear": every frequency rescaled; "llama3": the low ones, blended between
    factor: float = 8.0  # how many times longer the context gets: the rescaled frequencies are divided by it
    # llama3: wavelengths longer than original_max_position_embeddings / low_freq_factor are rescaled
    low_freq_factor: float = 1.0
    # llama3: wavelengths shorter than original_max_position_embeddings / high_freq_factor are kept
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192  # llama3: the context length the model was trained for

    def __post_init__(self):
        _positive(
            "model.rope_scaling",
            factor=self.factor,
            low_freq_factor=self.low_freq_factor,
            original_max_position_embeddings=self.original_max_position_embeddings,
        )
        _require(
            self.rope_type != "llama3" or self.high_freq_factor > self.low_freq_factor,
            f"model.rope_scaling.high_freq_factor ({self.high_freq_factor}) must be > low_freq_factor "
            f"({self.low_freq_factor}) for the llama3 rule",
        )


# ModelConfig fields that a Hugging Face checkpoint (model.init_from) decides.
CHECKPOINT_FIELDS = (
    "vocab_size",
    "d_model",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
    "norm_eps",
    "tie_embeddings",
    "qkv_bias",
    "rope_theta",
    "rope_scaling",
)
# Of those, the ones a run may change on purpose (context extension): set (named by the config,
# or at a value other than the default), they override the checkpoint's.
ROPE_OVERRIDES = ("rope_theta", "rope_scaling")
# The model fields a command line or config file names (set by parse_config while it builds the
# config): such a field is the user's value even where it equals the default.
_EXPLICIT_MODEL_FIELDS: contextvars.ContextVar[frozenset] = contextvars.ContextVar("explicit", default=frozenset())
STAGE_WEIGHTS = ("replicated", "sharded", "auto", "per_iteration")  # parallel.stage_weights


@dataclasses.dataclass
class ModelConfig:
    """LLaMA-style decoder shape and numerics.

    ``init_from``: a Hugging Face model directory (config.json + safetensors, see
    :mod:`jvarlen.hf`) whose weights the run starts from. Its architecture fields
    (:data:`CHECKPOINT_FIELDS`) are read from its config.json here; a field set to a value other
    than both its default and the checkpoint's is an error, except ``rope_theta`` and
    ``rope_scaling``, which then override the checkpoint's (continued pretraining with a longer
    context). A field a config file or command line names counts as set even at its default
    value. ``from_checkpoint`` lists, after that, what the checkpoint decided.
    """

    vocab_size: int = 320  # byte tokenizer (256 + specials), rounded up to a multiple of 64
    d_model: int = 128  # width of the residual stream
    num_layers: int = 4  # decoder layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention); divides num_heads
    head_dim: Optional[int] = None  # default d_model // num_heads
    mlp_dim: int = 384  # hidden width of the SwiGLU MLP
    rope_theta: float = 10_000.0  # base of the rotary embedding's frequencies
    rope_scaling: Optional[RopeScalingConfig] = None  # None: plain RoPE
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = True  # the output head reuses the embedding table
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    init_from: Optional[str] = None  # a Hugging Face model directory to start from
    param_dtype: ParamDtype = "float32"  # dtype the parameters are stored in
    # Dtype of the matmuls and activations. "auto": bfloat16 on GPU/TPU, float32 on CPU (no bf16
    # matmul units; emulated bf16 is slower).
    compute_dtype: ComputeDtype = "auto"
    # Attention implementation behind jvarlen.model.attention: "auto" picks Pallas on
    # GPU and the blockwise XLA path elsewhere.
    attention: AttentionImpl = "auto"
    # Layers whose forward is recomputed in the backward pass (jax.checkpoint per layer).
    remat: bool = False

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):  # from JSON (a checkpoint's saved model config)
            self.rope_scaling = RopeScalingConfig(**self.rope_scaling)
        if self.init_from is not None:
            # absolute: checkpoints record it, and an export from another directory reads it again
            self.init_from = os.path.abspath(os.path.expanduser(self.init_from))
            self._take_from_checkpoint()
        _positive(
            "model",
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            mlp_dim=self.mlp_dim,
        )
        _require(
            self.num_heads % self.num_kv_heads == 0,
            f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads "
            f"({self.num_kv_heads}) for grouped-query attention; change one of them",
        )
        if self.head_dim is None:
            _require(
                self.d_model % self.num_heads == 0,
                f"model.d_model ({self.d_model}) must be divisible by model.num_heads "
                f"({self.num_heads}), or set model.head_dim explicitly",
            )
            self.head_dim = self.d_model // self.num_heads
        _positive("model", head_dim=self.head_dim, rope_theta=self.rope_theta, norm_eps=self.norm_eps)
        _require(self.head_dim % 2 == 0, f"model.head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def from_checkpoint(self) -> dict:
        """Fields ``init_from``'s config.json decided (name -> value); {} without ``init_from``."""
        return dict(getattr(self, "_from_checkpoint", {}))

    def _take_from_checkpoint(self) -> None:
        from jvarlen.hf.hf_config import HFCheckpointError, read_hf_config, read_model_fields  # no JAX

        try:
            fields = read_model_fields(self.init_from)
        except HFCheckpointError as error:
            raise ConfigError(f"model.init_from: {error}") from None
        if fields["rope_scaling"] is not None:
            fields["rope_scaling"] = RopeScalingConfig(**fields["rope_scaling"])
        defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
        conflicts, taken, overrides = [], {}, {}
        explicit = _EXPLICIT_MODEL_FIELDS.get()
        parts = [n.split(".", 1)[1] for n in explicit if n.startswith("rope_scaling.")]
        if parts and self.rope_scaling is not None and fields["rope_scaling"] is not None:
            # some fields of the checkpoint's scaling named (--model.rope_scaling.factor=4): the rest its own
            named = {part: getattr(self.rope_scaling, part) for part in parts}
            self.rope_scaling = dataclasses.replace(fields["rope_scaling"], **named)
        for name in CHECKPOINT_FIELDS:
            mine, theirs, default = getattr(self, name), fields[name], defaults[name]
            if mine == theirs or (mine == default and name not in explicit):
                setattr(self, name, theirs)
                taken[name] = theirs
            elif name in ROPE_OVERRIDES:
                overrides[name] = theirs  # a deliberate override (context extension): kept
            else:
                conflicts.append(f"model.{name}={mine!r} (the checkpoint has {theirs!r})")
        if (
            parts
            and "original_max_position_embeddings" not in parts
            and fields["rope_scaling"] is None
            and getattr(self.rope_scaling, "rope_type", None) == "llama3"
        ):
            # a llama3 band placed by this base's own length, not the default's 8192 (Llama 3's)
            base_max = read_hf_config(self.init_from).get("max_position_embeddings")
            if isinstance(base_max, int) and base_max > 0:
                self.rope_scaling = dataclasses.replace(self.rope_scaling, original_max_position_embeddings=base_max)
                taken["rope_scaling.original_max_position_embeddings"] = base_max
        _require(
            not conflicts,
            f"model.init_from={self.init_from!r} fixes the model's architecture, but the config sets "
            + ", ".join(conflicts)
            + "; drop these settings (only model.rope_theta and model.rope_scaling may override the checkpoint)",
        )
        self._from_checkpoint, self._overridden = taken, overrides

    def describe_checkpoint_fields(self) -> str:
        """One line saying which fields ``init_from`` decided and which the config overrode."""
        if self.init_from is None:
            return ""
        taken = ", ".join(f"{k}={v}" for k, v in self.from_checkpoint.items())
        line = f"model from {self.init_from}: {taken}"
        for name, theirs in getattr(self, "_overridden", {}).items():
            line += f"; {name}={getattr(self, name)} overrides the checkpoint's {theirs}"
        return line


@dataclasses.dataclass
class DataConfig:
    """Where documents come from and how they become packed batches."""

    # "stdlib": the running Python's standard library sources (always present); "jsonl" (plain or
    # .gz/.bz2/.xz) and "parquet": a record per document; "text_dir": a file per document.
    source: DataSource = "stdlib"
    path: Optional[str] = None  # file or directory for jsonl / text_dir / parquet
    text_field: str = "text"  # jsonl/parquet column holding text
    tokens_field: Optional[str] = None  # jsonl/parquet column holding token ids instead of text
    tokenizer: str = "byte"  # "byte" or a Hugging Face tokenizers JSON file
    cache_dir: Optional[str] = None  # tokenized corpus cache; default ~/.cache/jvarlen
    seq_len: int = 1024  # tokens per packed row
    tokens_per_batch: int = 8192  # global token budget of one step
    max_doc_tokens: Optional[int] = None  # longer documents are split/truncated; default seq_len
    # A document longer than max_doc_tokens: "split" into pieces (none dropped), or "truncate"d
    # to its first max_doc_tokens tokens (the drop is counted in the corpus summary).
    long_doc_policy: LongDocPolicy = "split"
    max_documents: Optional[int] = None  # use only the first N documents of the corpus
    seed: int = 0  # seeds the order in which document pieces are drawn into batches (a new one each epoch)

    def __post_init__(self):
        _positive("data", seq_len=self.seq_len, tokens_per_batch=self.tokens_per_batch)
        _require(
            self.tokens_per_batch % self.seq_len == 0,
            f"data.tokens_per_batch ({self.tokens_per_batch}) must be a multiple of data.seq_len "
            f"({self.seq_len}): a batch is a whole number of packed rows",
        )
        if self.max_doc_tokens is None:
            self.max_doc_tokens = self.seq_len
        _require(
            0 < self.max_doc_tokens <= self.seq_len,
            f"data.max_doc_tokens ({self.max_doc_tokens}) must be in [1, data.seq_len={self.seq_len}]: "
            "a document piece has to fit in one packed row",
        )
        _require(
            self.source == "stdlib" or self.path is not None,
            f"data.path is required for data.source={self.source!r}",
        )
        # a field that the source does not read would otherwise be ignored: training on another corpus
        _require(
            self.source != "stdlib" or self.path is None,
            f"data.path={self.path!r} is set but data.source is 'stdlib' (the standard library's sources); set "
            "data.source to jsonl, text_dir or parquet to read it",
        )
        _require(
            self.tokens_field is None or self.source in ("jsonl", "parquet"),
            f"data.tokens_field applies to jsonl and parquet sources, not data.source={self.source!r}",
        )
        _require(
            self.text_field == "text" or self.source in ("jsonl", "parquet"),
            f"data.text_field applies to jsonl and parquet sources, not data.source={self.source!r}",
        )
        _require(
            self.tokens_field is None or self.text_field == "text",
            f"data.text_field={self.text_field!r} and data.tokens_field={self.tokens_field!r} are both set; "
            "a source holds either text or token ids",
        )
        _require(self.seed >= 0, f"data.seed must be >= 0, got {self.seed}")
        if self.max_documents is not None:
            _positive("data", max_documents=self.max_documents)

    @property
    def rows_per_batch(self) -> int:
        return self.tokens_per_batch // self.seq_len


@dataclasses.dataclass
class OptimizerConfig:
    """AdamW with linear warmup, cosine decay and global-norm clipping."""

    learning_rate: float = 3e-3  # the peak, reached at the end of the warmup
    warmup_steps: int = 10  # updates rising linearly to the peak
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak
    b1: float = 0.9  # AdamW's decay of the gradient average
    b2: float = 0.95  # AdamW's decay of the squared-gradient average
    eps: float = 1e-8  # AdamW's denominator epsilon
    weight_decay: float = 0.1  # decoupled, on matrices only (not norm scales or biases)
    grad_clip_norm: float = 1.0  # the global gradient norm is clipped to this (inf: no clipping)

    def __post_init__(self):
        _positive("optimizer", learning_rate=self.learning_rate)
        _require(
            self.grad_clip_norm > 0,
            f"optimizer.grad_clip_norm must be > 0 (inf: no clipping), got {self.grad_clip_norm}",
        )
        _require(self.warmup_steps >= 0, f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        _require(0 <= self.min_lr_ratio <= 1, f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("b1", "b2"):
            value = getattr(self, name)
            _require(0 <= value < 1, f"optimizer.{name} must be in [0, 1), got {value}")
        _positive("optimizer", eps=self.eps)
        _require(
            0 <= self.weight_decay < math.inf,
            f"optimizer.weight_decay must be >= 0 and finite, got {self.weight_decay}",
        )


@dataclasses.dataclass
class ParallelConfig:
    """Device arrangement. dp defaults to all devices not used by pp and sp."""

    dp: Optional[int] = None  # data-parallel replicas; default: every device that pp and sp leave
    # Pipeline stages. None (default) = auto: 2 — the elastic pipeline path — when the
    # devices and layers split in two and no data-parallel layout policy is set, else 1
    # (see resolve_pipeline_stages). On a CPU-only host `python -m jvarlen.train` gives the
    # host platform the devices a pipeline needs.
    pp: Optional[int] = None
    sp: int = 1  # sequence-parallel (Ulysses) devices per sequence: attention heads split over them
    # Multi-host: jax.distributed.initialize is called when enabled; with no address
    # it auto-detects the cluster (SLURM and friends).
    distributed: bool = False
    coordinator_address: Optional[str] = None  # host:port of process 0; default auto-detected
    num_processes: Optional[int] = None  # processes of the run; default auto-detected
    process_id: Optional[int] = None  # this process's index in [0, num_processes); default auto-detected
    # Seconds without a heartbeat after which the coordination service declares a process dead and
    # ends every other one (JAX's default, 100): what a run loses when a host dies without a word
    # (SIGKILL, power, the OOM killer). Lower fails faster; too low ends healthy runs on a stall.
    heartbeat_timeout_s: int = 100
    compilation_cache_dir: Optional[str] = None  # persistent XLA compilation cache
    # Layout per iteration (jvarlen.runtime.layout_policy): each step uses the smallest sp whose
    # per-device tokens fit this (dp and sp above are then ignored). Unset, and sp_cycle unset: the
    # fixed layout (dp, pp, sp).
    tokens_per_device: Optional[int] = None
    # Layout per iteration, for tests and benchmarks: the steps cycle through these sp degrees.
    sp_cycle: Optional[list[int]] = None
    # What a layer that is not recomputed keeps for its backward, in every execution strategy (the
    # data-parallel step's layers when model.remat is off, a pipeline's or a group's stored layers):
    # "dots_and_attention" (matmul and attention outputs; elementwise ops are recomputed in the
    # backward), "all" (every residual, plain autodiff), or a jax.checkpoint_policies name.
    residual_policy: str = "dots_and_attention"
    # A pipeline stage's layers (and their gradient accumulator): "replicated" (every device holds
    # the stage) or "sharded" (ZeRO-3 over the stage's sp devices and the dp pipelines: 1/(dp·sp)
    # each, a layer gathered whole one layer ahead of its use; the planner's memory model follows);
    # "auto" (strategy policies only): whichever the planner predicts faster on the run's first
    # sample batches, chosen once at the start; "per_iteration" (strategy policies only): every
    # iteration planned both ways and run as the faster plan (a second plan, searched below the
    # first's time where the policy can; both variants' programs compiled as they are used).
    stage_weights: str = "replicated"

    @property
    def chooses_dp_layouts(self) -> bool:
        """A data-parallel layout policy (tokens_per_device or sp_cycle) is set."""
        return self.tokens_per_device is not None or self.sp_cycle is not None

    def __post_init__(self):
        _positive("parallel", sp=self.sp)
        if self.pp is not None:
            _positive("parallel", pp=self.pp)
        if self.dp is not None:
            _positive("parallel", dp=self.dp)
        if self.tokens_per_device is not None:
            _positive("parallel", tokens_per_device=self.tokens_per_device)
        if self.sp_cycle is not None:
            _require(
                len(self.sp_cycle) > 0 and all(isinstance(s, int) and s > 0 for s in self.sp_cycle),
                f"parallel.sp_cycle must be a non-empty list of positive ints, got {self.sp_cycle}",
            )
        _require(
            self.tokens_per_device is None or self.sp_cycle is None,
            "parallel.tokens_per_device and parallel.sp_cycle both choose the layout per step; set only one",
        )
        _require(
            self.stage_weights in STAGE_WEIGHTS,
            f"parallel.stage_weights must be one of {STAGE_WEIGHTS}, got {self.stage_weights!r}",
        )
        _positive("parallel", heartbeat_timeout_s=self.heartbeat_timeout_s)
        if self.num_processes is not None:
            _positive("parallel", num_processes=self.num_processes)
        if self.process_id is not None:
            _require(
                self.process_id >= 0 and (self.num_processes is None or self.process_id < self.num_processes),
                f"parallel.process_id ({self.process_id}) must be in [0, parallel.num_processes={self.num_processes})",
            )
        multihost = ("coordinator_address", "num_processes", "process_id")
        given = [f"parallel.{name}" for name in multihost if getattr(self, name) is not None]
        _require(
            self.distributed or not given,
            f"{', '.join(given)} set without parallel.distributed=true: the run would train alone, as one "
            "process; set parallel.distributed=true (or drop them)",
        )


STRATEGY_POLICIES = ("hydraulis", "flexsp", "dcp", "dcp-inter", "homogeneous", "epp-pipelines", "auto")


@dataclasses.dataclass
class PlanConfig:
    """The per-iteration planner (jvarlen.plan) of the elastic pipeline path (parallel.pp > 1):
    every iteration's documents become chunks, schedule and recomputation tables. There,
    data.seq_len is the longest document piece (data.max_doc_tokens defaults to it)."""

    # EPP and its baselines plan the elastic pipeline (parallel.pp > 1). The strategy policies plan
    # heterogeneous device groups over all dp * pp * sp devices of the config (docs/design/
    # heterogeneous.md): hydraulis, flexsp, dcp, dcp-inter, homogeneous (the best d x P per
    # iteration), epp-pipelines, and auto (the fastest of them, per iteration).
    policy: PlanPolicy = "epp"
    # The finest average slice of a split document; the planner's API defaults to 4096 (finer chunks
    # lose GPU efficiency, InfiniPipe App. B), this default suits the short contexts of CPU runs:
    # raise it for GPU runs with long contexts (fewer slice counts to search, none too small).
    min_slice_tokens: int = 512
    # Run a 1F1B unit in GPipe order (all forwards, then all backwards) when the lock-step
    # simulator says it is faster and it fits memory (more chunks in flight).
    gpipe_units: bool = True
    # Iterations sampled and solved ahead in background planning processes (0: plan inline).
    ahead: int = 2
    # Planning processes. Up to ahead + 1 iterations are solved at once, so keep ahead >= workers;
    # a policy whose plan takes longer than a step (auto on 64 devices: docs/benchmarks.md) needs
    # about plan seconds / step seconds of them to stay ahead, divided by the run's processes
    # (each solves every P-th plan: runtime/plan_exchange.py), and ahead >= plan / step seconds.
    workers: int = 1
    # Wait for the solver instead of taking a fast fallback plan when it is late: plans (and so
    # a resumed run) are then reproducible whatever the machine load. With several processes each
    # plan is solved by one of them and read by the others, fallback or not (runtime/plan_exchange.py).
    wait: bool = False
    # Deterministic-time limit of each checkpointing MILP (CP-SAT). It binds before the wall-clock
    # limit, so a resumed run plans the same chunks.
    solver_deterministic_time: float = 0.5
    # Wall-clock limit of each checkpointing MILP, a safety net. With plan.wait every planner
    # solve runs on one worker with this raised to at least 120 s, so that machine load cannot
    # change a plan (jvarlen/plan/cpsat.py).
    solver_time_limit_s: float = 30.0
    solver_workers: int = 1  # CP-SAT search workers per MILP
    solver_seed: int = 0  # CP-SAT's random seed

    @property
    def uses_groups(self) -> bool:
        """A strategy policy: heterogeneous device groups per iteration."""
        return self.policy in STRATEGY_POLICIES

    def __post_init__(self):
        _positive(
            "plan",
            min_slice_tokens=self.min_slice_tokens,
            solver_time_limit_s=self.solver_time_limit_s,
            solver_workers=self.solver_workers,
            workers=self.workers,
        )
        _require(self.ahead >= 0, f"plan.ahead must be >= 0, got {self.ahead}")
        _require(
            self.workers == 1 or self.ahead + 1 >= self.workers,
            f"plan.workers={self.workers} needs plan.ahead >= {self.workers - 1} (at most ahead + 1 "
            f"iterations are planned at once), got plan.ahead={self.ahead}",
        )
        _require(
            self.solver_deterministic_time >= 0,
            f"plan.solver_deterministic_time must be >= 0, got {self.solver_deterministic_time}",
        )
        if self.uses_groups:  # the strategy policies plan with their own settings
            pipeline_only = ("min_slice_tokens", "gpipe_units", "solver_deterministic_time", "solver_time_limit_s",
                             "solver_workers", "solver_seed")  # fmt: skip
            ignored = [f"plan.{f.name}" for f in dataclasses.fields(self) if f.name in pipeline_only
                       and getattr(self, f.name) != f.default]  # fmt: skip
            _require(
                not ignored,
                f"{', '.join(ignored)} set the elastic pipeline's planner (parallel.pp > 1); plan.policy="
                f"{self.policy} plans device groups with its own settings and would ignore them: remove them",
            )


@dataclasses.dataclass
class TrainConfig:
    """The run: how long, from which initialization, and what it checks as it goes."""

    steps: int = 100  # optimizer updates of the run (a resumed run continues up to this)
    seed: int = 0  # parameter initialization and the step's random key
    # Cost model used to log predicted vs measured step time: "auto" finds the profile of
    # this model on this backend (python -m jvarlen.profile), "none" disables, or a path.
    cost_profile: Optional[str] = "auto"
    cost_refit_every: int = 20  # refit the cost coefficients from measured steps this often
    # A step whose loss or gradient is not finite skips its update (state unchanged, logged as
    # "nonfinite"); this many in a row stop the run with an error.
    max_nonfinite_steps: int = 3

    def __post_init__(self):
        _positive(
            "train",
            steps=self.steps,
            cost_refit_every=self.cost_refit_every,
            max_nonfinite_steps=self.max_nonfinite_steps,
        )


@dataclasses.dataclass
class CheckpointConfig:
    """Orbax checkpoints of the whole training state, in the run directory."""

    every_steps: int = 50  # also saved at the last step
    max_to_keep: int = 2  # the newest checkpoints kept; older ones are deleted
    async_save: bool = True  # write in the background while the next steps train
    resume: bool = False  # continue from the newest checkpoint in the run directory

    def __post_init__(self):
        _positive("checkpoint", every_steps=self.every_steps, max_to_keep=self.max_to_keep)


@dataclasses.dataclass
class LoggingConfig:
    """Where the run writes and what it shows."""

    run_dir: str = "runs/default"  # metrics.jsonl, TensorBoard events and checkpoints
    tensorboard: bool = True  # also write the metrics as TensorBoard events
    progress_bar: bool = True  # a progress bar with loss, tokens/s and ETA on the terminal
    # A run that does not resume refuses a run_dir holding an earlier run's metrics or
    # checkpoints; overwrite=true deletes them (metrics, TensorBoard events, checkpoints) once the
    # configuration has been accepted, before the first step.
    overwrite: bool = False
    # Dense bf16 TFLOP/s of one device, for the logged mfu (model FLOPs utilization); 0: the
    # datasheet figure of a known GPU (H100, H200, H800, A100, A800), and no mfu on other devices.
    peak_tflops: float = 0.0
    # [first, last]: a profiler trace of these steps (1-based, inclusive) under run_dir/tensorboard,
    # for TensorBoard's profile tab or Perfetto. Tracing slows the steps it covers.
    trace_steps: Optional[list[int]] = None

    def __post_init__(self):
        _require(bool(self.run_dir and self.run_dir.strip()), "logging.run_dir must name a directory")
        if self.trace_steps is not None:
            steps = self.trace_steps
            _require(
                len(steps) == 2 and all(isinstance(s, int) for s in steps) and 1 <= steps[0] <= steps[1],
                f"logging.trace_steps must be [first, last] with 1 <= first <= last, got {steps}",
            )
        _require(
            self.peak_tflops >= 0 and math.isfinite(self.peak_tflops),
            f"logging.peak_tflops must be >= 0 and finite, got {self.peak_tflops}",
        )


@dataclasses.dataclass
class EvalConfig:
    """Evaluation (docs/design/evaluation.md): the mean loss of documents no step trains on, logged as
    eval_loss. They are held out of the training corpus (``documents``) or come from a corpus of
    their own (``path``); with neither, the run does not evaluate."""

    # Documents held out of the training corpus (whole documents, the same set whatever data.seed).
    documents: int = 0
    # A validation corpus of its own instead: every document of it, read with data's fields and tokenizer.
    path: Optional[str] = None
    source: Optional[DataSource] = None  # the format of eval.path; default data.source
    max_documents: Optional[int] = None  # of eval.path, only the first N documents
    every_steps: int = 50  # evaluate after every this many steps, and after the run's last step
    # Also the loss by the context a prediction had: edges of position bins within a piece, e.g.
    # [128, 1024] logs eval_loss/pos_0-127, eval_loss/pos_128-1023 and eval_loss/pos_1024+.
    position_bins: Optional[list[int]] = None

    @property
    def enabled(self) -> bool:
        return self.documents > 0 or self.path is not None

    def __post_init__(self):
        _require(self.documents >= 0, f"eval.documents must be >= 0 (0: none held out), got {self.documents}")
        _positive("eval", every_steps=self.every_steps)
        _require(
            not (self.documents and self.path is not None),
            f"eval.documents={self.documents} and eval.path={self.path!r} both choose what the run evaluates on "
            "(documents held out of the training corpus, or a corpus of its own); set one",
        )
        unread = [name for name in ("source", "max_documents") if getattr(self, name) is not None]
        _require(
            self.path is not None or not unread,
            f"{', '.join('eval.' + n for n in unread)} describe eval.path, which is not set: set eval.path (or drop them)",
        )
        if self.max_documents is not None:
            _positive("eval", max_documents=self.max_documents)
        if self.position_bins is not None:
            edges = self.position_bins
            _require(
                len(edges) > 0
                and all(isinstance(e, int) and e > 0 for e in edges)
                and all(a < b for a, b in zip(edges, edges[1:])),
                f"eval.position_bins must be increasing positive positions (bin edges), got {edges}",
            )

    def data(self, data: DataConfig) -> DataConfig:
        """The data settings that read ``path``: data's fields, tokenizer, cache and row shape."""
        return dataclasses.replace(
            data, source=self.source or data.source, path=self.path, max_documents=self.max_documents
        )


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    plan: PlanConfig = dataclasses.field(default_factory=PlanConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    def __post_init__(self):
        _require(
            not (self.checkpoint.resume and self.logging.overwrite),
            "checkpoint.resume=true continues the run in logging.run_dir and logging.overwrite=true deletes "
            "it; set one of them",
        )
        if self.eval.path is not None:
            _require(
                (self.eval.source or self.data.source) != "stdlib",
                f"eval.path={self.eval.path!r} is read as data.source, which is 'stdlib'; set eval.source to jsonl, "
                "text_dir or parquet",
            )
            self.eval.data(self.data)  # the data settings that read it, checked now
        chosen = self.parallel.stage_weights
        _require(
            chosen not in ("auto", "per_iteration") or self.plan.uses_groups,
            f"parallel.stage_weights={chosen} is chosen by planning batches with a strategy policy "
            f"(plan.policy in {STRATEGY_POLICIES}); with plan.policy={self.plan.policy} set it to replicated or sharded",
        )


CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


def parse_config(args: Optional[list[str]] = None) -> Config:
    """Parses ``--config PATH`` (YAML) plus dotted overrides into a validated :class:`Config`.

    Raises ConfigError for bad values, unknown keys and wrong types, each naming the offending
    field.
    """
    args = list(args or [])
    config_path = None
    given = [a.split("=", 1)[0] for a in args if a.split("=", 1)[0] in ("--config", "--config_path")]
    _require(len(given) <= 1, f"{' and '.join(given)}: give one config file (the others would be ignored)")
    for i, arg in enumerate(args):
        if arg == "--config" or arg == "--config_path":
            _require(i + 1 < len(args), f"{arg} needs the path of a YAML config file")
            config_path = args[i + 1]
            del args[i : i + 2]
            break
        if arg.startswith("--config=") or arg.startswith("--config_path="):
            config_path = arg.split("=", 1)[1]
            del args[i]
            break
    content = None if config_path is None else _check_config_file(config_path)
    if content is None:
        config_path = None  # no file, or an empty one (comments only): the defaults and the overrides
    token = _EXPLICIT_MODEL_FIELDS.set(_model_fields_named(content, args))
    try:
        return draccus.parse(Config, config_path=config_path, args=args, exit_on_error=False)
    except argparse.ArgumentError as error:  # a value outside a flag's fixed choices
        raise ConfigError(str(error)) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {config_path!r} is not valid YAML: {error}") from None
    except draccus.utils.DraccusException as error:  # parsing errors, unknown arguments
        cause = error.__cause__
        while cause is not None and not isinstance(cause, (ConfigError, yaml.YAMLError)):
            cause = cause.__cause__
        if isinstance(cause, yaml.YAMLError):
            raise ConfigError(f"config file {config_path!r} is not valid YAML: {cause}") from None
        if cause is not None:
            raise cause from None
        raise ConfigError(str(error)) from error
    finally:
        _EXPLICIT_MODEL_FIELDS.reset(token)


def _model_fields_named(content: Optional[dict], args: list[str]) -> frozenset:
    """The ``model.*`` fields a config file's ``model:`` section or a ``--model.X`` flag names, and
    ``rope_scaling.X`` for the scaling's own fields named."""
    section = (content or {}).get("model")
    section = section if isinstance(section, dict) else {}
    named = set(section)
    if isinstance(section.get("rope_scaling"), dict):
        named.update(f"rope_scaling.{k}" for k in section["rope_scaling"])
    for arg in args:
        if arg.startswith("--model."):
            field = arg[len("--model.") :].split("=", 1)[0]  # "rope_scaling.factor": both names
            named.update({field.split(".")[0], field})
    return frozenset(named)


def _check_config_file(path: str) -> Optional[dict]:
    """A config file's content: a YAML mapping of sections (``model:``, ``data:``, ...), or None for
    an empty file (it sets nothing)."""
    _require(os.path.exists(path), f"config file {path!r} does not exist")
    _require(not os.path.isdir(path), f"config file {path!r} is a directory; give a YAML file")
    try:
        with open(path, encoding="utf-8") as f:
            content = yaml.safe_load(f)
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path!r} is not valid YAML: {error}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path!r} cannot be read: {error}") from None
    _require(
        content is None or isinstance(content, dict),
        f"config file {path!r} holds a {type(content).__name__}, not a mapping of sections (model:, data:, ...)",
    )
    return content


def load_config(path: str | os.PathLike, **overrides: str) -> Config:
    """Loads a YAML config with optional dotted overrides, for use from Python."""
    args = [f"--{key}={value}" for key, value in overrides.items()]
    return parse_config(["--config", str(path), *args])


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)
