"""SP groups of one iteration, shared by the FlexSP and DCP policies and the homogeneous reference.

Every group is a ``Scheme(pp=1, sp)`` (Ulysses over ``sp`` devices) that runs its documents as
consecutive micro-batches (gradient accumulation), each micro-batch packing whole documents
into one chunk. :class:`GroupCosts` holds, per scheme, what the searches need from the fitted
cost model (:class:`~jvarlen.plan.strategy.SchemeCosts`, all-to-all per layer included):

* memory: the tokens a micro-batch may hold with ``r`` recomputed layers
  (``caps[s][r]``: model states + :meth:`CostModel.peak_memory` within the budget), hence the
  least recomputation that fits a micro-batch (DCP-intra's Alg. 1 line 5-10 for one (b, p)); the
  longest micro-batch a scheme admits (:meth:`GroupCosts.cap_full`) also has its executor bucket
  within the executor's account at the same ``r`` (:meth:`GroupCosts.fit_caps`,
  :mod:`jvarlen.plan.executor_caps`);
* time: a micro-batch costs ``Σ_docs (T(l, P) - c_P) + c_P + recomputation`` where ``c_P`` is the
  per-micro-batch constant of the cost model (launch overheads, all-to-all latencies): additive
  per document, which is what the assignment searches use (:meth:`work`); the exact time of a
  group (:meth:`group_time`) re-evaluates its actual micro-batches.

:func:`jvarlen.plan.sp_refine.refine_groups` moves documents between groups by that exact time.

:class:`~jvarlen.plan.sp_cuts.GroupCuts` (mixed in) cuts a group into micro-batches and finds its fastest cut.

:class:`~jvarlen.plan.work_table.WorkTable` tabulates the additive model for the searches.

:mod:`jvarlen.plan.sp_assemble` turns the chosen groups into a
:class:`~jvarlen.plan.strategy.StrategyPlan`.

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import bisect
import math
from typing import Optional, Sequence

import numpy as np

from jvarlen.plan.chunk import ChunkShape, executor_bucket
from jvarlen.plan.executor_caps import _SAFETY, admitted_caps, executor_cap, executor_recompute
from jvarlen.plan.memo import MethodCaches, method_cache
from jvarlen.plan.sp_cuts import GroupChoice, GroupCuts
from jvarlen.plan.strategy import Scheme, SchemeCosts, enumerate_schemes


class GroupCosts(GroupCuts, MethodCaches):
    """Per-scheme quantities of SP groups on the run's ``costs.num_devices`` devices.

    ``schemes``: every ``Scheme(1, sp)`` with ``sp`` a power of two dividing the heads, at most
    ``max_sp`` and the device count. ``micro_batch_tokens`` optionally caps a micro-batch's
    tokens below what memory allows (a runtime bucket limit, say). ``max_recompute``: the most
    layers a micro-batch may recompute (0: none, FlexSP's GPT-7B protocol; None: all). ``padded``:
    :meth:`group_time` runs every micro-batch of a group over the executor's bucket of the group's
    largest one, as the paired executor pads them (the ``"paired"`` simulation); False: each over its
    own token bucket (``"ticks"``, ``"async"``). The additive :meth:`work` model is unpadded.
    ``max_parts``: padded, a group's step may run in up to that many parts, each padded to its own
    bucket (docs/design/bucket-parts.md); 1: one bucket per group. ``executor_fit``: the group plans
    are fitted to the executor's memory account (``"ticks"`` and ``"paired"`` simulations, not
    ``"async"``), so a scheme admits a micro-batch only where its executor bucket fits too
    (:meth:`fit_caps`).
    """

    def __init__(
        self,
        costs: SchemeCosts,
        max_sp: Optional[int] = None,
        micro_batch_tokens: Optional[int] = None,
        max_recompute: Optional[int] = None,
        padded: bool = True,
        max_parts: int = 2,
        executor_fit: bool = True,
    ):
        self.costs = costs
        self.executor_fit = bool(executor_fit)
        self.padded = bool(padded)
        if int(max_parts) < 1:
            raise ValueError(f"max_parts must be >= 1, got {max_parts}")
        self.max_parts = int(max_parts)
        self.num_devices = costs.num_devices
        model = costs.model
        self.schemes = enumerate_schemes(
            self.num_devices, model.num_layers, model.num_heads, max_sp=max_sp, pipelines=False
        )
        if not self.schemes:
            raise ValueError(f"no SP scheme on {self.num_devices} devices (max_sp={max_sp})")
        self.layers = model.num_layers
        self.micro_batch_tokens = micro_batch_tokens
        self.max_recompute = self.layers if max_recompute is None else max(0, min(int(max_recompute), self.layers))

    # ---- memory
    @method_cache()
    def caps(self, scheme: Scheme) -> np.ndarray:
        """``[R + 1]`` the most tokens one micro-batch may hold with ``r`` recomputed layers
        (model states + activations + the backward's working memory and the layer gradients the
        executor's backward returns, within the budget), ``R = max_recompute``."""
        cost = self.costs.cost(scheme)
        free = (cost.memory_budget - cost.memory_floor(0)) * _SAFETY
        out = np.zeros(self.max_recompute + 1, dtype=np.int64)
        for r in range(self.max_recompute + 1):
            # stage 0 of a pp = 1 group is its last: the head, not linear in the tokens, is bounded
            out[r] = cost.fitting_tokens(free, cost.chunk_memory_lines(0, r, in_flight=1, tail=True))
        if self.micro_batch_tokens is not None:
            out = np.minimum(out, int(self.micro_batch_tokens))
        out.setflags(write=False)  # memoized: the callers share it
        return out

    def cap_none(self, scheme: Scheme) -> int:
        """Tokens a micro-batch may hold without recomputation."""
        return int(self.caps(scheme)[0])

    @method_cache()
    def fit_caps(self, scheme: Scheme) -> np.ndarray:
        """``[R + 1]`` the longest micro-batch (tokens) that fits with ``r`` recomputed layers in both
        memory accounts: :meth:`caps` (the planner's time line, unpadded tokens) and, where
        :attr:`executor_fit`, the executor's account of a step padded to the micro-batch's bucket
        (:meth:`executor_caps`, same ``r``): a micro-batch within ``caps[r]`` whose bucket exceeds
        ``executor_caps[r]`` at every ``r`` makes a plan that does not fit."""
        out = admitted_caps(self.costs, scheme, self.caps(scheme)) if self.executor_fit else self.caps(scheme)
        out.setflags(write=False)
        return out

    @method_cache()
    def cap_full(self, scheme: Scheme) -> int:
        """The longest micro-batch the scheme admits, with the recomputation that lets it fit both
        memory accounts (:meth:`fit_caps`; the scheme's MaxLen)."""
        return int(self.fit_caps(scheme).max())

    def least_recompute(self, scheme: Scheme, tokens: int) -> Optional[int]:
        """The fewest recomputed layers with which a micro-batch of ``tokens`` fits; None if none does."""
        reach = self._caps_reach(scheme)
        r = bisect.bisect_left(reach, int(tokens))
        return r if r < len(reach) else None

    @method_cache()
    def _caps_reach(self, scheme: Scheme) -> list[int]:
        """:meth:`caps` as their running maximum: the first ``r`` at which it reaches a count is the
        first at which :meth:`caps` does, found by bisection (the searches ask it per micro-batch)."""
        return [int(x) for x in np.maximum.accumulate(self.caps(scheme))]

    def longest_fitting(self) -> tuple[Scheme, int]:
        """The scheme holding the longest micro-batch (full recomputation) and that length."""
        best = max(self.schemes, key=lambda s: (self.cap_full(s), -s.sp))
        return best, self.cap_full(best)

    # ---- time
    @method_cache()
    def doc_time(self, length: int, scheme: Scheme) -> float:
        """Hydraulis T(l, P): forward + backward of a micro-batch holding one document, no recomputation."""
        return self.costs.T(int(length), scheme)

    @method_cache()
    def _quadratic(self, scheme: Scheme) -> Optional[tuple[float, float, float]]:
        """``(a, b, c)`` with ``T(l, P) = a·l² + b·l + c`` when the cost model is exactly quadratic in
        the length for this scheme (no token buckets, per-bucket factors or block-skipping tiles),
        checked at three further lengths; None otherwise. (Sharded stage weights' gathers, exposed
        below some length, make it piecewise: the check at one token catches that.)"""
        probes = np.array([1024.0, 2048.0, 4096.0])
        vals = np.array([self.doc_time(int(x), scheme) for x in probes])
        a, b, c = np.polyfit(probes, vals, 2)
        for x in (1, 3000, 100_003):
            if abs(a * x * x + b * x + c - self.doc_time(x, scheme)) > 1e-9 * self.doc_time(x, scheme):
                return None
        return float(a), float(b), float(c)

    def doc_times(self, lengths: Sequence[int], scheme: Scheme) -> np.ndarray:
        """:meth:`doc_time` of every length (vectorised when the model is quadratic in the length)."""
        x = np.asarray(lengths, dtype=np.float64)
        q = self._quadratic(scheme)
        if q is not None:
            return (q[0] * x + q[1]) * x + q[2]
        return np.array([self.doc_time(int(v), scheme) for v in x], dtype=np.float64)

    def works(self, lengths: Sequence[int], scheme: Scheme) -> np.ndarray:
        """:meth:`work` of every length."""
        x = np.asarray(lengths, dtype=np.int64)
        out = self.doc_times(x, scheme) - self.mb_const(scheme)
        for i in np.flatnonzero(x > min(self.cap_none(scheme), self.cap_full(scheme))):
            out[i] = self.work(int(x[i]), scheme)
        return out

    @method_cache()
    def mb_const(self, scheme: Scheme) -> float:
        """The per-micro-batch constant ``c_P`` (launches, all-to-all latencies): what packing two
        documents into one micro-batch saves over running them separately."""
        a = 256
        return max(0.0, 2 * self.doc_time(a, scheme) - self.costs.micro_batch_time([a, a], scheme))

    @method_cache()
    def rec_const(self, scheme: Scheme) -> float:
        """The per-micro-batch constant of recomputing one layer (what ``c_P`` is to the forward)."""
        a = 256
        one = self.recompute_time(a, scheme, 1)
        two = self.costs.cost(scheme).recompute_time(ChunkShape(0, (a, a)), 1)
        return max(0.0, 2 * one - two)

    @method_cache()
    def base(self, scheme: Scheme) -> float:
        """Seconds a group pays once per iteration (its step overhead: optimizer update and sync)."""
        return float(self.costs.cost(scheme).step_overhead())

    @method_cache()
    def recompute_time(self, length: int, scheme: Scheme, layers: int) -> float:
        return self.costs.cost(scheme).recompute_time(ChunkShape(0, (int(length),)), int(layers))

    def work(self, length: int, scheme: Scheme) -> float:
        """Additive seconds one document adds to a group of ``scheme`` under FlexSP's micro-batching
        (:func:`~jvarlen.plan.chunking.chunk_group`): ``T(l) - c_P`` for a document packed with others;
        a document longer than a micro-batch without recomputation is its own micro-batch and pays
        ``T(l)`` plus its least recomputation; ``inf`` when it does not fit the scheme at all (above
        :meth:`cap_full`)."""
        length = int(length)
        if length > self.cap_full(scheme):
            return math.inf
        if length <= self.cap_none(scheme):
            return self.doc_time(length, scheme) - self.mb_const(scheme)
        r = self.least_recompute(scheme, length)
        if r is None:
            return math.inf
        return self.doc_time(length, scheme) + self.recompute_time(length, scheme, r)

    def micro_batch_time(
        self, lengths: Sequence[int], scheme: Scheme, ckpt: int, pad_to: Optional[int] = None
    ) -> float:
        return self._micro_batch_time(tuple(int(x) for x in lengths), scheme, int(ckpt), pad_to)

    @method_cache(limit=65536)  # the cuts of one planning call share micro-batches
    def _micro_batch_time(self, lengths: tuple, scheme: Scheme, ckpt: int, pad_to: Optional[int]) -> float:
        return self.costs.micro_batch_time(list(lengths), scheme, ckpt, pad_to)

    def group_time(self, lengths: Sequence[int], choice: GroupChoice) -> float:
        """Exact predicted seconds of one group (what its executor plan simulates to for ``pp = 1``):
        its micro-batches one after the other plus its step overhead. Where :attr:`padded`, every
        micro-batch runs over its part's bucket (the group's, without parts) with the
        recomputation the executor's memory fit leaves it there (:meth:`executor_table`)."""
        docs, scheme = choice.documents, choice.scheme
        mbs = [[int(lengths[docs[i]]) for i in mb] for mb in choice.micro_batches]
        if not self.padded:
            return sum(self.micro_batch_time(mb, scheme, r) for mb, r in zip(mbs, choice.ckpt)) + self.base(scheme)
        tokens = [sum(mb) for mb in mbs]
        t = sum(self._part_time(scheme, mbs[a:b], tokens[a:b], choice.ckpt[a:b]) for a, b in choice.part_ranges())
        return t + self.base(scheme)

    def _part_time(self, scheme: Scheme, mbs, tokens, ckpt) -> float:
        """Seconds of one executor step of ``mbs`` padded to the bucket of the largest, with the
        recomputation the executor's fit leaves them (:meth:`executor_table`)."""
        bucket = executor_bucket(max(tokens), scheme.sp)
        table = self.executor_table(scheme, bucket, ckpt)
        return sum(self.micro_batch_time(mb, scheme, r, bucket) for mb, r in zip(mbs, table))

    def strategy_time(self, lengths: Sequence[int], choices: Sequence[GroupChoice]) -> float:
        """Predicted iteration time: the slowest group's (as :func:`predicted_time`)."""
        return max(self.group_time(lengths, c) for c in choices)

    # ---- the executor's buckets
    def executor_caps(self, scheme: Scheme) -> np.ndarray:
        """``[L + 1]`` the largest bucket (tokens) a group's step may pad its micro-batches to when
        every one recomputes ``r`` layers, by the executor's memory account (:func:`executor_cap`)."""
        return np.array([executor_cap(self.costs, scheme, r, r) for r in range(self.layers + 1)], np.int64)

    def bucket_recompute(self, scheme: Scheme, bucket: int) -> Optional[int]:
        """The fewest layers every micro-batch of a step padded to ``bucket`` recomputes so that the
        executor's buffers fit; None if none does."""
        fit = np.flatnonzero(self.executor_caps(scheme) >= int(bucket))
        return int(fit[0]) if fit.size else None

    def executor_table(self, scheme: Scheme, bucket: int, ckpt: Sequence[int]) -> list[int]:
        """The recomputation of a group's micro-batches (``ckpt``, one count each) as the executor's
        memory fit leaves it for a step padded to ``bucket``: unchanged where its buffers hold it,
        else every count raised to at least the least ``t`` with which they do (the fit's repair by
        cap, :func:`~jvarlen.plan.executor_memory.fit_executor`); unchanged where nothing fits."""
        return executor_recompute(self.costs, scheme, bucket, ckpt, self.layers)


def group_costs_for(costs: SchemeCosts, options) -> GroupCosts:
    """The group model of a one-stage policy's options (homogeneous, FlexSP, DCP): their
    ``max_sp``, ``micro_batch_tokens`` and ``max_recompute`` where they have one, padded as the
    executor pads where they simulate ``"paired"``, fitted to the executor's memory account where
    they simulate it (``"ticks"``, ``"paired"``), a step in up to ``bucket_parts`` parts."""
    return GroupCosts(
        costs,
        max_sp=getattr(options, "max_sp", None),
        micro_batch_tokens=options.micro_batch_tokens,
        max_recompute=getattr(options, "max_recompute", None),
        padded=options.simulation == "paired",
        max_parts=options.bucket_parts,
        executor_fit=options.simulation != "async",
    )


def infeasible_documents(lengths: Sequence[int], gc: GroupCosts) -> list[int]:
    """Documents no scheme can hold even with full recomputation (in both memory accounts:
    :meth:`GroupCosts.cap_full`)."""
    _, longest = gc.longest_fitting()
    return [i for i, n in enumerate(lengths) if int(n) > longest]


def too_long_message(policy: str, lengths: Sequence[int], gc: GroupCosts, docs: Sequence[int]) -> str:
    scheme, longest = gc.longest_fitting()
    widest = max(gc.schemes, key=lambda s: s.sp)
    cost = gc.costs.cost(widest)
    if cost.memory_floor(0) > cost.memory_budget:  # not one token: the states alone are too big
        return f"{policy}: {states_message(cost, widest)}"
    padded = ""
    if gc.executor_fit and longest > 0:
        padded = f", padded to the executor's {executor_bucket(longest, scheme.sp)}-token bucket"
        if int(gc.caps(scheme).max()) > longest:
            padded += f" (unpadded, the planner's count alone would allow {int(gc.caps(scheme).max())})"
    return (
        f"{policy}: document(s) {list(docs)[:5]} of {[int(lengths[d]) for d in docs][:5]} tokens do not fit "
        f"any SP group: the longest micro-batch that fits is {longest} tokens on sp={scheme.sp} with "
        f"{gc.max_recompute} of {gc.layers} layers recomputed{padded} (sp <= {max(s.sp for s in gc.schemes)}: a "
        f"power of two dividing the {gc.costs.model.num_heads} heads and the {gc.num_devices} devices)"
    )


def states_message(cost, scheme) -> str:
    """Why a ``pp = 1`` group of ``scheme`` holds no token under ``cost``, and the remedy where one
    exists: its devices hold every layer's weights (and one backward's layer gradients) unless the
    run shards each stage's weights over them (``parallel.stage_weights``)."""
    floor, budget = cost.memory_floor(0), cost.memory_budget
    out = (
        f"no SP group holds a single token: before any activation a device of a {scheme} group needs "
        f"{floor / 1e6:,.1f} MB (the weights' compute copy and gradient accumulator, its share of the fp32 "
        f"master weights and Adam moments, one backward's layer gradients), over the {budget / 1e6:,.1f} MB budget"
    )
    if not cost.stage_weights_sharded:
        need = cost.with_stage_weights(True).memory_floor(0)
        verdict = "which fits" if need < budget else "still over"
        out += (
            f"; with parallel.stage_weights=sharded its {scheme.sp} devices shard the weights: "
            f"{need / 1e6:,.1f} MB, {verdict}"
        )
    return out


__all__ = [
    "GroupChoice",
    "GroupCosts",
    "group_costs_for",
    "infeasible_documents",
    "states_message",
    "too_long_message",
]
