"""One training iteration from planner output: Plans + documents -> packed chunks -> cached
compiled pipeline step -> (state, metrics). This is the function the training loop calls.

Signatures are rounded (ticks, slots, context, chunk count) and an already compiled
signature that covers a plan is reused, so most iterations hit the cache; a plan whose
signature is predicted can be compiled ahead of time with :meth:`PipelineRunner.precompile`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from jvarlen.config import ModelConfig
from jvarlen.layout import Layout
from jvarlen.parallel.pipeline import PipelineSignature, prepare_batch
from jvarlen.parallel.pipeline_chunks import pack_chunks
from jvarlen.parallel.pipeline_step import PipelineStepCache
from jvarlen.plan import schedule as sch
from jvarlen.plan.plan import Plan

_GROW = ("n_ticks", "context", "n_stash", "n_grad", "n_ctx", "n_res")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m if x else 0


def round_signature(sig: PipelineSignature) -> PipelineSignature:
    """Coarser signature so that nearby plans share one executable."""
    return dataclasses.replace(
        sig,
        n_ticks=_round_up(sig.n_ticks, 8),
        context=sig.bucket * (1 << max(0, int(np.ceil(np.log2(max(sig.context // sig.bucket, 1))))))
        if sig.context
        else 0,
        n_stash=_round_up(sig.n_stash, 2),
        n_grad=_round_up(sig.n_grad, 2),
        n_ctx=sig.n_ctx,
        n_res=_round_up(sig.n_res, 2 * sig.layers_per_stage),
    )


def covers(big: PipelineSignature, small: PipelineSignature) -> bool:
    same = ("layout", "num_layers", "bucket", "n_chunks")
    return all(getattr(big, f) == getattr(small, f) for f in same) and all(
        getattr(big, f) >= getattr(small, f) for f in _GROW
    )


def split_documents(plan: Plan) -> int:
    """Documents cut into more than one slice by the plan."""
    seen: dict[int, int] = {}
    for chunk in plan.chunks:
        for doc, _, _ in chunk:
            seen[doc] = seen.get(doc, 0) + 1
    return sum(1 for c in seen.values() if c > 1)


def pad_plan(plan: Plan, n_chunks: int, layers_per_stage: int):
    """(chunks, schedule, ckpt) with empty chunks appended up to ``n_chunks`` (they run a GPipe
    tail, carry only padding, recompute everything and contribute nothing)."""
    extra = n_chunks - plan.n_chunks
    if extra < 0:
        raise ValueError(f"plan has {plan.n_chunks} chunks, more than {n_chunks}")
    chunks = [list(c) for c in plan.chunks] + [[] for _ in range(extra)]
    sched, ckpt = plan.schedule, np.asarray(plan.ckpt_layers, np.int32)
    if extra:
        sched = sch.sequential([sched, sch.gpipe(extra, plan.layout.pp)])
        ckpt = np.concatenate([ckpt, np.full((extra, plan.layout.pp), layers_per_stage, np.int32)])
    return chunks, sched, ckpt


@dataclasses.dataclass
class IterationInfo:
    """What the loop logs per iteration next to the loss."""

    signature: PipelineSignature
    cache_hit: bool
    step_seconds: float
    chunks: int
    split_documents: int
    predicted: dict  # planner's simulated iteration_time_s, bubble_ratio, peak_memory_bytes

    def as_dict(self) -> dict:
        return {
            "chunks": self.chunks,
            "split_documents": self.split_documents,
            "bucket": self.signature.bucket,
            "cache_hit": self.cache_hit,
            "step_seconds": self.step_seconds,
            **{f"predicted_{k}": v for k, v in self.predicted.items()},
        }


class PipelineRunner:
    """Runs plans through the executor with one optimizer update per iteration.

    ``state`` (a TrainState; its shardings are kept) is only used as the example for
    compilation. ``bucket`` fixes the chunk token bucket (default: see :meth:`_buckets`).
    """

    def __init__(
        self,
        graphdef,
        cfg: ModelConfig,
        optimizer,
        state,
        *,
        bucket: Optional[int] = None,
        chunk_multiple: int = 2,
        attention_fn=None,
        compiler_options=None,
        residual_policy: Optional[str] = None,
        say: Callable[[str], None] = lambda _: None,
    ):
        self.cfg, self.bucket, self.chunk_multiple, self.say = cfg, bucket, chunk_multiple, say
        self.cache = PipelineStepCache(
            graphdef,
            cfg,
            state,
            optimizer=optimizer,
            attention_fn=attention_fn,
            compiler_options=compiler_options,
            residual_policy=residual_policy,
            say=say,
        )

    def _buckets(self, plans: Sequence[Plan], sp: int) -> list[int]:
        """Token buckets that hold the largest chunk, smallest first: multiples of a quarter
        of the next power of two p (at least 16 tokens, divisible by sp) up to p itself, so
        padding stays under a quarter of p instead of up to half of it."""
        if self.bucket is not None:
            return [self.bucket]
        longest = max(sum(p[2] for p in c) for plan in plans for c in plan.chunks)
        top = max(16, sp, 1 << int(np.ceil(np.log2(max(longest, 1)))))
        step = max(16, top // 4)
        if step % sp:
            return [top]
        return list(range(_round_up(max(longest, 1), step), top + 1, step))

    def prepare(self, plans: Sequence[Plan], documents: Sequence[Sequence[np.ndarray]]):
        """(signature, numpy batch) for one plan per pipeline (``len(plans) == layout.dp``).

        Reuses a compiled signature that covers the plans in any of the candidate buckets
        (the smallest such); otherwise the smallest bucket's rounded signature (compiled
        on first use)."""
        layout: Layout = plans[0].layout
        if any(p.layout != layout for p in plans):
            raise ValueError("all pipelines of one iteration need the same layout")
        ls = self.cfg.num_layers // layout.pp
        n = _round_up(max(p.n_chunks for p in plans), self.chunk_multiple)
        padded = [pad_plan(p, n, ls) for p in plans]
        known_sigs = self.cache.signatures()
        first = None
        for bucket in self._buckets(plans, layout.sp):
            packs = [pack_chunks(chunks, docs, bucket) for (chunks, _, _), docs in zip(padded, documents)]
            args = (packs, [s for _, s, _ in padded], [c for _, _, c in padded], layout, self.cfg.num_layers)
            need, _ = prepare_batch(*args)
            first = first or (args, need)
            known = [s for s in known_sigs if covers(s, need)]
            if known:
                return prepare_batch(*args, signature=min(known, key=lambda s: sum(getattr(s, f) for f in _GROW)))
        args, need = first
        return prepare_batch(*args, signature=round_signature(need))

    def precompile(self, plans: Sequence[Plan], documents):
        """Compiles the signature of predicted plans in the background (returns a Future)."""
        sig, _ = self.prepare(plans, documents)
        return self.cache.precompile(sig)

    def step(self, state, plans: Sequence[Plan], documents):
        """-> (state, metrics, IterationInfo); metrics as ``jvarlen.runtime.step`` plus ``layer_forwards``."""
        sig, batch = self.prepare(plans, documents)
        hit = sig in self.cache
        start = time.perf_counter()
        state, metrics = self.cache(sig, state, batch)
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - start
        predicted = {}
        for key in ("iteration_time_s", "bubble_ratio", "peak_memory_bytes"):
            values = [p.stats[key] for p in plans if key in p.stats]
            if values:
                predicted[key] = max(np.max(v) for v in values) if key != "bubble_ratio" else float(np.mean(values))
        info = IterationInfo(
            sig, hit, seconds, sum(p.n_chunks for p in plans), sum(split_documents(p) for p in plans), predicted
        )
        return state, metrics, info
