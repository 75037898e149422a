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
  context dK/dV ``2 · L/pp · Sc · K' · D · e``; where the program holds the fused op, the larger
  of that and the fused op's: a backward that rebuilds no layer, the stacked dK/dV and the stack
  of one chunk's residuals over the stage's layers ``L/pp · T/sp · m_stored``. Where the step's
  descents add each layer's gradients as they go (a GPU step with whole stage weights,
  ``StageProgram.per_layer``), one layer's gradients and dK/dV instead of the stage's stacks.
  Elsewhere at least a forward's stacks where they are larger: its chunk's residuals (where the
  program has residual slots) and layer inputs (checkpoint slots) over the stage's layers,
  ``L/pp · T/sp · (m_stored + d · e)`` (the per-layer form writes each layer's into its slots);
- ``tick``: what a tick holds beside its op: both lanes' inputs read out of the stash and the
  inbox ``2 · T/sp · d · e`` (a forward clears its rows of the dK/dV pools in place,
  :func:`jvarlen.parallel.pipeline.slots.clear_rows`: no block of zeros);
- ``inputs``: the chunks' int32 rows (:data:`jvarlen.plan.buffers.CHUNK_KEYS`), ``5 · n · T · 4``;
- ``states``: :meth:`CostModel.model_state_memory` of the largest stage.

``m_stored`` is what the executor keeps per token and stored layer under its residual policy
(``CostCoefficients.m_stored_token``; the profile's ``m_token`` where it is 0).
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from typing import Optional

import numpy as np

from jvarlen.plan.buffers import CHUNK_KEYS, SLOT_COUNTS, kept_apart, plan_ticks, round_buffers, slot_counts
from jvarlen.plan.chunk import ChunkShape, executor_bucket, executor_context
from jvarlen.plan.simulator import simulate


@dataclasses.dataclass(frozen=True)
class ExecutorMemory:
    """Bytes per device, by term (see the module docstring), the sizes they come from, and where
    each slot kind peaks (:class:`jvarlen.plan.buffers.Peaks`: kind -> (stage, tick, holders))."""

    terms: dict
    sizes: dict
    peaks: Mapping = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> float:
        return float(sum(self.terms.values()))

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in self.terms.items() if v)
        return f"{self.total / 1e6:.1f} MB ({parts})"


def executor_memory(plan, cost, stored_bytes: Optional[float] = None, fuse: bool = True) -> ExecutorMemory:
    """The executor's account of ``plan`` (a :class:`jvarlen.plan.plan.Plan`) on ``cost``'s layout,
    as the compiled signature of the plan alone sizes it (a step that reuses a bigger compiled
    signature holds that one's buffers). ``stored_bytes``: per token and stored layer, overrides
    the coefficients'. A plan in parts holds one part's buffers at a time: the largest part's
    account."""
    return executor_account(plan, cost, stored_bytes, fuse)(plan.ckpt_layers)


def executor_account(plan, cost, stored_bytes: Optional[float] = None, fuse: bool = True):
    """A function of a recomputation table giving :func:`executor_memory` of ``plan`` under it (the
    bucket, the context and the slot memos are worked out once; per part for a plan in parts)."""
    if not plan.parts:
        return _Account(plan, cost, stored_bytes, fuse).measure
    parts = [(_Account(p, cost, stored_bytes, fuse), a, b) for p, (a, b) in zip(plan.part_plans(), plan.part_ranges())]

    def measure(ckpt) -> ExecutorMemory:
        ckpt = np.asarray(ckpt)
        return max((acc.measure(ckpt[a:b]) for acc, a, b in parts), key=lambda m: m.total)

    return measure


class _Account:
    """:func:`executor_memory` of one plan under any recomputation table: what the table does not
    change (the chunks' bucket and context, the model states, the largest op's working memory) is
    computed once, and each tick table's slot memo is kept (the table changes only with the chunks
    kept apart that the last stage could fuse), so that :func:`fit_executor`'s repairs measure
    thousands of tables."""

    def __init__(self, plan, cost, stored_bytes: Optional[float], fuse: bool):
        layout, model, c = cost.layout, cost.model, cost.coeffs
        self.plan, self.cost, self.fuse = plan, cost, fuse
        self.ls, self.e, self.d_model = cost.layers_per_stage, c.bytes_per_element, model.d_model
        self.shapes = shapes = plan.chunk_shapes()
        self.tokens = [s.tokens for s in shapes]
        self.bucket = executor_bucket(max(self.tokens), layout.sp)
        self.uses_context = [s.context > 0 or not s.tail for s in shapes]
        self.ctx_need = [s.context + (0 if s.tail else s.slices[0]) for s in shapes]
        self.context = executor_context(shapes, self.bucket)
        self.tl = self.bucket / layout.sp
        self.stored = stored_bytes if stored_bytes is not None else (c.m_stored_token or c.m_token)
        kv_heads = model.num_kv_heads * (layout.sp // math.gcd(model.num_kv_heads, layout.sp)) // layout.sp
        self.kv_row = kv_heads * model.head_dim * self.e  # one layer's K (or V) of one token, per device
        self.states = max(cost.model_state_memory(p) for p in range(layout.pp))
        self.per_layer = cost.executor_per_layer  # one layer's gradients at a time (backward_memory too)
        # the chunks' int32 token, target, mask, position and segment rows this pipeline receives
        self.input_bytes = len(CHUNK_KEYS) * len(shapes) * self.bucket * 4
        self._work: dict = {}  # (context rows, recomputes) -> the largest backward's working memory
        self._ticks: dict = {}  # fusable chunks kept apart -> (paired tick table, slot memo)
        self.fusable = np.asarray(plan.schedule.fusable, bool) & fuse  # only these can change the table

    def _backward(self, sc: int, recomputes: bool) -> float:
        """The largest backward's working memory and layer gradients at context window ``sc``."""
        if (sc, recomputes) not in self._work:
            shape = ChunkShape(sc, (self.bucket,), tail=True)
            self._work[sc, recomputes] = self.cost.backward_memory(shape, self.ls if recomputes else 0)
        return self._work[sc, recomputes]

    def measure(self, ckpt) -> ExecutorMemory:
        ckpt = np.asarray(ckpt, np.int32)
        key = (kept_apart(ckpt) & self.fusable).tobytes()
        if key not in self._ticks:
            self._ticks[key] = plan_ticks(self.plan.schedule, ckpt, self.fuse), {}
        ticks, memo = self._ticks[key]
        ls, tl, d, e = self.ls, self.tl, self.d_model, self.e
        slots = slot_counts(
            ticks,
            self.plan.schedule.chunk_prev,
            ckpt,
            ls,
            uses_context=self.uses_context,
            ctx_need=self.ctx_need,
            memo=memo,
        )
        sizes = {name: getattr(slots, name) for name in SLOT_COUNTS + ("fused",)}
        sizes["context"] = self.context
        rounded = round_buffers(types.SimpleNamespace(**sizes), self.bucket, ls)
        sc = rounded["context"]
        dctx = 2 * (1 if self.per_layer else ls) * sc * self.kv_row if sc else 0  # dK/dV an op holds
        op = self._backward(sc, bool((ckpt > 0).any())) + dctx
        if rounded["fused"]:  # the fused op rebuilds no layer: its stack holds every layer's residuals
            op = max(op, self._backward(sc, False) + dctx + ls * tl * self.stored)
        if not self.per_layer:  # a forward returns its layers' residuals and inputs stacked (at least)
            op = max(op, ls * tl * ((self.stored if rounded["n_res"] else 0) + (d * e if rounded["n_ckpt"] else 0)))
        terms = dict(
            states=self.states,
            stash=(rounded["n_stash"] + 1) * tl * d * e,
            grad=(rounded["n_grad"] + 1) * tl * d * e,
            context=4 * ls * rounded["ctx_rows"] * self.kv_row if sc else 0.0,
            residuals=rounded["n_res"] * tl * self.stored,
            checkpoints=rounded["n_ckpt"] * tl * d * e,
            op=op,
            tick=2 * tl * d * e,  # both lanes' inputs, read out of the stash and the inbox
            inputs=self.input_bytes,
        )
        return ExecutorMemory({k: float(v) for k, v in terms.items()}, dict(rounded, bucket=self.bucket), slots.peaks)


def fit_executor(plan, cost, stored_bytes: Optional[float] = None, fuse: bool = True, mode: str = "paired"):
    """Recomputation table under which the executor's account of ``plan`` fits ``cost``'s budget,
    raised from the plan's own: of the repairs that fit, the one whose plan the simulator
    (``mode``, :func:`jvarlen.plan.simulator.simulate`) finds faster:

    - *by chunk*: while the account is over and some layer is stored, a chunk that holds stored
      layers where the residual slots peak (the one with the fewest tokens: its recomputation is
      the cheapest) recomputes every layer of that stage; with no residual slot left, a chunk the
      last stage fuses does (the fused op's stack goes with the last of them);
    - *by cap*: every chunk stores at most ``c`` layers of each stage, the largest ``c`` that fits
      (binary search). Every chunk then recomputes a little instead of a few chunks everything, and
      with ``c < L/pp`` no chunk is fused, so the program holds no stack of a chunk's ``L/pp``
      layers' residuals: where that stack is most of the account (pp = 1 groups), only this
      repair lets chunks keep stored layers;
    - *by stage*: a cap per stage, lowered on the stage where the residual slots peak
      (:func:`_repair_by_stage`): on the 13B Hydraulis groups of the strategies benchmark it
      stores 8 of 20 layers on the first stage and leaves the last stage fused, up to 9 % less
      time than either repair above.

    -> (ckpt ``[n, pp]``, :class:`ExecutorMemory`, (chunk, stage) pairs raised). With none
    fitting, the by-chunk table: the account may be over even when everything is recomputed.
    A plan in parts: each part fitted on its own (it runs alone), the tables put back together."""
    if plan.parts:
        fits = [fit_executor(p, cost, stored_bytes, fuse, mode) for p in plan.part_plans()]
        table = np.concatenate([t for t, _, _ in fits]).astype(np.int32)
        changed = [(k + a, p) for (_, _, c), (a, _) in zip(fits, plan.part_ranges()) for k, p in c]
        return table, max((m for _, m, _ in fits), key=lambda m: m.total), changed
    ckpt = np.array(plan.ckpt_layers, np.int32)
    accounts = _Account(plan, cost, stored_bytes, fuse)
    account = accounts.measure(ckpt)
    if account.total <= cost.memory_budget:
        return ckpt, account, []

    def iteration_time(table):
        return simulate(
            plan.schedule, accounts.shapes, table, cost, mode, validate=False, timeline=False, memory=False
        ).iteration_time

    ls, budget = cost.layers_per_stage, cost.memory_budget
    repairs = [_repair_by_chunk(ckpt, account, accounts.tokens, ls, budget, accounts.measure)]
    capped = _repair_by_cap(ckpt, ls, budget, accounts.measure)
    if capped is not None:
        repairs.append(capped)
    repairs.append(_repair_by_stage(ckpt, account, ls, budget, accounts.measure))
    fitting = [r for r in repairs if r[1].total <= budget]
    table, account = min(fitting, key=lambda r: iteration_time(r[0])) if len(fitting) > 1 else (fitting or repairs)[0]
    return table, account, [(int(k), int(p)) for k, p in zip(*np.nonzero(table != ckpt))]


def _repair_by_chunk(ckpt, account, tokens, ls: int, budget: float, measure):
    """The by-chunk repair of :func:`fit_executor` -> (ckpt, account); ``tokens [n]``: per chunk."""
    ckpt = ckpt.copy()
    while account.total > budget:
        pick = _next_to_recompute(account, ckpt, tokens, ls)
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


def _repair_by_stage(ckpt, account, ls: int, budget: float, measure):
    """The by-stage repair of :func:`fit_executor` -> (ckpt, account): a cap per stage, lowered one
    layer at a time on the stage where the residual slots peak (with none left, on the last stage,
    whose fused op holds a chunk's stack). The program's slots are the largest any stage needs, and
    the stages do not need alike: the first holds ``pp`` chunks in flight in 1F1B, the last fuses
    its forward and backward and holds one; so a cap on the first stages alone often fits, where
    one cap for all unfuses the last stage and a by-chunk repair recomputes whole chunks."""
    pp = ckpt.shape[1]
    caps = ls - ckpt.min(axis=0)
    table = ckpt
    while account.total > budget:
        if account.sizes["n_res"]:
            stage = account.peaks.chunks("res")[0]
        elif account.sizes["fused"]:
            stage = pp - 1
        else:
            break
        if caps[stage] == 0:
            break
        caps[stage] -= 1
        table = np.maximum(ckpt, ls - caps[None, :]).astype(np.int32)
        account = measure(table)
    return table, account


def _next_to_recompute(account: ExecutorMemory, ckpt, tokens, ls: int):
    """(chunk, stage) whose full recomputation can lower ``account`` next, or None."""
    pp = ckpt.shape[1]
    if account.sizes["n_res"]:
        stage, chunks = account.peaks.chunks("res")
        return min(chunks, key=lambda k: (tokens[k], k)), stage
    fused = [k for k in range(len(tokens)) if ckpt[k, pp - 1] < ls]
    if account.sizes["fused"] and fused:
        return min(fused, key=lambda k: (tokens[k], k)), pp - 1
    return None
