"""Host-side buffer slots of the pipeline executor (numpy only, no JAX).

Every buffer of a stage (stashed inputs, cotangent inboxes, stored residuals, checkpoints)
is a fixed number of *slots*; a slot is held by one chunk over a live range of ticks. Slots
are assigned by interval colouring of those live ranges in the tick table, so their number
follows the pipeline window (InfiniPipe Eq. 7) rather than the number of chunks. Slot index
``count`` (one past the last) is the *dummy* slot: writing to it means "store nothing".

A split document's context K/V and their gradients live in a *pool* of rows instead: the
document holds a region of as many rows as its context grows to (its last slice's C), from its
first slice's forward to that slice's backward (the document's last), at a base row chosen by
first fit (docs/design/pipeline-context-pool.md). Documents of different lengths then take
what they need, not one whole context bucket each.

Tables are paired (``[ticks, pp, 2 lanes, 2]``, :func:`jvarlen.plan.schedule.paired_ticks`;
a single-op table ``[ticks, pp, 2]`` is read as one op per tick). Phases inside a tick: ``3t``
is lane 0 (a backward or fused op), ``3t+1`` lane 1 (a forward), ``3t+2`` the filing of what
the two ppermutes delivered. A backward frees its slots before the forward of the same tick
takes one, so pairing a forward with a backward needs no extra slot.

On the last stage a chunk whose backward directly follows its forward runs both as one
*fused* op (:data:`FUSED`, plain autodiff inside the tick): it needs no inbox or residual
slot, whatever the recomputation table says, and with one stage no stash slot either (its
input is the embedding); on a later stage it still needs the stash slot its input arrives in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Optional, Sequence

import numpy as np

from jvarlen.plan.live_ranges import Live, context_pool, peak_of
from jvarlen.plan.memo import BoundedMemo
from jvarlen.plan.schedule import BWD, FUSED, FWD, IDLE, lanes, paired_ticks

__all__ = [
    "CHUNK_KEYS",
    "FUSED",
    "Peaks",
    "SLOT_COUNTS",
    "SlotCounts",
    "SlotTables",
    "assign_slots",
    "as_paired",
    "slot_counts",
    "fuse_single_stage",
    "kept_apart",
    "op_ticks",
    "plan_ticks",
    "round_buffers",
]

# a chunk's int32 rows among the executor's device inputs (jvarlen.parallel.pipeline.signature)
CHUNK_KEYS = ("tokens", "segment_ids", "positions", "targets", "loss_mask")
# the slot counts of a table and of a signature (each excludes the dummy slot)
SLOT_COUNTS = ("n_stash", "n_grad", "ctx_rows", "n_res", "n_ckpt")


@dataclasses.dataclass(frozen=True)
class SlotTables:
    """Slot tables of one pipeline (n chunks, pp stages, Ls layers per stage, `ticks` ticks).

    stash_slot, grad_slot: ``[n, pp]`` int32; res_slot, ckpt_slot: ``[n, pp, Ls]`` int32
    (a stored layer's residuals; a recomputed layer's input, for layers 1.. of the recomputed ones:
    layer 0's is the stash slot); recv_act, recv_grad: ``[ticks, pp]`` int32. Counts exclude the
    dummy slot. ``ctx_base [n, pp]``: the first context-pool row of the chunk's document
    (``ctx_rows``, one past the last row, for a chunk without context); ``ctx_rows``: the pool's
    rows. ``fused``: some op of the table runs a chunk's F and B fused.
    """

    stash_slot: np.ndarray
    grad_slot: np.ndarray
    ctx_base: np.ndarray
    res_slot: np.ndarray
    ckpt_slot: np.ndarray
    recv_act: np.ndarray
    recv_grad: np.ndarray
    n_stash: int
    n_grad: int
    ctx_rows: int
    n_res: int
    n_ckpt: int
    fused: bool
    peaks: Mapping = dataclasses.field(default_factory=dict, compare=False)  # kind -> (stage, tick, holders)

    def with_counts(self, sizes) -> "SlotTables":
        """The same assignment inside the bigger buffers of ``sizes`` (a signature, or anything with
        the :data:`SLOT_COUNTS` attributes); dummy indices move to the new counts."""
        n_stash, n_grad, ctx_rows, n_res, n_ckpt = (getattr(sizes, name) for name in SLOT_COUNTS)
        for name in SLOT_COUNTS:
            if getattr(sizes, name) < getattr(self, name):
                raise ValueError(f"{name}={getattr(sizes, name)} is below the {getattr(self, name)} this plan needs")

        def move(a, old, new):
            a = a.copy()
            a[a == old] = new
            return a

        return SlotTables(
            stash_slot=move(self.stash_slot, self.n_stash, n_stash),
            grad_slot=move(self.grad_slot, self.n_grad, n_grad),
            ctx_base=move(self.ctx_base, self.ctx_rows, ctx_rows),
            res_slot=move(self.res_slot, self.n_res, n_res),
            ckpt_slot=move(self.ckpt_slot, self.n_ckpt, n_ckpt),
            recv_act=move(self.recv_act, self.n_stash, n_stash),
            recv_grad=move(self.recv_grad, self.n_grad, n_grad),
            n_stash=n_stash,
            n_grad=n_grad,
            ctx_rows=ctx_rows,
            n_res=n_res,
            n_ckpt=n_ckpt,
            fused=self.fused,
            peaks=self.peaks,
        )


def as_paired(ticks: np.ndarray) -> np.ndarray:
    """A tick table in paired form ``[ticks, pp, 2, 2]`` (a single-op table: one op per tick)."""
    ticks = np.asarray(ticks, np.int32)
    return lanes(ticks) if ticks.ndim == 3 else ticks


def op_ticks(ticks: np.ndarray, n_chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """(tf, tb): ``[n, pp]`` tick of F(k) and B(k) on each stage (equal for a fused op), from a
    single-op or paired table; raises if one is missing."""
    ticks = as_paired(ticks)
    pp = ticks.shape[1]
    tf = np.full((n_chunks, pp), -1, np.int64)
    tb = np.full((n_chunks, pp), -1, np.int64)
    t, p, lane = np.nonzero(ticks[..., 0] != IDLE)
    op, k = ticks[t, p, lane, 0], ticks[t, p, lane, 1]
    f, b = (op == FWD) | (op == FUSED), (op == BWD) | (op == FUSED)
    tf[k[f], p[f]] = t[f]
    tb[k[b], p[b]] = t[b]
    if (tf < 0).any() or (tb < 0).any():
        k, p = np.argwhere((tf < 0) | (tb < 0))[0]
        raise ValueError(f"tick table lacks F or B of chunk {k} on stage {p}")
    return tf, tb


def kept_apart(ckpt) -> np.ndarray:
    """``[n]`` bool: the chunks the executor never fuses, those a plan's ``ckpt [n, pp]`` recomputes
    on the last stage (a fused op holds every activation of its chunk, which would ignore the
    plan's memory choice)."""
    return np.asarray(ckpt)[:, -1] > 0


_TICKS = BoundedMemo(4096)


def plan_ticks(schedule, ckpt, fuse: bool = True) -> np.ndarray:
    """The executor's paired tick table of a plan (:func:`jvarlen.plan.schedule.paired_ticks`), its
    last stage fusing every chunk but those :func:`kept_apart`. Read-only: memoised by value (the
    planner's searches simulate and account the same schedules many times)."""
    return _memo_ticks(schedule, ckpt, fuse)[0]


def plan_tick_rows(schedule, ckpt, fuse: bool = True) -> tuple:
    """:func:`plan_ticks` as nested tuples ``rows[t][p][lane] = (op, chunk)`` (what a Python loop
    over the ticks reads; memoised with the table)."""
    return _memo_ticks(schedule, ckpt, fuse)[1]


def _memo_ticks(schedule, ckpt, fuse: bool) -> tuple:
    keep = kept_apart(ckpt)
    key = (schedule.stages, schedule.chunk_prev, bool(fuse), keep.tobytes())
    got = _TICKS.get(key)
    if got is None:
        table = paired_ticks(schedule, fuse_last=fuse, keep=keep)
        table.flags.writeable = False
        rows = tuple(tuple(tuple(tuple(lane) for lane in stage) for stage in row) for row in table.tolist())
        got = _TICKS.put(key, (table, rows))
    return got


def fuse_single_stage(ticks: np.ndarray, keep: Optional[np.ndarray] = None) -> np.ndarray:
    """The executor's tick table for a validated one-stage table ``[T, 1, 2]``: every F(k)
    directly followed by B(k) becomes one :data:`FUSED` op, and ticks left idle are dropped.

    With one stage nothing is sent between ticks, so fusing cannot delay another stage, and
    the fused chunk's residuals never leave the tick (no slot traffic, no recomputation).
    ``keep [n]`` (bool): chunks left unfused (the plan's: :func:`kept_apart`).
    """
    ticks = np.asarray(ticks, np.int32)
    if ticks.shape[1] != 1:
        raise ValueError(f"fuse_single_stage takes a one-stage table, got {ticks.shape[1]} stages")
    rows = [r.copy() for r in ticks]
    for t in range(len(rows) - 1):
        (op, k), (op_next, k_next) = rows[t][0], rows[t + 1][0]
        if op == FWD and op_next == BWD and k == k_next and (keep is None or not keep[k]):
            rows[t][0] = (IDLE, -1)
            rows[t + 1][0] = (FUSED, k)
    kept = [r for r in rows if r[0, 0] != IDLE]
    return np.stack(kept) if kept else ticks[:1]


@dataclasses.dataclass(frozen=True)
class SlotCounts:
    """The slot counts of :class:`SlotTables` (and its ``fused`` and ``peaks``) without the tables:
    what the planner's account of the executor's memory reads."""

    n_stash: int
    n_grad: int
    ctx_rows: int
    n_res: int
    n_ckpt: int
    fused: bool
    peaks: Mapping = dataclasses.field(default_factory=dict, compare=False)  # kind -> (stage, tick, holders)


def slot_counts(
    ticks: np.ndarray,
    chunk_prev: Sequence[int],
    ckpt_layers: np.ndarray,
    layers_per_stage: int,
    *,
    uses_context: Optional[Sequence[bool]] = None,
    ctx_need: Optional[Sequence[int]] = None,
    empty: Optional[Sequence[bool]] = None,
    memo: Optional[dict] = None,
) -> SlotCounts:
    """:func:`assign_slots`' counts, fused flag and peaks, without colouring anything: a slot
    kind's count on a stage is the most live ranges that meet at one phase (greedy colouring in
    order of start is optimal on intervals), summed per chunk (a chunk's stored layers share one
    range). ``memo``: as in :func:`assign_slots`; the executor-memory repair measures one plan
    under hundreds of recomputation tables, and each step then costs a sweep over one stage's
    chunks."""
    return _Slots(ticks, chunk_prev, ckpt_layers, layers_per_stage, uses_context, ctx_need, empty, memo).counts()


def assign_slots(
    ticks: np.ndarray,
    chunk_prev: Sequence[int],
    ckpt_layers: np.ndarray,
    layers_per_stage: int,
    *,
    uses_context: Optional[Sequence[bool]] = None,
    ctx_need: Optional[Sequence[int]] = None,
    empty: Optional[Sequence[bool]] = None,
    memo: Optional[dict] = None,
) -> SlotTables:
    """Slots for one pipeline.

    ticks ``[T, pp, 2, 2]`` (paired) or ``[T, pp, 2]`` (one op per tick) of (op, chunk); chunk_prev
    ``[n]`` token-level links; ckpt_layers ``[n, pp]``: the first ``ckpt_layers[k, p]`` layers of
    stage p are recomputed for chunk k, the others keep their residuals. ``uses_context[k]``: chunk
    k reads or writes KV context (default: it is linked to another chunk). ``ctx_need[k]``:
    context-pool rows chunk k reads or writes (its C, plus its own tokens where a later slice
    continues it; default 1, which counts documents). ``empty[k]``: chunk k holds no token (a plan
    padded to the signature's chunk count); it gets no checkpoint slots: its cotangents are zero,
    so its recomputed layers' gradients are zero whatever finite input they are rebuilt from, and a
    padded plan then needs no more slots than the plan it pads.
    ``memo``: a dict kept between calls on one pipeline whose recomputation table changes (the
    executor-memory repair raises one (chunk, stage) per step): what does not depend on the table,
    and each stage's residual and checkpoint ranges per column of it, are computed once. It is
    emptied when the tick table or the chunks change.
    """
    slots = _Slots(ticks, chunk_prev, ckpt_layers, layers_per_stage, uses_context, ctx_need, empty, memo)
    counts = slots.counts()
    ticks, fx, n, pp, ls = slots.ticks, slots.fx, slots.n, slots.pp, slots.ls
    # what holds no slot gets the dummy slot (the count): recomputed layers, fused ops, empty chunks
    stash = np.full((n, pp), counts.n_stash, np.int32)
    grad = np.full((n, pp), counts.n_grad, np.int32)
    res = np.full((n, pp, ls), counts.n_res, np.int32)
    ckpt_slot = np.full((n, pp, ls), counts.n_ckpt, np.int32)
    for p in range(pp):
        for table, name in ((stash, "stash"), (grad, "grad"), (res, "res"), (ckpt_slot, "ckpt")):
            keys, assigned = slots.live(p, name).arrays()
            if len(assigned):
                table[(keys[:, 0], p) + tuple(keys[:, 1:].T)] = assigned
    # what arrives at the end of tick t: a stage's forward output on the next stage, its backward's
    # (or fused op's) input cotangent on the previous one (one forward and one backward lane per
    # stage and tick, so no cell is written twice)
    recv_act = np.full((ticks.shape[0], pp), counts.n_stash, np.int32)
    recv_grad = np.full((ticks.shape[0], pp), counts.n_grad, np.int32)
    t, p, lane = np.nonzero(ticks[..., 0] != IDLE)
    op, k = ticks[t, p, lane, 0], ticks[t, p, lane, 1]
    sent = (op == FWD) & (p + 1 < pp)
    recv_act[t[sent], p[sent] + 1] = stash[k[sent], p[sent] + 1]
    sent = ((op == BWD) | (op == FUSED)) & (p > 0)
    recv_grad[t[sent], p[sent] - 1] = grad[k[sent], p[sent] - 1]
    return SlotTables(
        stash_slot=stash,
        grad_slot=grad,
        ctx_base=fx.ctx.copy(),
        res_slot=res,
        ckpt_slot=ckpt_slot,
        recv_act=recv_act,
        recv_grad=recv_grad,
        **{f.name: getattr(counts, f.name) for f in dataclasses.fields(SlotCounts)},  # its counts, fused, peaks
    )


class _Slots:
    """One call of :func:`slot_counts` or :func:`assign_slots`: the arguments checked, the
    table-free part from the memo (or built), each stage's live ranges per kind on demand."""

    def __init__(self, ticks, chunk_prev, ckpt_layers, ls, uses_context, ctx_need, empty, memo):
        self.ticks = ticks = as_paired(ticks)
        n, pp = len(chunk_prev), ticks.shape[1]
        self.n, self.pp, self.ls = n, pp, ls
        ckpt = np.asarray(ckpt_layers).reshape(n, pp)
        if (ckpt < 0).any() or (ckpt > ls).any():
            raise ValueError(f"ckpt_layers must be in [0, {ls}] (layers per stage), got {ckpt.min()}..{ckpt.max()}")
        self.ckpt = ckpt.astype(np.int64)
        self.memo = memo = {} if memo is None else memo
        key = (
            ticks.shape,
            ticks.tobytes(),
            tuple(chunk_prev),
            *(None if x is None else tuple(x) for x in (uses_context, ctx_need, empty)),
        )
        if memo.get("pipeline") != key:
            memo.clear()
            memo["pipeline"], memo["fixed"] = key, _Pipeline.build(ticks, chunk_prev, uses_context, ctx_need, empty)
        self.fx: _Pipeline = memo["fixed"]

    def live(self, p: int, name: str) -> "Live":
        fx = self.fx
        if name in fx.stages[p]:
            return fx.stages[p][name]
        first = self.ckpt[:, p]
        column = (p, name, self.ls, first.tobytes())
        if column not in self.memo:
            chunks = fx.staged[p] if name == "res" else fx.holders[p]
            lo = first[chunks]
            if name == "res":  # stored layers first..ls-1
                layers = np.stack([lo, np.full_like(lo, self.ls)], axis=1)
            else:  # checkpoints: recomputed layers 1..first-1 (layer 0's input is the stash slot)
                layers = np.stack([np.ones_like(lo), lo], axis=1)
            self.memo[column] = Live(chunks, fx.f_phase[chunks, p], fx.b_phase[chunks, p], layers)
        return self.memo[column]

    def counts(self) -> SlotCounts:
        counts, peaks = {}, {}
        for name in ("stash", "grad", "res", "ckpt"):
            per_stage = [self.live(p, name).count for p in range(self.pp)]
            p = int(np.argmax(per_stage))  # the first stage where the kind peaks
            counts[name], peaks[name] = per_stage[p], (p, self.live(p, name))
        return SlotCounts(
            n_stash=counts["stash"],
            n_grad=counts["grad"],
            ctx_rows=self.fx.ctx_rows,
            n_res=counts["res"],
            n_ckpt=counts["ckpt"],
            fused=bool(self.fx.fused.any()),
            peaks=Peaks(peaks, self.fx.ctx_peak),
        )


class Peaks(Mapping):
    """Slot kind -> (stage, tick, holders) at the first stage and phase where the kind's slots peak
    (holders: chunks, or (chunk, layer) keys), read when asked: the planner's executor-memory repair
    measures thousands of tables and reads one kind's peak chunks (:meth:`chunks`) of each."""

    def __init__(self, lives: dict, ctx_peak: Optional[tuple]):
        self._lives = lives  # kind -> (stage, Live)
        self._ctx = {} if ctx_peak is None else {"ctx": ctx_peak}

    def __getitem__(self, kind: str) -> tuple:
        if kind in self._ctx:
            return self._ctx[kind]
        stage, live = self._lives[kind]
        return (stage,) + live.peak()

    def __iter__(self):
        return iter(list(self._lives) + list(self._ctx))

    def __len__(self) -> int:
        return len(self._lives) + len(self._ctx)

    def chunks(self, kind: str) -> tuple[int, list[int]]:
        """(stage, chunks holding ``kind``'s slots at its peak, ascending) of a slot kind."""
        stage, live = self._lives[kind]
        return stage, live.peak_chunks()


@dataclasses.dataclass
class _Pipeline:
    """What of a pipeline's slots the recomputation table does not change: the ops' phases, the
    stashed inputs' and cotangent inboxes' live ranges and the context pool."""

    f_phase: np.ndarray  # [n, pp]
    b_phase: np.ndarray  # [n, pp]
    fused: np.ndarray  # [n, pp] bool
    staged: list  # per stage: chunks not fused there (they hold residual slots), int64 arrays
    holders: list  # per stage: staged chunks that hold tokens (they hold checkpoint slots), int64 arrays
    stages: list  # per stage: {"stash": Live, "grad": Live}
    ctx: np.ndarray  # [n, pp] base row of each chunk's region (ctx_rows: none)
    ctx_rows: int
    ctx_peak: Optional[tuple]

    @classmethod
    def build(cls, ticks, chunk_prev, uses_context, ctx_need, empty) -> "_Pipeline":
        n, pp = len(chunk_prev), ticks.shape[1]
        tf, tb = op_ticks(ticks, n)
        fused = tf == tb  # [n, pp]: F and B in one op, nothing kept between ticks
        # phases: lane 0 (B, FUSED) at 3t, lane 1 (F) at 3t + 1, filing of received messages at 3t + 2
        f_phase = 3 * tf + np.where(fused, 0, 1)
        b_phase = 3 * tb
        nxt = [-1] * n
        for k, j in enumerate(chunk_prev):
            if j >= 0:
                nxt[j] = k
        root = []
        for k in range(n):
            r = k
            while chunk_prev[r] >= 0:
                r = chunk_prev[r]
            root.append(r)
        if uses_context is None:
            uses_context = [chunk_prev[k] >= 0 or nxt[k] >= 0 for k in range(n)]
        rows = {}  # a document's region: the most rows any of its chunks needs
        for k in range(n):
            if uses_context[k]:
                rows[root[k]] = max(rows.get(root[k], 1), 1 if ctx_need is None else int(ctx_need[k]))
        roots = sorted({root[k] for k in range(n) if uses_context[k]})
        staged, holders, stages, iv_ctx_stage = [], [], [], []
        for p in range(pp):
            on = [k for k in range(n) if not fused[k, p]]
            inputs = on if p == 0 else list(range(n))  # a fused op on a later stage reads its input
            stash_from = 3 * tf[inputs, p - 1] + 2 if p else f_phase[inputs, p]
            grad_from = 3 * tb[on, p + 1] + 2 if p < pp - 1 else f_phase[on, p]
            staged.append(np.asarray(on, np.int64))
            holders.append(np.asarray([k for k in on if empty is None or not empty[k]], np.int64))
            stages.append(
                {
                    "stash": Live(inputs, stash_from, b_phase[inputs, p]),
                    "grad": Live(on, grad_from, b_phase[on, p]),
                }
            )
            iv_ctx_stage.append([(f_phase[r, p], b_phase[r, p], r) for r in roots])
        ctx_rows, bases = context_pool(iv_ctx_stage, rows)
        ctx_peak = None
        if iv_ctx_stage and any(iv_ctx_stage):
            p = max(range(pp), key=lambda q: len(iv_ctx_stage[q]))
            ctx_peak = (p,) + peak_of(iv_ctx_stage[p])
        ctx = np.full((n, pp), ctx_rows, np.int32)
        for p in range(pp):
            for k in range(n):
                if uses_context[k]:
                    ctx[k, p] = bases[p][root[k]]
        return cls(f_phase, b_phase, fused, staged, holders, stages, ctx, ctx_rows, ctx_peak)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m if x else 0


def round_quarter(x: int, unit: int) -> int:
    """``x`` rounded up to ``unit`` times a multiple of a quarter of the largest power of two not
    above ``x / unit`` (1, 2, ..., 8, 10, 12, 14, 16, 20, 24, ... units): under a quarter more."""
    units = -(-x // unit)
    quarter = max(1, (1 << (units.bit_length() - 1)) // 4) if units else 1
    return round_up(units, quarter) * unit


def round_buffers(sizes, bucket: int, layers_per_stage: int) -> dict:
    """The buffer sizes a compiled step rounds ``sizes`` (a signature, or anything with its
    ``context``, :data:`SLOT_COUNTS` and ``fused``) up to, so that nearby plans share one
    executable: the context window to a bucket times a power of two, the pool rows by quarters
    (:func:`round_quarter`), stash and gradient slots to even counts, residual and checkpoint
    slots by quarters of units of ``min(2 · L/pp, 8)`` slots. (They were rounded up to multiples
    of ``2 · L/pp``: with 32 layers per stage a plan storing 2 layer-chunks held 64 residual
    slots, 48 GiB on llama-7b's 6K-token chunks at sp = 8; now 8, 6 GiB.)"""
    ls = layers_per_stage
    slot_unit = min(2 * ls, 8)
    context = sizes.context
    return dict(
        context=bucket * (1 << max(0, int(np.ceil(np.log2(max(context // bucket, 1)))))) if context else 0,
        n_stash=round_up(sizes.n_stash, 2),
        n_grad=round_up(sizes.n_grad, 2),
        ctx_rows=round_quarter(sizes.ctx_rows, bucket),
        n_res=round_quarter(sizes.n_res, slot_unit),
        n_ckpt=round_quarter(sizes.n_ckpt, slot_unit),
        # only a plan that fuses compiles the fused op and its stack of a chunk's residuals over
        # the stage's L/pp layers (17 GiB for llama-7b at pp = 1, sp = 8): a plan that stores part
        # of each chunk because memory is short must not hold it. A compiled step with the op
        # covers plans without (``covers``): once one is compiled, those plans reuse it.
        fused=bool(sizes.fused),
    )
