"""Host side of the pipeline executor: plans + documents -> the numpy inputs of one step.

Numpy only. :func:`prepare_batch` turns packed chunks, schedules and recomputation tables into
the device arrays of a :class:`~jvarlen.parallel.pipeline.signature.PipelineSignature`;
:func:`prepare_plans` does it for one :class:`~jvarlen.plan.plan.Plan` per pipeline, choosing
the chunk bucket and reusing an already compiled signature that covers the plans.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from jvarlen.layout import Layout
from jvarlen.parallel.pipeline.chunks import PackedChunks, pack_chunks, stack_pipelines
from jvarlen.parallel.pipeline.signature import (
    GROWABLE,
    TABLE_KEYS,
    PipelineSignature,
    covers,
    round_signature,
)
from jvarlen.plan import schedule as sch
from jvarlen.plan.buffers import SLOT_COUNTS, assign_slots, fuse_single_stage, kept_apart, plan_ticks, round_up
from jvarlen.plan.chunk import executor_buckets
from jvarlen.plan.plan import Plan
from jvarlen.plan.schedule import IDLE, Schedule, ScheduleError


def prepare_batch(
    packs: Sequence[PackedChunks],
    schedules: Sequence[Union[Schedule, np.ndarray]],
    ckpt_layers: Sequence[np.ndarray],
    layout: Layout,
    num_layers: int,
    *,
    signature: Optional[PipelineSignature] = None,
    fuse: bool = True,
    paired: bool = True,
) -> tuple[PipelineSignature, dict]:
    """Numpy device inputs of one iteration (one pack, schedule, ckpt table per pipeline).

    ``schedules[i]``: a :class:`Schedule` (run as its ASAP tick table) or a tick table
    ``[ticks, pp, 2]`` from the planner (validated with ``Schedule.from_ticks``).
    ``ckpt_layers[i] [n, pp]``: layers recomputed per chunk and stage (InfiniPipe Eq. 15-16).
    ``signature``: run inside that compiled step's buffers (raises naming the stage, tick and
    chunks when the tables need more slots, ticks or context); else the smallest signature.
    ``paired``: run the paired tick table of the schedule (:func:`jvarlen.plan.schedule.paired_ticks`:
    a backward and a forward per stage and tick, the last stage's adjacent F and B fused), the
    default; False runs one op per stage and tick as given (a Schedule as its ASAP table
    ``to_ticks()``; with one stage adjacent F and B are still fused,
    :func:`jvarlen.plan.buffers.fuse_single_stage`).
    ``fuse``: True fuses such an F and B where the plan recomputes no layer of the chunk on the
    last stage (a fused op holds every activation of its chunk, so fusing a recomputed chunk would
    break the plan's memory bound; the simulator's paired model fuses the same chunks); False keeps
    every F and B apart.
    Returns (signature, ``{key: [dp, ...]}``; ``ops`` is ``[dp, ticks, pp, 2, 2]``).
    """
    if not (len(packs) == len(schedules) == len(ckpt_layers) == layout.dp):
        raise ValueError(f"need one pack, schedule and ckpt table per pipeline (dp={layout.dp})")
    if num_layers % layout.pp:
        raise ValueError(f"num_layers ({num_layers}) must be divisible by pp ({layout.pp})")
    ls = num_layers // layout.pp
    tables = []
    for pack, sched, ckpt in zip(packs, schedules, ckpt_layers):
        if isinstance(sched, Schedule):
            if tuple(sched.chunk_prev) != tuple(pack.chunk_prev):
                raise ScheduleError(f"schedule links {sched.chunk_prev} differ from the chunks' {pack.chunk_prev}")
            sched.validate()
            base, ticks = sched, None
        else:
            ticks = np.asarray(sched, np.int32)
            base = Schedule.from_ticks(ticks, pack.chunk_prev)
        if base.pp != layout.pp:
            raise ScheduleError(f"tick table has {base.pp} stages, layout has pp={layout.pp}")
        ckpt = np.asarray(ckpt, np.int32)
        if ckpt.shape != (pack.n_chunks, layout.pp):
            raise ValueError(f"ckpt_layers must be [n_chunks, pp] = {(pack.n_chunks, layout.pp)}, got {ckpt.shape}")
        if paired:
            ticks = plan_ticks(base, ckpt, fuse)
        else:
            ticks = base.to_ticks() if ticks is None else ticks
            if layout.pp == 1 and fuse:
                ticks = fuse_single_stage(ticks, keep=kept_apart(ckpt))
            ticks = sch.lanes(ticks)
        seg = pack.arrays["segment_ids"]
        own = ((seg == seg[:, :1]) & (seg > 0)).sum(axis=1)  # tokens of the chunk's first piece
        slots = assign_slots(
            ticks,
            pack.chunk_prev,
            ckpt,
            ls,
            uses_context=(pack.ctx_len > 0) | (pack.has_next > 0),
            ctx_need=pack.ctx_len + np.where(pack.has_next > 0, own, 0),
            empty=~(seg > 0).any(axis=1),
        )
        tables.append((ticks, slots))
    bucket = packs[0].bucket
    context = max(p.context_bucket() for p in packs)
    context = -(-context // bucket) * bucket if context else 0
    need = dict(
        n_ticks=max(t.shape[0] for t, _ in tables),
        context=context,
        **{name: max(getattr(s, name) for _, s in tables) for name in SLOT_COUNTS},
        fused=any(s.fused for _, s in tables),
    )
    if signature is None:
        sig = PipelineSignature(layout, num_layers, bucket, packs[0].n_chunks, **need)
    else:
        sig = signature
        _check_fits(sig, layout, num_layers, bucket, packs[0].n_chunks, need, [s for _, s in tables])
    out = stack_pipelines(packs)
    per = {key: [] for key in TABLE_KEYS}
    tables = [(skip_empty(ticks, pack), slots) for (ticks, slots), pack in zip(tables, packs)]
    for ticks, slots in tables:
        slots = slots.with_counts(sig)
        pad = sig.n_ticks - ticks.shape[0]
        idle = np.zeros((pad, layout.pp, 2, 2), np.int32)
        idle[..., 1] = -1
        per["ops"].append(np.concatenate([ticks, idle]))
        per["recv_act"].append(np.concatenate([slots.recv_act, np.full((pad, layout.pp), sig.n_stash, np.int32)]))
        per["recv_grad"].append(np.concatenate([slots.recv_grad, np.full((pad, layout.pp), sig.n_grad, np.int32)]))
        for key in ("stash_slot", "grad_slot", "ctx_base", "res_slot", "ckpt_slot"):
            per[key].append(getattr(slots, key))
    out.update({key: np.stack(v).astype(np.int32) for key, v in per.items()})
    # ticks the executor runs: the longest pipeline's table up to its last op, not the signature's
    # rounded count (every pipeline runs as many, so that collectives match); idle ticks after the
    # last op (the signature's rounding, a tail of empty chunks) are skipped
    out["live_ticks"] = np.full((layout.dp,), max(_last_op(t) + 1 for t, _ in tables), np.int32)
    return sig, out


def skip_empty(ticks: np.ndarray, pack: PackedChunks) -> np.ndarray:
    """The tick table with the ops of chunks that hold no token made idle: the chunks that pad a
    plan's chunk count (:func:`pad_plan`) contribute nothing, so their forward, recomputation and
    backward over the whole bucket need not run. Their slots stay assigned (what an idle op's
    neighbours send them is never read)."""
    empty = ~(pack.arrays["segment_ids"] > 0).any(axis=1)
    if not empty.any():
        return ticks
    out = np.array(ticks, np.int32)
    chunk = out[..., 1]
    idle = (chunk >= 0) & empty[np.clip(chunk, 0, None)]
    out[..., 0][idle] = IDLE
    out[..., 1][idle] = -1
    return out


def _last_op(ticks: np.ndarray) -> int:
    busy = np.flatnonzero((ticks[..., 0] != IDLE).reshape(ticks.shape[0], -1).any(axis=1))
    return int(busy[-1]) if busy.size else 0


def _check_fits(sig, layout, num_layers, bucket, n_chunks, need, slot_tables) -> None:
    fixed = dict(layout=layout, num_layers=num_layers, bucket=bucket, n_chunks=n_chunks)
    for name, value in fixed.items():
        if getattr(sig, name) != value:
            raise ValueError(f"plan has {name}={value}, the compiled signature has {getattr(sig, name)}")
    for name, value in need.items():
        if value <= getattr(sig, name):
            continue
        if name == "fused":
            raise ScheduleError("the tables fuse a chunk's F and B but the compiled signature has no fused op")
        where = ""
        kind = "ctx" if name == "ctx_rows" else name[2:] if name.startswith("n_") else None
        for slots in slot_tables:
            if kind in slots.peaks and getattr(slots, name) == value:
                stage, tick, who = slots.peaks[kind]
                where = f" (stage {stage}, tick {tick}: chunks {who} live at once)"
        raise ScheduleError(
            f"window overflow: the tables need {name}={value} but the compiled signature has "
            f"{getattr(sig, name)}{where}"
        )


def split_documents(plan: Plan) -> int:
    """Documents cut into more than one slice by the plan."""
    seen: dict[int, int] = {}
    for chunk in plan.chunks:
        for doc, _, _ in chunk:
            seen[doc] = seen.get(doc, 0) + 1
    return sum(1 for c in seen.values() if c > 1)


def pad_plan(plan: Plan, n_chunks: int, layers_per_stage: int):
    """(chunks, schedule, ckpt) with empty chunks appended up to ``n_chunks`` (they run a 1F1B
    tail, carry only padding, recompute everything and contribute nothing). 1F1B, not GPipe: a
    stage holds at most ``pp`` of them at once, so a plan padded to another pipeline's chunk
    count (dp > 1) keeps its stash and gradient slots; a GPipe tail of ``e`` empty chunks held
    ``e`` of each (DAPPLE's 3 chunks padded to 16: 2 -> 14 stash slots)."""
    extra = n_chunks - plan.n_chunks
    if extra < 0:
        raise ValueError(f"plan has {plan.n_chunks} chunks, more than {n_chunks}")
    chunks = [list(c) for c in plan.chunks] + [[] for _ in range(extra)]
    sched, ckpt = plan.schedule, np.asarray(plan.ckpt_layers, np.int32)
    if extra:
        sched = sch.sequential([sched, sch.one_f_one_b(extra, plan.layout.pp)])
        ckpt = np.concatenate([ckpt, np.full((extra, plan.layout.pp), layers_per_stage, np.int32)])
    return chunks, sched, ckpt


def chunk_buckets(plans: Sequence[Plan], sp: int, fixed: Optional[int] = None) -> list[int]:
    """Token buckets that hold the largest chunk, smallest first (:func:`jvarlen.plan.chunk.executor_buckets`:
    multiples of an eighth of the next power of two p up to p itself, so padding stays under an
    eighth of p instead of up to half of it). ``fixed``: that bucket only."""
    if fixed is not None:
        return [fixed]
    return executor_buckets(max(sum(p[2] for p in c) for plan in plans for c in plan.chunks), sp)


def prepare_plans(
    plans: Sequence[Plan],
    documents: Sequence[Sequence],
    num_layers: int,
    known: Sequence[PipelineSignature] = (),
    *,
    chunk_multiple: int = 2,
    bucket: Optional[int] = None,
    fuse: bool = True,
    paired: bool = True,
) -> tuple[PipelineSignature, dict]:
    """(signature, numpy batch) for one plan per pipeline (``len(plans) == layout.dp``);
    ``documents[i]``: pipeline i's documents (token arrays or :class:`jvarlen.data.packer.Piece`).

    Chunk counts are padded to a multiple of ``chunk_multiple``. Reuses a ``known`` signature
    that covers the plans in any of the candidate buckets (the smallest such); otherwise the
    smallest bucket's rounded signature (compiled on first use). ``fuse``, ``paired``: as in
    :func:`prepare_batch`."""
    layout: Layout = plans[0].layout
    if any(p.layout != layout for p in plans):
        raise ValueError("all pipelines of one iteration need the same layout")
    if len(documents) != len(plans):
        raise ValueError(f"{len(plans)} plans but documents for {len(documents)} pipelines")
    for i, (plan, docs) in enumerate(zip(plans, documents)):
        if plan.num_layers != num_layers:  # its recomputation counts are of other stages
            raise ValueError(f"pipeline {i}: a plan for {plan.num_layers} layers, the model has {num_layers}")
        # a longer document would be cut to its plan's chunks without a word
        got = tuple(len(d.tokens) if hasattr(d, "tokens") else len(d) for d in docs)
        if got != tuple(plan.lengths):
            raise ValueError(
                f"pipeline {i}: documents of {list(got)[:8]} tokens, but its plan is for {list(plan.lengths)[:8]}"
            )
    ls = num_layers // layout.pp
    n = round_up(max(p.n_chunks for p in plans), chunk_multiple)
    padded = [pad_plan(p, n, ls) for p in plans]
    first = None
    for size in chunk_buckets(plans, layout.sp, bucket):
        packs = [pack_chunks(chunks, docs, size) for (chunks, _, _), docs in zip(padded, documents)]
        args = (packs, [s for _, s, _ in padded], [c for _, _, c in padded], layout, num_layers)
        need, _ = prepare_batch(*args, fuse=fuse, paired=paired)
        first = first or (args, need)
        fitting = [s for s in known if isinstance(s, PipelineSignature) and covers(s, need)]
        if fitting:
            best = min(fitting, key=lambda s: sum(getattr(s, f) for f in GROWABLE))
            return prepare_batch(*args, signature=best, fuse=fuse, paired=paired)
    args, need = first
    return prepare_batch(*args, signature=round_signature(need), fuse=fuse, paired=paired)
