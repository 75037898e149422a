"""Documents moved between the SP groups of one iteration by the exact group model
(:meth:`~jvarlen.plan.sp_groups.GroupCosts.group_time`): FlexSP's fastest candidate and the
homogeneous reference's dispatch (docs/design/heterogeneous.md, "Refining the assignment").

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from jvarlen.plan.sp_groups import GroupChoice, GroupCosts
from jvarlen.plan.strategy import Scheme

Regroup = Callable[[Sequence[int], Scheme, Sequence[int]], GroupChoice]


def refine_groups(
    lengths: Sequence[int],
    gc: GroupCosts,
    choices: Sequence[GroupChoice],
    full_recompute: bool = False,
    max_documents: int = 512,
    max_targets: int = 4,
    regroup: Optional[Regroup] = None,
) -> list[GroupChoice]:
    """``choices`` with documents moved off the slowest group while that makes the iteration faster
    by the exact group model (:meth:`GroupCosts.group_time`, the executor's padding included), each
    group regrouped by ``regroup(lengths, scheme, documents)`` (default: :meth:`GroupCosts.flex_group`
    with ``full_recompute``; a policy with its own cut passes that). Per round every document of the
    slowest group (longest first) is tried in each of the ``max_targets`` fastest other groups whose
    scheme holds it, and the move that gives the fastest iteration is taken; it stops when no move
    makes the iteration faster or once the regrouped groups have held ``max_documents`` documents in
    all (a bound on planning time, which grows with the documents regrouped: ~0.1 ms each). A group
    left without documents is dropped.

    Not in FlexSP: the policies assign documents by an additive model (FlexSP's MILP and greedy,
    LPT) that cannot see which bucket a group's micro-batches pad to, so two assignments equal by
    it can be far apart once padded (docs/design/heterogeneous.md, "Refining the assignment"). Nor in
    DCP, whose groups follow its length buckets (:mod:`jvarlen.plan.dcp`)."""
    groups = [c for c in choices if c.documents]
    if len(groups) < 2:
        return list(groups)
    times = [gc.group_time(lengths, c) for c in groups]
    if regroup is None:
        regroup = lambda lengths, scheme, docs: gc.flex_group(lengths, scheme, docs, full_recompute)  # noqa: E731
    budget = int(max_documents)
    while budget > 0:
        j = max(range(len(groups)), key=lambda i: (times[i], -i))
        top = times[j]
        others = sorted((i for i in range(len(groups)) if i != j), key=lambda i: (times[i], i))
        rest = [times[i] for i in others]
        targets = others[:max_targets]
        best = None  # (iteration time, document, target group, new j, new target)
        for d in sorted(groups[j].documents, key=lambda d: (-int(lengths[d]), d)):
            left = [x for x in groups[j].documents if x != d]
            new_j = regroup(lengths, groups[j].scheme, left) if left else None
            t_j = gc.group_time(lengths, new_j) if new_j is not None else 0.0
            budget -= len(left)
            if t_j >= top:
                continue
            for pos, k in enumerate(targets):
                if budget <= 0:
                    break
                if int(lengths[d]) > gc.cap_full(groups[k].scheme):
                    continue
                new_k = regroup(lengths, groups[k].scheme, (*groups[k].documents, d))
                budget -= len(new_k.documents)
                untouched = max(rest[:pos] + rest[pos + 1 :], default=0.0)
                t = max(t_j, gc.group_time(lengths, new_k), untouched)
                if t < top * (1 - 1e-12) and (best is None or t < best[0]):
                    best = (t, d, k, new_j, new_k)
            if budget <= 0:
                break
        if best is None:
            break
        _, d, k, new_j, new_k = best
        groups[k], times[k] = new_k, gc.group_time(lengths, new_k)
        if new_j is None:
            del groups[j], times[j]
        else:
            groups[j], times[j] = new_j, gc.group_time(lengths, new_j)
    return groups


__all__ = ["refine_groups"]
