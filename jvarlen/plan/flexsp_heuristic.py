"""FlexSP's greedy groups (the MILP's hint and fallback) and the one-degree layouts planned beside
them (:mod:`jvarlen.plan.flexsp`): LPT dispatch of the documents onto a multiset of SP groups, in
the group model's additive times (:class:`~jvarlen.plan.work_table.WorkTable`). ``problem`` is a
:class:`~jvarlen.plan.flexsp.FlexSPProblem` (not imported: that module imports this one).

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import math
from typing import Sequence


def _sizes_of(counts: Sequence[int]) -> list[int]:
    """Scheme indices of the groups of a multiset, largest first."""
    return [s for s in range(len(counts) - 1, -1, -1) for _ in range(counts[s])]


def _dispatch(problem, counts: Sequence[int]):
    sizes = _sizes_of(counts)
    members = problem.table.lpt(sizes)
    if members is None:
        return math.inf, sizes, None
    return problem.table.makespan(sizes, members), sizes, members


def _homogeneous(problem):
    """(scheme index, counts) of every one-degree multiset: ``N / sp`` groups (at most one per document)."""
    for s, degree in enumerate(problem.sp):
        counts = [0] * len(problem.sp)
        counts[s] = max(1, min(problem.num_devices // int(degree), problem.n_docs))
        yield s, counts


def heuristic(problem, patience: int = 6, local_search: bool = True) -> list[tuple[int, list[int]]]:
    """Greedy groups ``[(scheme index, rows)]``: the best LPT dispatch over the homogeneous multisets
    and the multisets met while splitting groups top-down, then local search. Raises ValueError
    when no multiset holds every document."""
    n, sp, d = problem.num_devices, problem.sp, problem.n_docs
    seen: dict[tuple, tuple] = {}

    def evaluate(counts):
        key = tuple(counts)
        if key not in seen:
            seen[key] = _dispatch(problem, counts)
        return seen[key][0]

    for _, counts in _homogeneous(problem):
        evaluate(counts)
    counts, left = [0] * len(sp), n  # all devices in the largest groups
    for s in range(len(sp) - 1, -1, -1):
        counts[s], left = left // int(sp[s]), left % int(sp[s])
    current, best, stall = counts, evaluate(counts), 0
    while stall <= patience:
        options = []
        for s in range(len(sp) - 1, 0, -1):
            if current[s] and sum(current) + 1 <= d and int(sp[s - 1]) * 2 == int(sp[s]):
                nxt = list(current)
                nxt[s] -= 1
                nxt[s - 1] += 2
                options.append((evaluate(nxt), -s, nxt))
        if not options:
            break
        value, _, current = min(options)
        stall = 0 if value < best else stall + 1
        best = min(best, value)
    value, key = min((v[0], k) for k, v in seen.items())
    if not math.isfinite(value):
        raise ValueError("no multiset of SP groups holds every document")
    _, sizes, members = seen[key]
    if local_search:
        members = problem.table.improve(sizes, members)
    return [(s, list(m)) for s, m in zip(sizes, members) if m]


def homogeneous_finalists(problem, top: int, local_search: bool = True, rank=None) -> dict[str, list]:
    """The ``top`` one-degree layouts (``N / sp`` groups) whose LPT dispatch is fastest, as groups
    ``[(scheme index, rows)]`` named ``"sp=<degree>"``. ``rank``: a function of such groups giving
    the time they are ranked by (the exact group model, padding included); None: the additive
    makespan of the dispatch."""

    def improved(sizes, members):
        return problem.table.improve(sizes, members) if local_search else members

    layouts = []  # (time it is ranked by, scheme index, group sizes, members)
    for s, counts in _homogeneous(problem):
        value, sizes, members = _dispatch(problem, counts)
        if not math.isfinite(value):
            continue
        if rank is not None:  # the exact model ranks the dispatch as it will be planned (improved)
            members = improved(sizes, members)
            value = rank([(g, list(m)) for g, m in zip(sizes, members) if m])
        layouts.append((value, s, sizes, members))
    out = {}
    for _, s, sizes, members in sorted(layouts, key=lambda x: (x[0], x[1]))[:top]:
        members = members if rank is not None else improved(sizes, members)
        out[f"sp={int(problem.sp[s])}"] = [(g, list(m)) for g, m in zip(sizes, members) if m]
    return out


__all__ = ["heuristic", "homogeneous_finalists"]
