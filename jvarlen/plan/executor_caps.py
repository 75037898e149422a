"""The executor's memory account as a cap on a group's bucket: the largest bucket a group's step
may pad its micro-batches to at a recomputation (:func:`executor_cap`), and the longest
micro-batch a scheme admits in both the planner's count and that account (:func:`admitted_caps`).
Used by the SP-group policies (:class:`~jvarlen.plan.sp_groups.GroupCosts`) and Hydraulis' MaxLen
(:mod:`jvarlen.plan.hydraulis_costs`).

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import functools

import numpy as np

from jvarlen.plan.chunk import executor_bucket, executor_bucket_below
from jvarlen.plan.executor_memory import executor_account
from jvarlen.plan.strategy import Scheme, SchemeCosts, build_group_plan

_SAFETY = 1.0 - 1e-9  # float headroom so that a cap computed here also passes Plan.validate


def _probe_count(scheme: Scheme) -> int:
    """Micro-batches of a probe plan: 1F1B holds ``pp`` in flight on the first stage, and more add
    no executor slot (checked for pp = 2 and 4 up to 3·pp micro-batches); two for ``pp = 1``."""
    return max(2, scheme.pp)


@functools.lru_cache(maxsize=64)  # per run (the SchemeCosts of a run is not changed in place)
def _probe_accounts(costs: SchemeCosts, scheme: Scheme) -> tuple:
    """Two group plans of :func:`_probe_count` micro-batches of one document each, padded to two
    probe buckets, and their executor's accounts (functions of a recomputation table)."""
    cost = costs.cost(scheme)
    m = _probe_count(scheme)
    out = []
    for b in (4096 * scheme.sp, 8192 * scheme.sp):
        plan = build_group_plan("probe", scheme, [b] * m, [[i] for i in range(m)], costs, [0] * m, simulation="async")
        out.append((b, executor_account(plan, cost)))
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def executor_cap(costs: SchemeCosts, scheme: Scheme, low: int, high: int) -> int:
    """The largest bucket (tokens) a group's step may pad its micro-batches to when they recompute
    between ``low`` and ``high`` layers per stage (both counts present), by the executor's memory
    account (:func:`~jvarlen.plan.executor_memory.executor_memory`). One stage runs one micro-batch
    at a time, so for ``pp = 1`` the slots follow the extremes (the residual slots the micro-batch
    that stores most, the checkpoint slots the one that recomputes most); for ``pp > 1`` the probe's
    first micro-batch recomputes ``low`` and the others ``high`` (exact for ``low == high``, as
    Hydraulis' MaxLen asks). With no split document the account is affine in the bucket: two
    probe buckets give it."""
    (b1, m1), (b2, m2) = _probe_accounts(costs, scheme)
    table = np.full((_probe_count(scheme), scheme.pp), high, np.int32)
    table[0, :] = low
    t1, t2 = m1(table).total, m2(table).total
    slope = (t2 - t1) / (b2 - b1)
    budget = costs.cost(scheme).memory_budget * _SAFETY
    if slope <= 0:  # (no term grows with the bucket: any bucket fits or none does)
        return 1 << 62 if t1 <= budget else 0
    return max(0, int((budget - (t1 - slope * b1)) // slope))


def executor_recompute(costs: SchemeCosts, scheme: Scheme, bucket: int, ckpt, layers: int) -> list[int]:
    """The recomputation of a group's micro-batches (``ckpt``, one count each, at most ``layers``)
    as the executor's memory fit leaves it for a step padded to ``bucket``: unchanged where its
    buffers hold it, else every count raised to at least the least ``t`` with which they do (the
    fit's repair by cap, :func:`~jvarlen.plan.executor_memory.fit_executor`); unchanged where
    nothing fits."""
    low, high = min(ckpt), max(ckpt)
    for t in range(low, int(layers) + 1):
        if executor_cap(costs, scheme, max(low, t), max(high, t)) >= bucket:
            return [max(int(r), t) for r in ckpt]
    return [int(r) for r in ckpt]


def bucket_fit(tokens: int, cap: int, sp: int) -> int:
    """The longest micro-batch of at most ``tokens`` tokens whose executor bucket
    (:func:`~jvarlen.plan.chunk.executor_bucket`) is at most ``cap`` tokens (0: none). The bucket
    grows with the tokens, so that is ``tokens`` itself or the largest bucket within ``cap``."""
    tokens, cap = int(tokens), int(cap)
    if tokens <= 0 or cap <= 0:
        return 0
    if executor_bucket(tokens, sp) <= cap:
        return tokens
    return min(tokens, executor_bucket_below(cap, sp) or 0)  # (cap < that bucket: bounded)


def admitted_caps(costs: SchemeCosts, scheme: Scheme, caps) -> np.ndarray:
    """``[R + 1]`` per recomputation level ``r`` (layers per stage): the longest micro-batch within
    ``caps[r]`` (the planner's count of its tokens) whose executor bucket fits the executor's
    account at the same ``r`` (:func:`executor_cap`, :func:`bucket_fit`)."""
    return np.array(
        [bucket_fit(int(n), executor_cap(costs, scheme, r, r), scheme.sp) for r, n in enumerate(caps)], np.int64
    )


__all__ = ["admitted_caps", "bucket_fit", "executor_cap", "executor_recompute"]
