"""How an SP group's documents are cut into micro-batches, and the fastest cut: the part of
:class:`~jvarlen.plan.sp_groups.GroupCosts` that searches cuts (:class:`GroupCuts`, a mixin).

Where a group's step pads its micro-batches (:attr:`GroupCosts.padded`), a cut is tried at every
bucket and packing cap and each in parts (docs/design/bucket-parts.md), every one simulated
micro-batch by micro-batch: the planner's hottest loop. Where the cost model's time never falls
as a micro-batch's bucket or recomputation grows (:meth:`CostModel.grows_with_padding`), each
micro-batch at its own bucket with its cut's recomputation bounds a cut from below, so the search
visits cuts and part splits by that bound and stops where it passes the best found (branch and
bound: the same choice as trying every one, ties included).

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional, Sequence

from jvarlen.plan.chunk import bucket_bins, executor_bucket, executor_bucket_below
from jvarlen.plan.chunking import chunk_group, packed_group
from jvarlen.plan.memo import method_cache
from jvarlen.plan.plan import part_ranges
from jvarlen.plan.strategy import Scheme


@dataclasses.dataclass(frozen=True)
class GroupChoice:
    """One group as a policy chose it: its scheme, its documents (indices into the iteration's
    lengths), its micro-batches (lists of indices into ``documents``, in execution order), the
    layers each micro-batch recomputes, and the step's parts (micro-batch counts of consecutive
    runs, each its own executor step padded to its own bucket, :attr:`Plan.parts`; ``()``: one)."""

    scheme: Scheme
    documents: tuple[int, ...]
    micro_batches: tuple[tuple[int, ...], ...]
    ckpt: tuple[int, ...]
    parts: tuple[int, ...] = ()

    def part_ranges(self) -> list[tuple[int, int]]:
        return part_ranges(self.parts, len(self.micro_batches))


_SLACK = 1e-9  # relative: a bound equal to the best up to rounding is still tried


class GroupCuts:
    """Micro-batch cuts of a group (mixed into :class:`~jvarlen.plan.sp_groups.GroupCosts`, whose
    memory and time queries it uses)."""

    def bucket_caps(self, scheme: Scheme, longest: int) -> list[int]:
        """Micro-batch caps (tokens) worth cutting a padded group at whose longest document holds
        ``longest`` tokens: the bucket that document sets, and for no recomputation, for the least
        the document's bucket needs and for each level at which the executor's cap rises, the
        largest bucket that level holds in both memory accounts (:meth:`executor_caps`,
        :meth:`caps`). Within a level a larger bucket is fewer micro-batches for the same
        recomputation."""
        sp, ex, tl = scheme.sp, self.executor_caps(scheme), self.caps(scheme)
        own = executor_bucket(int(longest), sp)
        levels = {0, self.bucket_recompute(scheme, own) or 0}
        levels.update(r for r in range(1, self.max_recompute + 1) if ex[r] > ex[r - 1])
        out = {min(own, self.cap_full(scheme))}
        for r in sorted(x for x in levels if x <= self.max_recompute):
            b = executor_bucket_below(int(min(ex[r], tl[r])), sp)
            if b is not None and b >= longest:
                out.add(b)
        return sorted(x for x in out if x >= longest)

    def packing_caps(self, scheme: Scheme, shortest: int) -> list[int]:
        """Bin sizes (tokens) worth packing a padded group into whose shortest document holds
        ``shortest`` tokens: every executor bucket from that document's up to :meth:`cap_full`, then
        ``cap_full`` itself (the most any micro-batch may hold), smallest first. A document longer
        than a bin runs alone (:func:`packed_group`), so a small bin packs the short documents into
        small buckets while the long ones run alone: where a small bucket costs less per token
        (the CPU profile under the residual policy: 512 tokens 23 % less than 1,024) that is the
        fastest cut, which bins from the longest document's bucket up never tried."""
        return bucket_bins(shortest, self.cap_full(scheme), scheme.sp)

    # ---- FlexSP / homogeneous micro-batching
    def flex_group(
        self, lengths: Sequence[int], scheme: Scheme, documents: Sequence[int], full_recompute: bool = False
    ) -> GroupChoice:
        """A group of ``documents`` on ``scheme`` cut by Eq. 23-24 into micro-batches that fit without
        recomputation (a longer document alone, with its least recomputation), or where
        :attr:`padded` at the group's bucket if that is faster (:meth:`fastest_cut`).
        ``full_recompute``: every layer recomputed and micro-batches as large as that allows (the
        usual static setting)."""
        docs = tuple(int(d) for d in documents)
        micro_batches, ckpt, parts = self._flex_cut(scheme, tuple(int(lengths[d]) for d in docs), full_recompute)
        return GroupChoice(scheme, docs, micro_batches, ckpt, parts)

    @method_cache(limit=4096)  # FlexSP ranks, then plans, the same groups
    def _flex_cut(self, scheme: Scheme, local: tuple, full_recompute: bool) -> tuple[tuple, tuple, tuple]:
        """:meth:`flex_group`'s micro-batches, recomputation and parts for documents of ``local`` lengths."""
        docs = tuple(range(len(local)))
        if full_recompute:
            c = self._cut(scheme, docs, list(local), chunk_group(local, self.cap_full(scheme)), full_recompute=True)
        else:
            c = self.fastest_cut(local, scheme, docs, chunk_group(local, self.cap_none(scheme)))
        return c.micro_batches, c.ckpt, c.parts

    def fastest_cut(
        self,
        lengths: Sequence[int],
        scheme: Scheme,
        documents: Sequence[int],
        micro_batches,
        min_batches: int = 1,
        max_batches: Optional[int] = None,
        ckpt: Optional[Sequence[int]] = None,
    ) -> GroupChoice:
        """The group of ``documents`` cut into ``micro_batches`` (a policy's cut: lists of indices into
        ``documents``), each recomputing ``ckpt`` layers (the policy's; None: the least that fits
        it), or a faster cut of ``min_batches`` to ``max_batches`` micro-batches.

        Where :attr:`padded`, every micro-batch runs over the bucket of the group's largest and
        recomputes what that bucket needs (:meth:`group_time`): a long document sets both for the
        short ones. So the group is also cut by Eq. 23-24 at each of :meth:`bucket_caps` (the short
        documents packed up to the bucket they pay for anyway) and packed first-fit decreasing into
        bins of each of :meth:`packing_caps` (micro-batches filled to a bucket, the remainder left
        to a smaller one: balanced micro-batches all pay the largest one's bucket); each cut is also
        tried in parts (:attr:`max_parts`, each part its own bucket), and the cut :meth:`group_time`
        finds fastest is kept (ties: the policy's)."""
        docs = tuple(int(d) for d in documents)
        local = [int(lengths[d]) for d in docs]
        cuts = [[list(mb) for mb in micro_batches]]

        def admissible(cut) -> bool:
            count = min(int(min_batches), len(local)) <= len(cut) <= (max_batches or len(local))
            return count and cut not in cuts

        if self.padded:
            for cap in self.bucket_caps(scheme, max(local)):
                cut = chunk_group(local, cap, min_batches)
                if admissible(cut):
                    cuts.append(cut)
            for cap in self.packing_caps(scheme, min(local)):
                cut = packed_group(local, cap)
                if admissible(cut):
                    cuts.append(cut)
                if len(cut) == 1:  # larger bins hold the same single micro-batch
                    break
        first = self._cut(scheme, docs, local, cuts[0], given=ckpt)
        best, best_t, best_i = first, self.group_time(lengths, first), 0
        rest = range(1, len(cuts))
        bound = None
        if self._bounded(scheme):
            base = self.base(scheme)
            bound = {i: base + sum(self._own_times(scheme, [[local[d] for d in mb] for mb in cuts[i]])) for i in rest}
            rest = sorted(rest, key=lambda i: (bound[i], i))
        for i in rest:
            if bound is not None and bound[i] > best_t * (1 + _SLACK):
                break  # this cut and every later one are slower than the best
            c = self._cut(scheme, docs, local, cuts[i])
            t = self.group_time(lengths, c)
            if (t, i) < (best_t, best_i):
                best, best_t, best_i = c, t, i
        return best

    def _bounded(self, scheme: Scheme) -> bool:
        """Whether cuts of ``scheme`` may be bounded from below (padded, time never falling as a
        micro-batch's bucket or recomputation grows: :meth:`CostModel.grows_with_padding`)."""
        return self.padded and self._grows_with_padding(scheme)

    @method_cache()
    def _grows_with_padding(self, scheme: Scheme) -> bool:
        return self.costs.cost(scheme).grows_with_padding()

    def _own_times(
        self, scheme: Scheme, mbs: Sequence[Sequence[int]], ckpt: Optional[Sequence[int]] = None
    ) -> list[float]:
        """Seconds of each micro-batch (its documents' lengths) at its own bucket, with ``ckpt``
        recomputed layers (None: the least that fits it): where :meth:`_bounded`, none runs
        faster in any part of its group's step, whose bucket and recomputation are at least these."""
        out = []
        for j, mb in enumerate(mbs):
            n = sum(mb)
            r = self.least_recompute(scheme, n) if ckpt is None else int(ckpt[j])
            if r is None:  # (does not fit: tried first, so that its cut raises as it would unbounded)
                out.append(-math.inf)
                continue
            out.append(self.micro_batch_time(mb, scheme, r, executor_bucket(n, scheme.sp)))
        return out

    def _cut(
        self, scheme: Scheme, docs: tuple, local: list[int], mbs, full_recompute: bool = False, given=None
    ) -> GroupChoice:
        """``mbs`` as a GroupChoice, each micro-batch recomputing ``given`` layers, or the least that
        fits it, or every layer allowed (``full_recompute``); padded, as the executor's fit leaves
        that at the group's bucket, or in parts where that is faster (:meth:`_in_parts`)."""
        tokens = [sum(local[i] for i in mb) for mb in mbs]
        if given is not None:
            ckpt = [int(r) for r in given]
        else:
            ckpt = []
            for n in tokens:
                r = self.least_recompute(scheme, n)
                if r is None:
                    raise ValueError(f"micro-batch of {n} tokens does not fit {scheme}")
                ckpt.append(self.max_recompute if full_recompute else r)
        whole = GroupChoice(scheme, docs, tuple(tuple(mb) for mb in mbs), tuple(ckpt))
        if not self.padded:
            return whole
        if not full_recompute:
            whole = dataclasses.replace(
                whole, ckpt=tuple(self.executor_table(scheme, executor_bucket(max(tokens), scheme.sp), ckpt))
            )
        if self.max_parts == 1 or len(mbs) == 1:
            return whole
        return self._in_parts(scheme, docs, local, mbs, tokens, ckpt, whole)

    def _in_parts(self, scheme: Scheme, docs: tuple, local, mbs, tokens, ckpt, whole: GroupChoice) -> GroupChoice:
        """``whole``, or the same micro-batches in up to :attr:`max_parts` parts if faster: ordered
        by tokens, largest first, and cut where their bucket changes (a cut inside one bucket only
        moves a micro-batch into a larger bucket), every choice of cuts tried, or where
        :meth:`_bounded` those whose bound (the first part at the group's bucket, the rest each at
        its own) does not pass the best found (ties: the fewest parts, then the earliest cuts)."""
        order = sorted(range(len(mbs)), key=lambda i: (-tokens[i], i))
        buckets = [executor_bucket(tokens[i], scheme.sp) for i in order]
        bounds = [i for i in range(1, len(order)) if buckets[i] != buckets[i - 1]]
        if not bounds:
            return whole
        mbs_o = [[int(local[d]) for d in mbs[i]] for i in order]
        tok_o, ck_o = [tokens[i] for i in order], [int(ckpt[i]) for i in order]
        best, best_t = None, self._part_time(scheme, [[int(local[d]) for d in mb] for mb in mbs], tokens, whole.ckpt)
        splits = [
            (0, *cuts, len(order)) for k in range(1, self.max_parts) for cuts in itertools.combinations(bounds, k)
        ]
        visit = range(len(splits))
        bound = None
        if self._bounded(scheme):
            top = [0.0]  # the first part's micro-batches at the group's bucket, before the fit's raise
            for mb, r in zip(mbs_o, ck_o):
                top.append(top[-1] + self.micro_batch_time(mb, scheme, r, buckets[0]))
            own = self._own_times(scheme, mbs_o, ck_o)
            after = [0.0] * (len(own) + 1)
            for i in range(len(own) - 1, -1, -1):
                after[i] = after[i + 1] + own[i]
            bound = [top[e[1]] + after[e[1]] for e in splits]
            visit = sorted(visit, key=lambda j: (bound[j], j))
        best_j = len(splits)
        for j in visit:
            if bound is not None and bound[j] > best_t * (1 + _SLACK):
                break
            edges = splits[j]
            t = sum(self._part_time(scheme, mbs_o[a:b], tok_o[a:b], ck_o[a:b]) for a, b in zip(edges, edges[1:]))
            if t < best_t or (best is not None and t == best_t and j < best_j):
                best, best_t, best_j = edges, t, j
        if best is None:
            return whole
        table = []
        for a, b in zip(best, best[1:]):
            table += self.executor_table(scheme, executor_bucket(tok_o[a], scheme.sp), ck_o[a:b])
        parts = tuple(b - a for a, b in zip(best, best[1:]))
        return GroupChoice(scheme, docs, tuple(tuple(mbs[i]) for i in order), tuple(table), parts)
