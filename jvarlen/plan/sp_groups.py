"""SP groups of one iteration, shared by the FlexSP and DCP policies and the homogeneous reference.

Every group is a ``Scheme(pp=1, sp)`` (Ulysses over ``sp`` devices) that runs its documents as
consecutive micro-batches (gradient accumulation), each micro-batch packing whole documents
into one chunk. :class:`GroupCosts` holds, per scheme, what the searches need from the fitted
cost model (:class:`~jvarlen.plan.strategy.SchemeCosts`, all-to-all per layer included):

* memory: the tokens a micro-batch may hold with ``r`` recomputed layers
  (``caps[s][r]``: model states + :meth:`CostModel.peak_memory` within the budget), hence the
  least recomputation that fits a micro-batch (DCP-intra's Alg. 1 line 5-10 for one (b, p));
* time: a micro-batch costs ``Σ_docs (T(l, P) - c_P) + c_P + recomputation`` where ``c_P`` is the
  per-micro-batch constant of the cost model (launch overheads, all-to-all latencies): additive
  per document, which is what the assignment searches use (:meth:`work`); the exact time of a
  group (:meth:`group_time`) re-evaluates its actual micro-batches.

:mod:`jvarlen.plan.sp_assemble` turns the chosen groups into a
:class:`~jvarlen.plan.strategy.StrategyPlan`.

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from typing import Optional, Sequence

import numpy as np

from jvarlen.plan.chunk import ChunkShape, executor_bucket
from jvarlen.plan.chunking import chunk_group
from jvarlen.plan.strategy import (
    Scheme,
    SchemeCosts,
    enumerate_schemes,
)

_SAFETY = 1.0 - 1e-9  # float headroom so that a cap computed here also passes Plan.validate


@dataclasses.dataclass(frozen=True)
class GroupChoice:
    """One group as a policy chose it: its scheme, its documents (indices into the iteration's
    lengths), its micro-batches (lists of indices into ``documents``, in execution order) and the
    layers each micro-batch recomputes."""

    scheme: Scheme
    documents: tuple[int, ...]
    micro_batches: tuple[tuple[int, ...], ...]
    ckpt: tuple[int, ...]


class GroupCosts:
    """Per-scheme quantities of SP groups on the run's ``costs.num_devices`` devices.

    ``schemes``: every ``Scheme(1, sp)`` with ``sp`` a power of two dividing the heads, at most
    ``max_sp`` and the device count. ``micro_batch_tokens`` optionally caps a micro-batch's
    tokens below what memory allows (a runtime bucket limit, say). ``max_recompute``: the most
    layers a micro-batch may recompute (0: none, FlexSP's GPT-7B protocol; None: all). ``padded``:
    :meth:`group_time` runs every micro-batch of a group over the executor's bucket of the group's
    largest one, as the paired executor pads them (the ``"paired"`` simulation); False: each over its
    own token bucket (``"ticks"``, ``"async"``). The additive :meth:`work` model is unpadded.
    """

    def __init__(
        self,
        costs: SchemeCosts,
        max_sp: Optional[int] = None,
        micro_batch_tokens: Optional[int] = None,
        max_recompute: Optional[int] = None,
        padded: bool = True,
    ):
        self.costs = costs
        self.padded = bool(padded)
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
    @functools.lru_cache(maxsize=None)  # noqa: B019 (one object per planning call)
    def caps(self, scheme: Scheme) -> np.ndarray:
        """``[R + 1]`` the most tokens one micro-batch may hold with ``r`` recomputed layers
        (model states + activations + the backward's working memory and the layer gradients the
        executor's backward returns, within the budget), ``R = max_recompute``."""
        cost = self.costs.cost(scheme)
        free = (cost.memory_budget - cost.memory_floor(0)) * _SAFETY
        probe = ChunkShape(0, (scheme.sp * 1024,))
        out = np.zeros(self.max_recompute + 1, dtype=np.int64)
        for r in range(self.max_recompute + 1):
            per_token = cost.peak_memory(probe, r, 0) / probe.tokens
            out[r] = 0 if free <= 0 else int(free // per_token)
        if self.micro_batch_tokens is not None:
            out = np.minimum(out, int(self.micro_batch_tokens))
        return out

    def cap_none(self, scheme: Scheme) -> int:
        """Tokens a micro-batch may hold without recomputation."""
        return int(self.caps(scheme)[0])

    def cap_full(self, scheme: Scheme) -> int:
        """Tokens a micro-batch may hold with the most recomputation allowed (the scheme's MaxLen)."""
        return int(self.caps(scheme).max())

    def least_recompute(self, scheme: Scheme, tokens: int) -> Optional[int]:
        """The fewest recomputed layers with which a micro-batch of ``tokens`` fits; None if none does."""
        fit = np.flatnonzero(self.caps(scheme) >= int(tokens))
        return int(fit[0]) if fit.size else None

    def longest_fitting(self) -> tuple[Scheme, int]:
        """The scheme holding the longest micro-batch (full recomputation) and that length."""
        best = max(self.schemes, key=lambda s: (self.cap_full(s), -s.sp))
        return best, self.cap_full(best)

    # ---- time
    @functools.lru_cache(maxsize=None)  # noqa: B019
    def doc_time(self, length: int, scheme: Scheme) -> float:
        """Hydraulis T(l, P): forward + backward of a micro-batch holding one document, no recomputation."""
        return self.costs.T(int(length), scheme)

    @functools.lru_cache(maxsize=None)  # noqa: B019
    def _quadratic(self, scheme: Scheme) -> Optional[tuple[float, float, float]]:
        """``(a, b, c)`` with ``T(l, P) = a·l² + b·l + c`` when the cost model is exactly quadratic in
        the length for this scheme (no token buckets, per-bucket factors or block-skipping tiles),
        checked at two further lengths; None otherwise."""
        probes = np.array([1024.0, 2048.0, 4096.0])
        vals = np.array([self.doc_time(int(x), scheme) for x in probes])
        a, b, c = np.polyfit(probes, vals, 2)
        for x in (3000, 100_003):
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
        for i in np.flatnonzero(x > self.cap_none(scheme)):
            out[i] = self.work(int(x[i]), scheme)
        return out

    @functools.lru_cache(maxsize=None)  # noqa: B019
    def mb_const(self, scheme: Scheme) -> float:
        """The per-micro-batch constant ``c_P`` (launches, all-to-all latencies): what packing two
        documents into one micro-batch saves over running them separately."""
        a = 256
        return max(0.0, 2 * self.doc_time(a, scheme) - self.costs.micro_batch_time([a, a], scheme))

    @functools.lru_cache(maxsize=None)  # noqa: B019
    def rec_const(self, scheme: Scheme) -> float:
        """The per-micro-batch constant of recomputing one layer (what ``c_P`` is to the forward)."""
        a = 256
        one = self.recompute_time(a, scheme, 1)
        two = self.costs.cost(scheme).recompute_time(ChunkShape(0, (a, a)), 1)
        return max(0.0, 2 * one - two)

    @functools.lru_cache(maxsize=None)  # noqa: B019
    def base(self, scheme: Scheme) -> float:
        """Seconds a group pays once per iteration (its step overhead: optimizer update and sync)."""
        return float(self.costs.cost(scheme).step_overhead())

    @functools.lru_cache(maxsize=None)  # noqa: B019
    def recompute_time(self, length: int, scheme: Scheme, layers: int) -> float:
        return self.costs.cost(scheme).recompute_time(ChunkShape(0, (int(length),)), int(layers))

    def work(self, length: int, scheme: Scheme) -> float:
        """Additive seconds one document adds to a group of ``scheme`` under FlexSP's micro-batching
        (:func:`~jvarlen.plan.chunking.chunk_group`): ``T(l) - c_P`` for a document packed with others;
        a document longer than a micro-batch without recomputation is its own micro-batch and pays
        ``T(l)`` plus its least recomputation; ``inf`` when it does not fit the scheme at all."""
        length = int(length)
        if length <= self.cap_none(scheme):
            return self.doc_time(length, scheme) - self.mb_const(scheme)
        r = self.least_recompute(scheme, length)
        if r is None:
            return math.inf
        return self.doc_time(length, scheme) + self.recompute_time(length, scheme, r)

    def micro_batch_time(
        self, lengths: Sequence[int], scheme: Scheme, ckpt: int, pad_to: Optional[int] = None
    ) -> float:
        return self.costs.micro_batch_time([int(x) for x in lengths], scheme, int(ckpt), pad_to)

    def group_time(self, lengths: Sequence[int], choice: GroupChoice) -> float:
        """Exact predicted seconds of one group (what its executor plan simulates to for ``pp = 1``
        where the executor's memory fit raises no recomputation): its micro-batches one after the
        other, padded to the group's bucket where :attr:`padded`, plus its step overhead."""
        docs = choice.documents
        mbs = [[int(lengths[docs[i]]) for i in mb] for mb in choice.micro_batches]
        bucket = executor_bucket(max(sum(mb) for mb in mbs), choice.scheme.sp) if self.padded else None
        t = sum(self.micro_batch_time(mb, choice.scheme, r, bucket) for mb, r in zip(mbs, choice.ckpt))
        return t + self.base(choice.scheme)

    def strategy_time(self, lengths: Sequence[int], choices: Sequence[GroupChoice]) -> float:
        """Predicted iteration time: the slowest group's (as :func:`predicted_time`)."""
        return max(self.group_time(lengths, c) for c in choices)

    # ---- FlexSP / homogeneous micro-batching
    def flex_group(
        self, lengths: Sequence[int], scheme: Scheme, documents: Sequence[int], full_recompute: bool = False
    ) -> GroupChoice:
        """A group of ``documents`` on ``scheme`` cut by Eq. 23-24 into micro-batches that fit without
        recomputation (a longer document alone, with its least recomputation). ``full_recompute``:
        every layer recomputed and micro-batches as large as that allows (the usual static setting)."""
        docs = tuple(int(d) for d in documents)
        local = [int(lengths[d]) for d in docs]
        mbs = chunk_group(local, self.cap_full(scheme) if full_recompute else self.cap_none(scheme))
        ckpt = []
        for mb in mbs:
            tokens = sum(local[i] for i in mb)
            r = self.least_recompute(scheme, tokens)
            if r is None:
                raise ValueError(f"micro-batch of {tokens} tokens does not fit {scheme}")
            ckpt.append(self.max_recompute if full_recompute else r)
        return GroupChoice(scheme, docs, tuple(tuple(mb) for mb in mbs), tuple(ckpt))


@dataclasses.dataclass
class WorkTable:
    """The additive time model of documents on SP groups (what FlexSP's MILP and every greedy search
    price an assignment with). ``[D, S]`` over the documents ``docs`` and the schemes ``schemes``:

    * ``work[i, s]`` seconds document i adds to a group of scheme s (``inf``: does not fit);
    * ``short[i, s]``: it shares micro-batches (counts toward ``ceil(tokens / cap[s])`` micro-batches);
    * ``tokens[i]``, ``cap[s]`` (tokens per micro-batch without recomputation), ``mbc[s]`` (seconds
      per shared micro-batch), ``base[s]`` (seconds per group: step overhead).

    A group of documents A on scheme s takes ``base[s] + Σ_A work + mbc[s]·⌈Σ_{A, short} tokens / cap[s]⌉``.
    """

    docs: tuple[int, ...]
    schemes: tuple[Scheme, ...]
    work: np.ndarray
    short: np.ndarray
    tokens: np.ndarray
    cap: np.ndarray
    mbc: np.ndarray
    base: np.ndarray

    @classmethod
    def build(cls, lengths: Sequence[int], gc: GroupCosts, schemes: Sequence[Scheme], docs=None) -> "WorkTable":
        docs = tuple(range(len(lengths))) if docs is None else tuple(docs)
        tokens = np.array([int(lengths[d]) for d in docs], dtype=np.int64)
        schemes = tuple(schemes)
        work = np.stack([gc.works(tokens, s) for s in schemes], axis=1).reshape(len(docs), len(schemes))
        cap = np.array([gc.cap_none(s) for s in schemes], dtype=np.int64)
        short = tokens[:, None] <= cap[None, :]
        mbc = np.array([gc.mb_const(s) for s in schemes], dtype=np.float64)
        base = np.array([gc.base(s) for s in schemes], dtype=np.float64)
        return cls(docs, schemes, work, short, tokens, cap, mbc, base)

    def load(self, members: Sequence[int], s: int) -> float:
        """Seconds of a group of scheme index ``s`` holding the table rows ``members``."""
        m = np.asarray(members, dtype=np.int64)
        if m.size == 0:
            return 0.0
        short_tokens = int(self.tokens[m][self.short[m, s]].sum())
        return float(self.base[s] + self.work[m, s].sum() + self.mbc[s] * -(-short_tokens // max(1, self.cap[s])))

    def makespan(self, sizes: Sequence[int], members: Sequence[Sequence[int]]) -> float:
        return max((self.load(m, s) for s, m in zip(sizes, members) if len(m)), default=0.0)

    def lpt(self, sizes: Sequence[int], order: Optional[Sequence[int]] = None) -> Optional[list[list[int]]]:
        """Longest-processing-time-first dispatch of every row onto groups of scheme indices ``sizes``:
        rows in decreasing order of their least work, each to the group of the scheme where it
        finishes first, within a scheme the least loaded group (ties: the earlier group). None when a
        row fits none of the groups."""
        sizes = [int(s) for s in sizes]
        members: list[list[int]] = [[] for _ in sizes]
        heaps: dict[int, list] = {}
        for g, s in enumerate(sizes):
            heaps.setdefault(s, []).append((float(self.base[s]), g, 0))
        for h in heaps.values():
            heapq.heapify(h)
        if order is None:
            order = np.argsort(-np.min(self.work, axis=1), kind="stable")
        work, short, tokens = self.work.tolist(), self.short.tolist(), self.tokens.tolist()
        cap = [max(1, int(c)) for c in self.cap]
        mbc = self.mbc.tolist()
        for i in order:
            best = None
            wi, shi, ti = work[i], short[i], tokens[i]
            for s, h in heaps.items():
                load, g, st = h[0]
                add = wi[s]
                if shi[s]:
                    add += mbc[s] * (-(-(st + ti) // cap[s]) - (-(-st // cap[s])))
                cand = (load + add, g)
                if best is None or cand < best[0]:
                    best = (cand, s, st + (ti if shi[s] else 0))
            (new, g), s, st = best
            if not math.isfinite(new):
                return None
            heapq.heapreplace(heaps[s], (new, g, st))
            members[g].append(int(i))
        return members

    def improve(self, sizes: Sequence[int], members: list[list[int]], max_moves: int = 100) -> list[list[int]]:
        """Local search: move one document off the slowest group, or swap it with a document of
        another group, while that lowers the makespan (the best such step first, at most
        ``max_moves`` steps). Loads are kept incrementally; every move and swap of a step is priced
        at once."""
        sizes = np.asarray(sizes, dtype=np.int64)
        g = sizes.shape[0]
        members = [list(m) for m in members]
        group_of = np.full(self.tokens.shape[0], -1, dtype=np.int64)
        for h, m in enumerate(members):
            group_of[m] = h
        sw = np.array([self.work[m, sizes[h]].sum() for h, m in enumerate(members)], dtype=np.float64)
        st = np.array([self.tokens[m][self.short[m, sizes[h]]].sum() for h, m in enumerate(members)], dtype=np.int64)
        caps = np.maximum(1, self.cap[sizes])
        shtok = self.tokens[:, None] * self.short  # [D, S] tokens counted toward micro-batches

        def load(w, t, h):
            return self.base[sizes[h]] + w + self.mbc[sizes[h]] * -(-t // caps[h])

        for _ in range(max_moves):
            count = np.bincount(group_of[group_of >= 0], minlength=g)
            loads = np.where(count > 0, load(sw, st, np.arange(g)), -np.inf)
            crit = int(np.argmax(loads))
            rest = loads.copy()
            rest[crit] = -np.inf
            order = np.argsort(-rest, kind="stable")
            first = rest[order[0]] if g > 1 else -np.inf
            second = rest[order[1]] if g > 2 else -np.inf
            others = np.where(np.arange(g) == order[0], second, first)  # max load apart from crit and h
            sc = sizes[crit]
            mine = np.asarray(members[crit], dtype=np.int64)  # [I]
            w_c = sw[crit] - self.work[mine, sc]  # [I] crit without i
            t_c = st[crit] - shtok[mine, sc]
            new_c = load(w_c, t_c, crit) if mine.size > 1 else np.full(mine.size, -np.inf)
            # moves i -> h: [I, G]
            new_h = load(
                sw[None, :] + self.work[mine][:, sizes], st[None, :] + shtok[mine][:, sizes], np.arange(g)[None, :]
            )
            span = np.maximum(np.maximum(new_h, others[None, :]), new_c[:, None])
            span[:, crit] = np.inf
            flat = int(np.argmin(span))
            best_span = loads[crit] - 1e-12
            best = None
            if span.flat[flat] < best_span:
                best_span, best = span.flat[flat], (int(mine[flat // g]), flat % g, None)
            # swaps i <-> k (k in another group): [I, K]
            ks = np.flatnonzero((group_of >= 0) & (group_of != crit))
            if ks.size:
                hk = group_of[ks]
                szk = sizes[hk]
                new_c2 = load(w_c[:, None] + self.work[ks, sc][None, :], t_c[:, None] + shtok[ks, sc][None, :], crit)
                w_h = (sw[hk] - self.work[ks, szk])[None, :] + self.work[mine][:, szk]
                t_h = (st[hk] - shtok[ks, szk])[None, :] + shtok[mine][:, szk]
                new_h2 = self.base[szk][None, :] + w_h + self.mbc[szk][None, :] * -(-t_h // caps[hk][None, :])
                span2 = np.maximum(np.maximum(new_c2, new_h2), others[hk][None, :])
                flat = int(np.argmin(span2))
                if span2.flat[flat] < best_span:
                    i, j = divmod(flat, ks.size)
                    best_span, best = span2.flat[flat], (int(mine[i]), int(hk[j]), int(ks[j]))
            if best is None:
                break
            i, h, k = best
            for x, src, dst in ((i, crit, h),) + (((k, h, crit),) if k is not None else ()):
                members[src].remove(x)
                members[dst].append(x)
                group_of[x] = dst
                sw[src] -= self.work[x, sizes[src]]
                st[src] -= shtok[x, sizes[src]]
                sw[dst] += self.work[x, sizes[dst]]
                st[dst] += shtok[x, sizes[dst]]
        return members


def infeasible_documents(lengths: Sequence[int], gc: GroupCosts) -> list[int]:
    """Documents no scheme can hold even with full recomputation."""
    _, longest = gc.longest_fitting()
    return [i for i, n in enumerate(lengths) if int(n) > longest]


def too_long_message(policy: str, lengths: Sequence[int], gc: GroupCosts, docs: Sequence[int]) -> str:
    scheme, longest = gc.longest_fitting()
    return (
        f"{policy}: document(s) {list(docs)[:5]} of {[int(lengths[d]) for d in docs][:5]} tokens do not fit "
        f"any SP group: the longest micro-batch that fits is {longest} tokens on sp={scheme.sp} with "
        f"{gc.max_recompute} of {gc.layers} layers recomputed (sp <= {max(s.sp for s in gc.schemes)}: a power of two dividing the "
        f"{gc.costs.model.num_heads} heads and the {gc.num_devices} devices)"
    )


__all__ = [
    "GroupChoice",
    "WorkTable",
    "GroupCosts",
    "infeasible_documents",
    "too_long_message",
]
