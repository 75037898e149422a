"""The one cache of compiled steps: signature -> executable, for every execution strategy.

A strategy turns an iteration into a hashable *signature* (its static shapes: a layout and a
batch bucket, a pipeline signature, a group strategy) and knows how to compile one. The cache
compiles a signature on its first use, or ahead of time in a background thread when the run
loop already knows the next iteration's signature, and counts hits, misses and compile seconds.
The persistent XLA compilation cache (``parallel.compilation_cache_dir``) makes misses cheap
across runs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import Callable, Hashable, Optional

import jax

log = logging.getLogger(__name__)


def enable_persistent_cache(directory: Optional[str]) -> None:
    """Turns on JAX's persistent compilation cache in ``directory`` (no-op for None)."""
    if not directory:
        return
    directory = os.path.expanduser(directory)
    if jax.config.jax_compilation_cache_dir != str(directory):
        from jax.experimental.compilation_cache import compilation_cache

        # JAX opens its cache once per process; a different directory takes effect only after a reset
        compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@dataclasses.dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    compile_s: float = 0.0


class CompileCache:
    """``get(key, compile_fn)`` -> the executable ``compile_fn(key)`` returns, compiled once.

    ``precompile(key, compile_fn)`` compiles in a background thread; a later ``get`` of that key is
    a hit if it is done, else waits for it (a miss: the step did wait). ``compiled_by[key]`` names the thread that
    compiled it. ``say`` reports misses (a hit is the normal case and only counted)."""

    def __init__(self, say: Callable[[str], None] = log.info):
        self.say = say
        self.stats = CacheStats()
        self.compile_seconds: dict = {}
        self.compiled_by: dict = {}
        self._compiled: dict = {}
        self._futures: dict = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-aot")
        self._spans: collections.deque = collections.deque(maxlen=16)  # (start, end or None) of compiles

    def __len__(self) -> int:
        return len(self._compiled)

    def __contains__(self, key) -> bool:
        return key in self._compiled

    def keys(self) -> list:
        """Compiled and pending signatures (what a strategy may reuse for a new iteration)."""
        with self._lock:
            return list(self._compiled) + list(self._futures)

    def compiled_during(self, start: float, end: float) -> bool:
        """Whether a compile ran at some time in ``[start, end]`` (``time.perf_counter()`` readings):
        a step run then shared the host's cores with it (the background compile of the next
        signature), so its time is not the step's alone."""
        with self._lock:
            return any(a <= end and (b is None or b >= start) for a, b in self._spans)

    def _compile(self, key: Hashable, compile_fn: Callable):
        start = time.perf_counter()
        span = [start, None]
        with self._lock:
            self._spans.append(span)
        try:
            compiled = compile_fn(key)
        finally:
            span[1] = time.perf_counter()
        seconds = span[1] - start
        with self._lock:
            self._compiled[key] = compiled
            self.compile_seconds[key] = seconds
            self.compiled_by[key] = threading.current_thread().name
        return compiled, seconds

    def precompile(self, key: Hashable, compile_fn: Callable) -> concurrent.futures.Future:
        """Compiles ``key`` ahead of time in the background (no-op if known or pending)."""
        with self._lock:
            if key in self._compiled:
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result((self._compiled[key], 0.0))
                return done
            if key not in self._futures:
                self._futures[key] = self._pool.submit(self._compile, key, compile_fn)
            return self._futures[key]

    def get(self, key: Hashable, compile_fn: Callable):
        """The executable of ``key``; a key another thread is compiling (ahead of time, or a group
        program inside a background compile) is waited for, never compiled twice."""
        return self.fetch(key, compile_fn)[0]

    def fetch(self, key: Hashable, compile_fn: Callable) -> tuple:
        """:meth:`get`, and the seconds this call spent compiling or waiting for a compile (0 on a
        hit). The cache's counters also count other threads' compiles, a step's time must not."""
        with self._lock:
            compiled, future, owner = self._compiled.get(key), self._futures.get(key), False
            if compiled is not None:
                self._futures.pop(key, None)
            elif future is None:  # this thread compiles; others asking meanwhile wait for it
                future, owner = concurrent.futures.Future(), True
                self._futures[key] = future
        if compiled is not None:  # compiled before, or ahead of time and already done
            self.stats.hits += 1
            return compiled, 0.0
        start = time.perf_counter()
        if owner:
            try:
                result = self._compile(key, compile_fn)
            except BaseException as error:
                future.set_exception(error)
                raise
            finally:
                with self._lock:
                    self._futures.pop(key, None)
            future.set_result(result)
            compiled, how = result[0], "compiled"
        else:
            try:
                compiled, _ = future.result()
            finally:  # a failed compile is not waited for again: the next get retries
                with self._lock:
                    if self._futures.get(key) is future:
                        del self._futures[key]
            how = "waited for the background compile"
        seconds = time.perf_counter() - start
        self.stats.misses += 1
        self.stats.compile_s += seconds
        self.say(
            f"[jvarlen] step cache miss: {describe(key)}: {how} in {seconds:.1f} s "
            f"({self.stats.misses} compiled, {self.stats.hits} hits)"
        )
        return compiled, seconds

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def describe(key) -> str:
    """A short name of a signature for the logs."""
    text = str(key)
    return text if len(text) <= 160 else text[:157] + "..."
