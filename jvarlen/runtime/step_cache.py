"""Compiled train steps cached per (layout, padded batch shape bucket).

A layout change or a new shape bucket compiles once (ahead of time, from abstract
inputs); later iterations with the same key reuse the executable. Hits, misses and
compile seconds are counted and logged. The persistent XLA compilation cache (enabled
from ``parallel.compilation_cache_dir``) makes misses cheap across runs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Hashable, Optional

import jax
import numpy as np

from jvarlen.layout import Layout
from jvarlen.runtime.memory_fit import ensure_fits

log = logging.getLogger(__name__)


def enable_persistent_cache(directory: Optional[str]) -> None:
    """Turns on JAX's persistent compilation cache in ``directory`` (no-op for None)."""
    if not directory:
        return
    if jax.config.jax_compilation_cache_dir != str(directory):
        from jax.experimental.compilation_cache import compilation_cache

        # JAX opens its cache once per process; a different directory takes effect only after a reset
        compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def shape_bucket(batch: dict) -> tuple:
    """The static part of a batch: sorted (name, shape, dtype)."""
    return tuple(sorted((k, tuple(np.shape(v)), str(_dtype(v))) for k, v in batch.items()))


def _dtype(x) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


@dataclasses.dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    compile_s: float = 0.0
    last_compile_s: float = 0.0


class StepCache:
    """``get(layout, batch) -> compiled step``; ``build(layout)`` returns the jitted step.

    ``abstract_state`` (ShapeDtypeStructs with shardings) and the bucket's batch shapes are
    what each new entry is lowered and compiled for.
    """

    def __init__(
        self,
        build: Callable[[Layout], Callable],
        abstract_state,
        *,
        batch_sharding: Callable[[Layout], object],
        say: Callable[[str], None] = log.info,
    ):
        self._build = build
        self._abstract_state = abstract_state
        self._batch_sharding = batch_sharding
        self._say = say
        self._compiled: dict[Hashable, Callable] = {}
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._compiled)

    def key(self, layout: Layout, batch: dict) -> tuple:
        return (layout, shape_bucket(batch))

    def get(self, layout: Layout, batch: dict) -> Callable:
        key = self.key(layout, batch)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self.stats.hits += 1
            return compiled
        t0 = time.perf_counter()
        sharding = self._batch_sharding(layout)
        abstract_batch = {k: jax.ShapeDtypeStruct(np.shape(v), _dtype(v), sharding=sharding) for k, v in batch.items()}
        compiled = self._build(layout).lower(self._abstract_state, abstract_batch).compile()
        ensure_fits(compiled)  # issue 17: refuse a step that cannot fit the device, before it runs
        dt = time.perf_counter() - t0
        self._compiled[key] = compiled
        self.stats.misses += 1
        self.stats.compile_s += dt
        self.stats.last_compile_s = dt
        name = "tokens" if "tokens" in batch else next(iter(batch))
        shapes = f"{name}{list(np.shape(batch[name]))}"
        self._say(
            f"[jvarlen] step cache miss: {layout} batch {shapes}: compiled in {dt:.1f} s "
            f"({self.stats.misses} compiled, {self.stats.hits} hits)"
        )
        return compiled
