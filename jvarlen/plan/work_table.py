"""The additive time model of documents on SP groups, as a table the assignment searches price with
(FlexSP's MILP and heuristic, the homogeneous reference's LPT dispatch): per document and scheme
the seconds it adds to a group (:meth:`jvarlen.plan.sp_groups.GroupCosts.work`), plus a constant
per shared micro-batch and per group.

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Optional, Sequence

import numpy as np

from jvarlen.plan.sp_groups import GroupCosts
from jvarlen.plan.strategy import Scheme


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


__all__ = ["WorkTable"]
