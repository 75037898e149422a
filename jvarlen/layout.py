"""How the devices are arranged for one iteration. Pure Python: the planner imports it."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional


@dataclasses.dataclass(frozen=True, order=True)
class Layout:
    """Degrees of data (dp), pipeline (pp) and Ulysses sequence (sp) parallelism.

    The same devices are arranged as a ``(dp, pp, sp)`` mesh; ``sp`` is the fastest
    varying axis so that a sequence-parallel group stays inside a node.
    """

    dp: int = 1
    pp: int = 1
    sp: int = 1

    def __post_init__(self):
        for name in ("dp", "pp", "sp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive int, got {value!r}")

    @property
    def num_devices(self) -> int:
        return self.dp * self.pp * self.sp

    def validate(
        self,
        num_devices: int,
        *,
        num_heads: int | None = None,
        num_layers: int | None = None,
    ) -> None:
        """Raises ValueError naming the violated constraint."""
        if self.num_devices != num_devices:
            raise ValueError(
                f"{self}: dp*pp*sp = {self.num_devices} but there are {num_devices} devices; "
                "choose degrees whose product equals the device count"
            )
        if num_heads is not None and num_heads % self.sp:
            raise ValueError(f"{self}: Ulysses needs num_heads ({num_heads}) divisible by sp ({self.sp})")
        if num_layers is not None and num_layers % self.pp:
            raise ValueError(
                f"{self}: num_layers ({num_layers}) must be divisible by pp ({self.pp}) "
                "so that every stage holds the same number of layers"
            )

    def vocab_shards(self, vocab_size: int, max_sp: Optional[int] = None) -> int:
        """Over how many devices the pipeline executor splits the embedding table and the head by
        vocabulary: a stage's ``sp`` devices where they divide ``vocab_size`` and are at most
        ``max_sp`` (the devices of a node: across nodes the split's collectives cost more time than
        its memory is worth, docs/design/pipeline.md), else 1 (every device holds them whole;
        jvarlen/parallel/pipeline/rest.py)."""
        fits = max_sp is None or self.sp <= max_sp
        return self.sp if self.sp > 1 and vocab_size % self.sp == 0 and fits else 1

    def __str__(self) -> str:
        return f"Layout(dp={self.dp}, pp={self.pp}, sp={self.sp})"


def _auto_stages(config, num_devices: int) -> int:
    """``parallel.pp`` left unset: 2 stages (the elastic pipeline path) when ``num_devices`` splits
    into two stages (times sp and a set dp), the model's layers split in two and no data-parallel
    layout policy (tokens_per_device / sp_cycle) is set; else 1."""
    par = config.parallel
    per_stage = par.sp * (par.dp or 1)
    two = (
        not par.chooses_dp_layouts
        and config.model.num_layers % 2 == 0
        and num_devices % (2 * per_stage) == 0
        and (par.dp is None or num_devices == 2 * per_stage)
    )
    return 2 if two else 1


def requested_devices(config) -> int:
    """The devices a run of ``config`` asks for when it is given exactly what it needs (a CPU host
    gets them as fake devices; the planner CLI plans for them): ``(dp or 1) · pp · sp``, with auto
    ``pp`` resolved for that count; with ``sp_cycle``, ``(dp or 1)`` times the least common multiple
    of its degrees (``tokens_per_device`` chooses among the layouts of the devices there are)."""
    par = config.parallel
    if config.plan.uses_groups:  # device groups over all of the config's devices
        return (par.dp or 1) * (par.pp or 1) * par.sp
    if par.sp_cycle:  # every degree of the cycle divides the devices
        return (par.dp or 1) * math.lcm(*par.sp_cycle)
    pp = par.pp if par.pp is not None else _auto_stages(config, (par.dp or 1) * 2 * par.sp)
    return (par.dp or 1) * pp * par.sp


def resolve_layout(config, num_devices: int | None = None) -> Layout:
    """The run's ``(dp, pp, sp)`` over ``num_devices`` (default :func:`requested_devices`): the one
    place where auto pipeline stages, the default dp and every layout constraint are decided.
    Every entry point (training, the planner CLI, the research API) calls it.

    With a data-parallel layout policy (``parallel.tokens_per_device`` / ``sp_cycle``) this is
    the nominal layout ``(devices / sp, 1, sp)``; the policy picks each step's layout. With a
    strategy policy (``plan.uses_groups``) it is ``(devices, 1, 1)``: the policy arranges them.
    Raises :class:`jvarlen.config.ConfigError` naming the constraint and the fix."""
    from jvarlen.config import ConfigError

    par, model = config.parallel, config.model
    n = requested_devices(config) if num_devices is None else int(num_devices)
    if config.plan.uses_groups:  # a strategy policy plans the devices into groups every iteration
        asked = requested_devices(config)
        if par.dp is not None and asked != n:
            raise ConfigError(
                f"plan.policy={config.plan.policy} plans parallel.dp*pp*sp = {asked} devices, but there are {n}: "
                "set parallel.dp (pp, sp) to cover them, or leave parallel.dp unset for all of them"
            )
        return Layout(dp=n, pp=1, sp=1)
    pp = par.pp if par.pp is not None else _auto_stages(config, n)
    if pp > 1 and par.chooses_dp_layouts:
        raise ConfigError(
            "parallel.tokens_per_device / parallel.sp_cycle choose data-parallel layouts; the pipeline path "
            "(parallel.pp > 1) uses the fixed (dp, pp, sp)"
        )
    if n % (pp * par.sp):
        raise ConfigError(f"parallel.pp*sp = {pp * par.sp} must divide the {n} devices; change parallel.pp or sp")
    dp = par.dp if par.dp is not None and not par.chooses_dp_layouts else n // (pp * par.sp)
    layout = Layout(dp=dp, pp=pp, sp=par.sp)
    if layout.num_devices != n:
        raise ConfigError(
            f"{layout} uses {layout.num_devices} devices, but there are {n}: set parallel.dp to devices / (pp * sp) "
            "or leave it unset"
        )
    if model.num_layers % pp:
        raise ConfigError(f"model.num_layers ({model.num_layers}) must be divisible by parallel.pp ({pp})")
    if model.num_heads % par.sp:
        raise ConfigError(f"parallel: Ulysses needs model.num_heads ({model.num_heads}) divisible by sp ({par.sp})")
    if pp > 1:
        if model.num_kv_heads % par.sp:
            raise ConfigError(
                f"model.num_kv_heads ({model.num_kv_heads}) must be divisible by parallel.sp ({par.sp}) on the "
                "pipeline path"
            )
        if config.data.rows_per_batch % dp:
            raise ConfigError(
                f"data.tokens_per_batch / data.seq_len = {config.data.rows_per_batch} rows must be divisible by "
                f"dp = {dp}: each pipeline plans the documents of its rows"
            )
    return layout
