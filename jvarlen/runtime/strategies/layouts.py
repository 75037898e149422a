"""The data-parallel layouts strategy: each iteration's packed rows run as one program on a
``(dp, 1, sp)`` layout of all devices (rows over dp, a row's tokens over sp, Ulysses attention),
pulled from and pushed to the canonical state inside the step.

Which layout an iteration runs with (:class:`LayoutPolicy`):

* budget (``parallel.tokens_per_device``): the smallest ``sp`` whose per-device tokens,
  ``ceil(rows / dp) * seq_len / sp``, fit the budget — long rows get more sequence
  parallelism, short rows the cheaper data parallelism;
* cycle (``parallel.sp_cycle``): sp degrees in turn, step by step (tests, benchmarks);
* fixed: ``Layout(dp, pp, sp)`` from the config.

Every candidate is checked against the device count, the heads and the row length.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import numpy as np

from jvarlen.config import Config, ConfigError
from jvarlen.data.packer import pack
from jvarlen.layout import Layout, resolve_layout
from jvarlen.model.transformer import DOTS_AND_ATTENTION, resolve_compute_dtype
from jvarlen.parallel.layouts import batch_sharding
from jvarlen.parallel.sharding import TokenShards, pull, push
from jvarlen.parallel.ulysses import ulysses_attention_fn
from jvarlen.runtime.step import BATCH_KEYS, CompiledStep, single_program_grads, single_program_sums
from jvarlen.runtime.strategy import ExecutionStrategy, Prepared, StepContext, checked_residual


def per_device_tokens(layout: Layout, rows: int, seq_len: int) -> int:
    """Tokens one device holds for a ``[rows, seq_len]`` batch (rows padded up to dp)."""
    return math.ceil(rows / layout.dp) * math.ceil(seq_len / layout.sp)


@dataclasses.dataclass(frozen=True)
class LayoutPolicy:
    num_devices: int
    num_heads: int
    pp: int = 1
    fixed: Optional[Layout] = None
    tokens_per_device: Optional[int] = None
    sp_cycle: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: Config, num_devices: int) -> "LayoutPolicy":
        if config.parallel.pp is None:  # auto stages, asked for the data-parallel path: one stage
            config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, pp=1))
        par = config.parallel
        heads = config.model.num_heads
        fixed = None
        if not par.chooses_dp_layouts:
            fixed = resolve_layout(config, num_devices)
            if fixed.pp != 1:
                raise ConfigError(f"parallel.pp={fixed.pp}: pipeline parallelism needs the pipeline executor; use pp=1")
        for sp in par.sp_cycle or ():
            _validate(Layout(dp=max(num_devices // sp, 1), pp=1, sp=sp), num_devices, heads)
        for sp in [fixed.sp] if fixed is not None else par.sp_cycle or ():  # Ulysses splits each row by sp
            if config.data.seq_len % sp:
                raise ConfigError(
                    f"data.seq_len ({config.data.seq_len}) must be divisible by sp ({sp}): Ulysses splits each "
                    "row's tokens over the sp devices"
                )
        policy = cls(num_devices, heads, 1, fixed, par.tokens_per_device, tuple(par.sp_cycle or ()))
        if par.tokens_per_device is not None:  # every batch is [rows_per_batch, seq_len]: refused at the start
            policy.choose(0, config.data.rows_per_batch, config.data.seq_len)
        return policy

    def candidates(self, seq_len: int) -> list[Layout]:
        """Valid layouts for rows of ``seq_len`` tokens, by increasing sp."""
        out = []
        for sp in range(1, self.num_devices // self.pp + 1):
            if (self.num_devices // self.pp) % sp or self.num_heads % sp or seq_len % sp:
                continue
            out.append(Layout(dp=self.num_devices // (self.pp * sp), pp=self.pp, sp=sp))
        return out

    def choose(self, step: int, rows: int, seq_len: int) -> Layout:
        """The layout of iteration ``step`` for a ``[rows, seq_len]`` batch."""
        if self.fixed is not None:
            return self.fixed
        if self.sp_cycle:
            sp = self.sp_cycle[step % len(self.sp_cycle)]
            return Layout(dp=self.num_devices // (self.pp * sp), pp=self.pp, sp=sp)
        candidates = self.candidates(seq_len)
        for layout in candidates:
            if per_device_tokens(layout, rows, seq_len) <= self.tokens_per_device:
                return layout
        best = candidates[-1] if candidates else None
        raise ConfigError(
            f"no layout fits parallel.tokens_per_device={self.tokens_per_device} for a [{rows}, {seq_len}] batch "
            f"on {self.num_devices} devices (best: {best}, "
            f"{per_device_tokens(best, rows, seq_len) if best else '-'} tokens per device); "
            "raise the budget or shorten data.seq_len"
        )


def _validate(layout: Layout, num_devices: int, num_heads: int) -> None:
    try:
        layout.validate(num_devices, num_heads=num_heads)
    except ValueError as error:
        raise ConfigError(f"parallel: {error}") from None


def pad_rows(batch: dict, dp: int) -> dict:
    """Pads ``[rows, T]`` arrays with all-padding rows (segment 0, no targets) up to a multiple of dp."""
    rows = next(iter(batch.values())).shape[0]
    extra = (-rows) % dp
    if not extra:
        return batch
    return {k: np.concatenate([v, np.zeros((extra, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}


class LayoutStrategy(ExecutionStrategy):
    """Rows of ``data.seq_len`` tokens on one ``(dp, 1, sp)`` layout per iteration (:class:`LayoutPolicy`).
    ``residual``: what a layer that is not rematerialised keeps (``parallel.residual_policy``, as the
    pipeline's stored layers)."""

    name = "layouts"

    def __init__(
        self,
        ctx: StepContext,
        policy: LayoutPolicy,
        rows: int,
        seq_len: int,
        layout_for_step=None,
        *,
        residual: Optional[str] = DOTS_AND_ATTENTION,
        eval_position_edges: tuple = (),
    ):
        """``eval_position_edges``: the evaluation step's loss also by position (``eval.position_bins``)."""
        self.ctx, self.policy, self.rows, self.seq_len = ctx, policy, rows, seq_len
        self.eval_position_edges = tuple(eval_position_edges)
        self.residual = checked_residual(residual)
        self.layout_for_step = layout_for_step or (lambda step, rows, seq_len: policy.choose(step, rows, seq_len))

    def prepare(self, iteration, known=()) -> Prepared:
        batch = pack(iteration.pieces, self.rows, self.seq_len, iteration.rows)
        arrays = {key: getattr(batch, key) for key in BATCH_KEYS}
        layout = self.layout_for_step(iteration.step, *arrays["tokens"].shape)
        arrays = pad_rows(arrays, layout.dp)
        # of the rows the step computes: the packed batch's and the all-padding rows dp needs
        padding = float(np.mean(arrays["segment_ids"] == 0))
        info = {"padding_ratio": padding, "dp": layout.dp, "pp": 1, "sp": layout.sp}
        return Prepared(("layout", layout, shape_bucket(arrays)), arrays, info)

    def _program(self, layout: Layout) -> tuple:
        """(mesh, attention, pull) of a step on ``layout``: Ulysses attention over its sp devices and
        the parameters pulled (cast + gathered) from the canonical state inside the step."""
        mesh = self.ctx.placement.mesh(layout)
        dtype = resolve_compute_dtype(self.ctx.model.compute_dtype)
        return mesh, ulysses_attention_fn(mesh, self.ctx.model.attention), lambda params: pull(params, mesh, dtype)

    def step_inputs(self, key) -> tuple:
        """(grads_fn, batch shapes, batch shardings) of signature ``key``: the rows over dp, tokens
        over sp; parameters pulled (cast + gathered) inside the step, gradients pushed back."""
        _, layout, bucket = key
        ctx = self.ctx
        mesh, attention, pulled = self._program(layout)
        grads_fn = single_program_grads(
            ctx.graphdef,
            attention,
            pull=pulled,
            push=lambda grads, params: push(grads, ctx.placement.state_sharding.params, params, mesh),
            fp32_weight_sums=True,
            spmd=TokenShards(mesh),
            residual=self.residual,
        )
        return (grads_fn, *_batch_specs(mesh, bucket))

    def compile(self, key) -> CompiledStep:
        return self.ctx.compile(*self.step_inputs(key))

    def eval_key(self, prepared: Prepared) -> tuple:
        """The signature of ``prepared``'s evaluation step in a compile cache (beside its train step's)."""
        return ("eval", self.eval_position_edges, *prepared.key)

    def compile_eval(self, key) -> CompiledStep:
        """The evaluation step of signature ``key`` (:meth:`eval_key`): the forward pass with the
        training step's layout, pull and token shards, no update (docs/design/evaluation.md)."""
        _, edges, _, layout, bucket = key
        mesh, attention, pulled = self._program(layout)
        sums_fn = single_program_sums(
            self.ctx.graphdef, attention, pull=pulled, spmd=TokenShards(mesh), position_edges=edges
        )
        return self.ctx.compile_eval(sums_fn, *_batch_specs(mesh, bucket))

    def observe(self, check, iteration, prepared: Prepared, step_s: float, run_s: float) -> dict:
        # the step itself, as the pipeline and groups paths are checked (not the host's sampling and packing)
        return check.observe(prepared.arrays["segment_ids"], prepared.key[1], run_s)

    def describe(self) -> str:
        p = self.policy
        how = (
            f"fixed {p.fixed}"
            if p.fixed
            else f"sp cycle {list(p.sp_cycle)}"
            if p.sp_cycle
            else (f"per step within {p.tokens_per_device} tokens per device")
        )
        return f"data-parallel layouts: {how}"


def layout_loss_and_grads(
    graphdef,
    params,
    params_sharding,
    batch: dict,
    mesh,
    *,
    attention="auto",
    compute_dtype="auto",
    residual: Optional[str] = DOTS_AND_ATTENTION,
    compiler_options: Optional[dict] = None,
):
    """(loss sums, canonical grads) of a packed ``batch`` computed in the layout of ``mesh`` (the
    step's gradients without the update: for tests and research code); ``compiler_options``: XLA's,
    as a :class:`jvarlen.api.Session` takes them."""
    dtype = resolve_compute_dtype(compute_dtype)
    grads_fn = single_program_grads(
        graphdef,
        ulysses_attention_fn(mesh, attention),
        pull=lambda p: pull(p, mesh, dtype),
        push=lambda g, p: push(g, params_sharding, p, mesh),
        fp32_weight_sums=True,
        spmd=TokenShards(mesh),
        residual=checked_residual(residual),
    )

    def run(p, b):
        sums, grads, _ = grads_fn(p, b)
        return sums, grads

    b_sharding = {key: batch_sharding(mesh) for key in batch}
    shardings = dict(in_shardings=(params_sharding, b_sharding), out_shardings=(None, params_sharding))
    return jax.jit(run, **shardings, compiler_options=compiler_options)(params, batch)


def _batch_specs(mesh, bucket: tuple) -> tuple[dict, dict]:
    """(shapes, shardings) of a batch of ``bucket`` (:func:`shape_bucket`): rows over dp, tokens over sp."""
    shapes = {name: jax.ShapeDtypeStruct(shape, np.dtype(dtype_)) for name, shape, dtype_ in bucket}
    return shapes, {name: batch_sharding(mesh) for name in shapes}


def shape_bucket(batch: dict) -> tuple:
    """The static part of a batch: sorted (name, shape, dtype)."""
    return tuple(sorted((k, tuple(np.shape(v)), str(np.asarray(v).dtype)) for k, v in batch.items()))
