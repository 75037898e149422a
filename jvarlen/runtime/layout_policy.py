"""Which layout an iteration runs with: a simple policy until the planner provides one.

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

import numpy as np

from jvarlen.config import Config, ConfigError
from jvarlen.layout import Layout


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
        par = config.parallel
        if par.pp is None:  # auto stages, asked for the data-parallel path: one stage
            par = dataclasses.replace(par, pp=1)
        heads = config.model.num_heads
        if par.pp != 1:
            raise ConfigError(f"parallel.pp={par.pp}: pipeline parallelism needs the pipeline executor; use pp=1")
        fixed = None
        if not par.chooses_dp_layouts:
            if num_devices % (par.pp * par.sp):
                raise ConfigError(
                    f"parallel.pp*sp = {par.pp * par.sp} must divide the {num_devices} devices; change parallel.sp"
                )
            fixed = Layout(dp=par.dp or num_devices // (par.pp * par.sp), pp=par.pp, sp=par.sp)
            _validate(fixed, num_devices, heads)
        for sp in par.sp_cycle or ():
            _validate(Layout(dp=max(num_devices // (par.pp * sp), 1), pp=par.pp, sp=sp), num_devices, heads)
        return cls(num_devices, heads, par.pp, fixed, par.tokens_per_device, tuple(par.sp_cycle or ()))

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
        raise ValueError(
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
