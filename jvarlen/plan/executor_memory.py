"""What the pipeline executor's compiled step holds per device for a plan (numpy only).

The simulator's memory (Eq. 6-10) is a time line: each chunk's activations from its forward to
its backward, summed where they overlap. The executor is one static program: every buffer kind
is a fixed number of slots (or pool rows) sized by that kind's own peak over the step
(:func:`jvarlen.plan.buffers.assign_slots`), rounded like the compiled signature
(:func:`jvarlen.plan.buffers.round_buffers`), and allocated for the whole step, plus what one op
holds while it runs. Where the kinds peak at different times, the program holds more than the
time line's peak. :func:`executor_memory` is that account, term by term:

- ``stash``, ``grad``: ``(slots + 1) · T/sp · d · e`` (a dummy slot each);
- ``context``: ``4 · L/pp · rows · K' · D · e``, the K, V, dK and dV pools (``K'``: kv heads per
  device after the Ulysses all-to-all);
- ``residuals``: ``slots · T/sp · m_stored``, one slot per stored layer of a chunk;
- ``checkpoints``: ``slots · T/sp · d · e``, a recomputed layer's input (layers 1.. of them);
- ``op``: the largest op's transients: a backward's working memory and layer gradients
  (:meth:`CostModel.backward_memory` at the bucket, recomputing where the plan does), its stacked
  context dK/dV ``2 · L/pp · Sc · K' · D · e``, and where the program holds the fused op, the
  stack of one chunk's residuals over the stage's layers ``L/pp · T/sp · m_stored``;
- ``states``: :meth:`CostModel.model_state_memory` of the largest stage.

``m_stored`` is what the executor keeps per token and stored layer under its residual policy
(``CostCoefficients.m_stored_token``; the profile's ``m_token`` where it is 0).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Optional

import numpy as np

from jvarlen.plan.buffers import SLOT_COUNTS, kept_apart, plan_ticks, round_buffers, slot_counts
from jvarlen.plan.chunk import ChunkShape, executor_buckets, executor_context
from jvarlen.plan.simulator import simulate


@dataclasses.dataclass(frozen=True)
class ExecutorMemory:
    """Bytes per device, by term (see the module docstring), the sizes they come from, and where
    each slot kind peaks (``SlotTables.peaks``: kind -> (stage, tick, holders))."""

    terms: dict
    sizes: dict
    peaks: dict = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> float:
        return float(sum(self.terms.values()))

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in self.terms.items() if v)
        return f"{self.total / 1e6:.1f} MB ({parts})"


def executor_memory(
    plan,
    cost,
    stored_bytes: Optional[float] = None,
    fuse: bool = True,
    ticks: Optional[np.ndarray] = None,
    memo: Optional[dict] = None,
    shapes: Optional[list[ChunkShape]] = None,
) -> ExecutorMemory:
    """The executor's account of ``plan`` (a :class:`jvarlen.plan.plan.Plan`) on ``cost``'s layout,
    as the compiled signature of the plan alone sizes it (a step that reuses a bigger compiled
    signature holds that one's buffers). ``stored_bytes``: per token and stored layer, overrides
    the coefficients'. ``ticks``: the plan's paired tick table (:func:`plan_ticks`), where the
    caller has it; ``memo``: :func:`jvarlen.plan.buffers.slot_counts`', kept by a caller that
    measures one plan under several recomputation tables, and the plan's ``chunk_shapes()``."""
    layout, model, c = cost.layout, cost.model, cost.coeffs
    sp, ls, e = layout.sp, cost.layers_per_stage, c.bytes_per_element
    shapes = plan.chunk_shapes() if shapes is None else shapes
    ckpt = np.asarray(plan.ckpt_layers, np.int32)
    bucket = executor_buckets(max(s.tokens for s in shapes), sp)[0]
    if ticks is None:
        ticks = plan_ticks(plan.schedule, ckpt, fuse)
    slots = slot_counts(
        ticks,
        plan.schedule.chunk_prev,
        ckpt,
        ls,
        uses_context=[s.context > 0 or not s.tail for s in shapes],
        ctx_need=[s.context + (0 if s.tail else s.slices[0]) for s in shapes],
        memo=memo,
    )
    sizes = {name: getattr(slots, name) for name in SLOT_COUNTS + ("fused",)}
    sizes["context"] = executor_context(shapes, bucket)
    rounded = round_buffers(types.SimpleNamespace(**sizes), bucket, ls)
    tl = bucket / sp
    stored = stored_bytes if stored_bytes is not None else (c.m_stored_token or c.m_token)
    kv_heads = model.num_kv_heads * (sp // math.gcd(model.num_kv_heads, sp)) // sp  # after the all-to-all
    kv_row = kv_heads * model.head_dim * e  # one layer's K (or V) of one token, per device
    sc = rounded["context"]
    recomputes = bool((ckpt > 0).any())
    work = cost.backward_memory(ChunkShape(sc, (bucket,), tail=True), ls if recomputes else 0)
    op = work + (2 * ls * sc * kv_row if sc else 0) + (ls * tl * stored if rounded["fused"] else 0)
    terms = dict(
        states=max(cost.model_state_memory(p) for p in range(layout.pp)),
        stash=(rounded["n_stash"] + 1) * tl * model.d_model * e,
        grad=(rounded["n_grad"] + 1) * tl * model.d_model * e,
        context=4 * ls * rounded["ctx_rows"] * kv_row if sc else 0.0,
        residuals=rounded["n_res"] * tl * stored,
        checkpoints=rounded["n_ckpt"] * tl * model.d_model * e,
        op=op,
    )
    return ExecutorMemory({k: float(v) for k, v in terms.items()}, dict(rounded, bucket=bucket), slots.peaks)


def fit_executor(plan, cost, stored_bytes: Optional[float] = None, fuse: bool = True, mode: str = "paired"):
    """Recomputation table under which the executor's account of ``plan`` fits ``cost``'s budget,
    raised from the plan's own: of two repairs that fit, the one whose plan the simulator
    (``mode``, :func:`jvarlen.plan.simulator.simulate`) finds faster:

    - *by chunk*: while the account is over and some layer is stored, a chunk that holds stored
      layers where the residual slots peak (the one with the fewest tokens: its recomputation is
      the cheapest) recomputes every layer of that stage; with no residual slot left, a chunk the
      last stage fuses does (the fused op's stack goes with the last of them);
    - *by cap*: every chunk stores at most ``c`` layers of each stage, the largest ``c`` that fits
      (binary search). Every chunk then recomputes a little instead of a few chunks everything, and
      with ``c < L/pp`` no chunk is fused, so the program holds no stack of a chunk's ``L/pp``
      layers' residuals: where that stack is most of the account (pp = 1 groups), only this
      repair lets chunks keep stored layers.

    -> (ckpt ``[n, pp]``, :class:`ExecutorMemory`, (chunk, stage) pairs raised). With neither
    fitting, the by-chunk table: the account may be over even when everything is recomputed."""
    ckpt = np.array(plan.ckpt_layers, np.int32)
    account = executor_memory(plan, cost, stored_bytes, fuse)
    if account.total <= cost.memory_budget:
        return ckpt, account, []
    shapes = plan.chunk_shapes()

    tick_tables = {}  # the tick table changes only with the chunks kept apart on the last stage

    def measure(table):
        key = kept_apart(table).tobytes()
        if key not in tick_tables:
            tick_tables[key] = plan_ticks(plan.schedule, table, fuse), {}
        ticks, memo = tick_tables[key]
        return executor_memory(
            dataclasses.replace(plan, ckpt_layers=table), cost, stored_bytes, fuse, ticks, memo, shapes
        )

    def iteration_time(table):
        return simulate(plan.schedule, shapes, table, cost, mode, validate=False, timeline=False).iteration_time

    repairs = [_repair_by_chunk(ckpt, account, shapes, cost.layers_per_stage, cost.memory_budget, measure)]
    capped = _repair_by_cap(ckpt, cost.layers_per_stage, cost.memory_budget, measure)
    if capped is not None:
        repairs.append(capped)
    fitting = [r for r in repairs if r[1].total <= cost.memory_budget]
    table, account = min(fitting, key=lambda r: iteration_time(r[0])) if len(fitting) > 1 else (fitting or repairs)[0]
    return table, account, [(int(k), int(p)) for k, p in zip(*np.nonzero(table != ckpt))]


def _repair_by_chunk(ckpt, account, shapes, ls: int, budget: float, measure):
    """The by-chunk repair of :func:`fit_executor` -> (ckpt, account)."""
    ckpt = ckpt.copy()
    while account.total > budget:
        pick = _next_to_recompute(account, ckpt, shapes, ls)
        if pick is None:
            break
        ckpt[pick] = ls
        account = measure(ckpt.copy())
    return ckpt, account


def _repair_by_cap(ckpt, ls: int, budget: float, measure):
    """The by-cap repair of :func:`fit_executor` -> (ckpt, account), or None where even storing
    nothing does not fit. The account falls as the cap does (fewer residual slots, then no fused
    op) but for the checkpoint slots' few bytes, so the search may stop below the largest cap."""
    stored = ls - int(ckpt.min())
    lo, hi = 0, stored - 1  # caps below what the plan stores anywhere
    best = None
    while lo <= hi:
        cap = (lo + hi) // 2
        table = np.maximum(ckpt, ls - cap).astype(np.int32)
        account = measure(table)
        if account.total <= budget:
            best, lo = (table, account), cap + 1
        else:
            hi = cap - 1
    return best


def _next_to_recompute(account: ExecutorMemory, ckpt, shapes, ls: int):
    """(chunk, stage) whose full recomputation can lower ``account`` next, or None."""
    pp = ckpt.shape[1]
    if account.sizes["n_res"]:
        stage, _, holders = account.peaks["res"]
        chunks = sorted({k for k, _ in holders})
        return min(((k, stage) for k in chunks), key=lambda kp: (shapes[kp[0]].tokens, kp[0]))
    fused = [k for k in range(len(shapes)) if ckpt[k, pp - 1] < ls]
    if account.sizes["fused"] and fused:
        return min(((k, pp - 1) for k in fused), key=lambda kp: (shapes[kp[0]].tokens, kp[0]))
    return None
