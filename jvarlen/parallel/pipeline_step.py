"""Compiled pipeline steps, cached by plan signature; ahead-of-time compiles in the background.

The cache key is the :class:`~jvarlen.parallel.pipeline.PipelineSignature` (layout, bucket,
chunk count, tick count, context bucket, slot counts) — never the tables, so a new
schedule or recomputation table with the same signature reuses the executable.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jvarlen.config import ModelConfig
from jvarlen.parallel.pipeline import DATA, PipelineSignature, make_pipeline_grads, pipeline_mesh
from jvarlen.parallel.pipeline_chunks import CHUNK_KEYS
from jvarlen.runtime.step import apply_gradients

log = logging.getLogger(__name__)


def batch_shapes(sig: PipelineSignature) -> dict:
    """ShapeDtypeStructs of the device inputs ``prepare_batch`` builds for ``sig``."""
    dp, pp, n = sig.layout.dp, sig.layout.pp, sig.n_chunks
    i32 = jnp.int32
    shapes = {key: (dp, n, sig.bucket) for key in CHUNK_KEYS}
    shapes.update(
        ctx_len=(dp, n),
        has_next=(dp, n),
        ops=(dp, sig.n_ticks, pp, 2),
        stash_slot=(dp, n, pp),
        grad_slot=(dp, n, pp),
        ctx_slot=(dp, n, pp),
        res_slot=(dp, n, pp, sig.layers_per_stage),
        recv_act=(dp, sig.n_ticks, pp),
        recv_grad=(dp, sig.n_ticks, pp),
    )
    return {key: jax.ShapeDtypeStruct(shape, i32) for key, shape in shapes.items()}


def make_pipeline_train_step(
    graphdef, cfg: ModelConfig, sig: PipelineSignature, mesh, optimizer, attention_fn=None, residual_policy=None
):
    """``train_step(state, batch) -> (state, metrics)``: grads of one plan accumulated over its
    chunks and pipelines, applied once. Metrics: loss_sum, target_tokens, real_tokens,
    grad_norm and ``layer_forwards [dp, pp]`` (forwards + recomputations per stage)."""
    grads_fn = make_pipeline_grads(graphdef, cfg, sig, mesh, attention_fn, residual_policy)

    def train_step(state, batch):
        sums, grads, count = grads_fn(state.params, batch)
        state, metrics = apply_gradients(optimizer, state, grads, sums, batch["segment_ids"])
        return state, {**metrics, "layer_forwards": count}

    return train_step


class PipelineStepCache:
    """signature -> compiled step. ``optimizer=None``: steps are ``grads(params, batch) ->
    (sums, grads, layer_forwards)``; else ``train_step(state, batch) -> (state, metrics)``.

    ``example`` is the (abstract or concrete) params, or the TrainState with an optimizer.
    """

    def __init__(
        self,
        graphdef,
        cfg: ModelConfig,
        example,
        *,
        optimizer=None,
        attention_fn=None,
        mesh_for: Optional[Callable] = None,
        say: Callable[[str], None] = log.info,
        compiler_options: Optional[dict] = None,
        residual_policy: Optional[str] = None,
    ):
        self.graphdef, self.cfg, self.optimizer, self.attention_fn = graphdef, cfg, optimizer, attention_fn
        self.example = jax.tree.map(_abstract, example)
        self.mesh_for = mesh_for or pipeline_mesh
        self.say = say
        self.residual_policy = residual_policy
        self.compiler_options = compiler_options  # e.g. {"xla_backend_optimization_level": 0} in tests
        self.hits = self.misses = 0
        self.compile_seconds: dict = {}
        self.compiled_by: dict = {}  # signature -> name of the thread that compiled it
        self._compiled: dict = {}
        self._futures: dict = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipeline-aot")

    def __len__(self) -> int:
        return len(self._compiled)

    def signatures(self) -> list:
        with self._lock:
            return list(self._compiled) + list(self._futures)

    def __contains__(self, sig) -> bool:
        return sig in self._compiled

    def _compile(self, sig: PipelineSignature):
        start = time.perf_counter()
        mesh = self.mesh_for(sig.layout)
        batch = {
            k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P(DATA)))
            for k, s in batch_shapes(sig).items()
        }
        if self.optimizer is None:
            fn = jax.jit(
                make_pipeline_grads(self.graphdef, self.cfg, sig, mesh, self.attention_fn, self.residual_policy)
            )
            compiled = fn.lower(self.example, batch).compile(compiler_options=self.compiler_options)
        else:
            step = make_pipeline_train_step(
                self.graphdef, self.cfg, sig, mesh, self.optimizer, self.attention_fn, self.residual_policy
            )
            # a state placed on a mesh (the loop's canonical sharding) keeps that sharding
            shardings = jax.tree.map(lambda a: a.sharding, self.example)
            leaves = jax.tree.leaves(shardings, is_leaf=_none)
            kw = {}
            if leaves and all(s is not None for s in leaves):
                metrics = NamedSharding(leaves[0].mesh, P())
                kw["out_shardings"] = (shardings, metrics)
            lowered = jax.jit(step, donate_argnums=0, **kw).lower(self.example, batch)
            compiled = lowered.compile(compiler_options=self.compiler_options)
        seconds = time.perf_counter() - start
        with self._lock:
            self._compiled[sig] = compiled
            self.compile_seconds[sig] = seconds
            self.compiled_by[sig] = threading.current_thread().name
        self.say(f"[pipeline] compiled {sig} in {seconds:.2f}s")
        return compiled

    def precompile(self, sig: PipelineSignature) -> concurrent.futures.Future:
        """Compiles ``sig`` ahead of time in a background thread (no-op if known or pending)."""
        with self._lock:
            if sig in self._compiled or sig in self._futures:
                return self._futures.get(sig) or _done(self._compiled[sig])
            fut = self._pool.submit(self._compile, sig)
            self._futures[sig] = fut
            return fut

    def get(self, sig: PipelineSignature):
        with self._lock:
            compiled, fut = self._compiled.get(sig), self._futures.pop(sig, None)
        if compiled is not None:
            self.hits += 1  # counted, not printed: a hit is the normal case of every step
            return compiled
        self.misses += 1
        if fut is not None:
            self.say("[pipeline] step cache miss: waiting for the background compile")
            return fut.result()
        self.say("[pipeline] step cache miss: compiling")
        return self._compile(sig)

    def __call__(self, sig: PipelineSignature, first, batch: dict):
        """Runs the step for ``sig`` on (params or state, numpy batch from ``prepare_batch``)."""
        compiled = self.get(sig)
        (first_sharding, batch_sharding), _ = compiled.input_shardings
        first = jax.device_put(first, first_sharding)
        batch = {k: jax.device_put(np.asarray(v), batch_sharding[k]) for k, v in batch.items()}
        return compiled(first, batch)


def _abstract(a) -> jax.ShapeDtypeStruct:
    sharding = getattr(a, "sharding", None)
    keep = sharding if isinstance(sharding, NamedSharding) else None
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a), sharding=keep)


def _none(x) -> bool:
    return x is None


def _done(value) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(value)
    return fut
