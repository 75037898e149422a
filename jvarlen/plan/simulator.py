"""Plan simulator: a schedule + chunk shapes + recomputation table -> event timeline per stage.

Two execution models:

* ``mode="async"`` (InfiniPipe's simulator): each stage runs its program in order, an op starts
  as soon as the stage is free and its dependencies (:func:`jvarlen.plan.schedule.dependencies`)
  have finished, plus the P2P time (Eq. 2) for a dependency on a neighbouring stage. P2P does
  not occupy the sending stage (it overlaps with the next op).
* ``mode="ticks"``: a lock-step executor with one op per stage and tick (the single-op table of
  :meth:`Schedule.to_ticks`, two ``ppermute`` per tick): a tick lasts as long as its slowest op,
  followed by the slowest P2P sent in that tick.
* ``mode="paired"``: jvarlen's executor (:func:`jvarlen.plan.schedule.paired_ticks`): in one tick
  a stage runs a backward (or, on the last stage, a fused forward + backward of a chunk of which
  the plan recomputes no layer there) and then a forward; a tick lasts as long as its busiest
  stage, plus the slowest P2P sent in it. Every chunk's matmuls run over the step's one token bucket
  (:func:`jvarlen.plan.chunk.executor_buckets` of the longest chunk), as the executor pads them.

In both lock-step modes every tick also costs ``CostModel.tick_overhead()`` (the executor's own
per-tick work: slot gathers and scatters, the ``ppermute`` pair, the switch), every op
``CostModel.op_overhead()``, and a recomputation ``CostModel.executor_recompute_time``; all are
fitted on executor steps (not charged in the async model).

Per op on stage ``p`` for chunk ``k``: ``F`` = forward compute then its all-to-all (Eq. 4);
``B`` = recomputation of ``ckpt_layers[k, p]`` layers (Eq. 11), backward compute, all-to-all.
Memory (Eq. 6-10): model states plus :meth:`CostModel.activation_memory` of every chunk from
the start of its forward to the end of its backward on that stage, plus
:meth:`CostModel.backward_memory` of each backward while it runs (not in the paper: a backward's
transients grow with its chunk, and the executor's backward returns its layers' gradients
before adding them; ``jvarlen.plan.plan.replay_peaks`` replays the same in op order).

Times in seconds, memory in bytes per device. Pure numpy.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Sequence

import numpy as np

from jvarlen.plan.chunk import ChunkShape, executor_buckets, executor_context
from jvarlen.plan.cost import CostModel
from jvarlen.plan.schedule import FUSED, FWD, IDLE, LANE_B, LANE_F, Op, Schedule, dependencies, paired_ticks

EVENT_KINDS = ("F", "B", "R", "A2A", "P2P", "idle")


@dataclasses.dataclass(frozen=True)
class Event:
    stage: int
    kind: str  # one of EVENT_KINDS; "R" = recomputation, "P2P" is drawn on the sender
    chunk: int  # -1 for idle
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclasses.dataclass
class SimResult:
    """Outcome of one pipeline. Arrays are numpy; ``memory[p] = (times[m], bytes[m])`` is a step
    function (value holds from ``times[i]`` to ``times[i+1]``) including model states."""

    events: list[Event]
    makespan: float  # seconds from the first op to the last op of the pipeline
    iteration_time: float  # makespan + step overhead (gradient sync, optimizer)
    stage_busy: np.ndarray  # [pp] seconds of F + B + R + A2A per stage
    stage_recompute: np.ndarray  # [pp] seconds of R per stage
    bubble_ratio: float  # 1 - sum(stage_busy) / (pp * makespan)
    memory: list[tuple[np.ndarray, np.ndarray]]
    peak_memory: np.ndarray  # [pp] bytes per device
    memory_budget: float
    over_budget: list[tuple[int, float, float]]  # (stage, time, bytes) where memory > budget

    @property
    def fits(self) -> bool:
        return not self.over_budget

    def stage_events(self, stage: int, kinds: Sequence[str] = EVENT_KINDS) -> list[Event]:
        return [e for e in self.events if e.stage == stage and e.kind in kinds]


@dataclasses.dataclass
class MultiSimResult:
    """Several pipelines running side by side (dp replicas): the slowest one sets the time."""

    results: list[SimResult]
    slowest: int
    iteration_time: float

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.results)


def _durations(
    cost: CostModel, chunk: ChunkShape, stage: int, op: Op, ckpt: int, extra: float = 0.0, lockstep: bool = False
) -> list[tuple[str, float]]:
    a2a = cost.alltoall_time(chunk)
    if op.kind == "F":
        return [("F", cost.fwd_compute_time(chunk, stage) + extra), ("A2A", a2a)]
    recompute = cost.executor_recompute_time(chunk, ckpt) if lockstep else cost.recompute_time(chunk, ckpt)
    return [("R", recompute), ("B", cost.bwd_compute_time(chunk, stage) + extra), ("A2A", a2a)]


def simulate(
    schedule: Schedule,
    chunk_shapes: Sequence[ChunkShape],
    ckpt_layers: Optional[np.ndarray],
    cost: CostModel,
    mode: Literal["async", "ticks", "paired"] = "async",
    validate: bool = True,
) -> SimResult:
    """Simulates one pipeline. ``ckpt_layers``: int array ``[n_chunks, pp]`` of recomputed layers
    per chunk and stage (None = no recomputation). ``validate=False`` skips the schedule check
    (for callers that re-simulate an already validated schedule many times)."""
    pp, n = schedule.pp, schedule.n_chunks
    if pp != cost.layout.pp:
        raise ValueError(f"schedule has {pp} stages but the cost model's layout has pp={cost.layout.pp}")
    if len(chunk_shapes) != n:
        raise ValueError(f"{len(chunk_shapes)} chunk shapes for a schedule of {n} chunks")
    ckpt = np.zeros((n, pp), np.int64) if ckpt_layers is None else np.asarray(ckpt_layers)
    if ckpt.shape != (n, pp):
        raise ValueError(f"ckpt_layers must have shape [n_chunks, pp] = {(n, pp)}, got {ckpt.shape}")
    if ckpt.min(initial=0) < 0 or ckpt.max(initial=0) > cost.layers_per_stage:
        raise ValueError(f"ckpt_layers must be in [0, {cost.layers_per_stage}]")
    if validate:
        schedule.validate()
    if mode == "paired" and cost.pad_to is None:
        cost = cost.padded(executor_buckets(max(c.tokens for c in chunk_shapes), cost.layout.sp)[0])

    spans: dict[tuple[int, Op], tuple[float, float]] = {}
    events: list[Event] = []

    op_extra = cost.op_overhead() if mode != "async" else 0.0
    context = executor_context(chunk_shapes, cost.pad_to) if mode == "paired" else 0
    tick_extra = cost.tick_overhead(context) if mode != "async" else 0.0

    def emit(stage: int, op: Op, start: float, recompute: bool = True) -> float:
        t = start
        layers = int(ckpt[op.chunk, stage]) if recompute else 0
        for kind, d in _durations(cost, chunk_shapes[op.chunk], stage, op, layers, op_extra, mode != "async"):
            if d > 0:
                events.append(Event(stage, kind, op.chunk, t, t + d))
            t += d
        spans[(stage, op)] = (start, t)
        return t

    def p2p(src: int, dst: int, chunk: int) -> float:
        return cost.p2p_time(chunk_shapes[chunk], min(src, dst))

    if mode == "async":
        free = [0.0] * pp
        pos = [0] * pp
        total = sum(len(p) for p in schedule.stages)
        while len(spans) < total:
            progressed = False
            for p in range(pp):
                while pos[p] < len(schedule.stages[p]):
                    op = schedule.stages[p][pos[p]]
                    deps = dependencies(schedule, p, op)
                    if any(d not in spans for d in deps):
                        break
                    ready = free[p]
                    for q, dop in deps:
                        end = spans[(q, dop)][1]
                        ready = max(ready, end + (p2p(q, p, op.chunk) if q != p else 0.0))
                    free[p] = emit(p, op, ready)
                    pos[p] += 1
                    progressed = True
            if not progressed:  # validate() rules this out
                raise RuntimeError("simulator made no progress")
        for (q, op), (_, e) in list(spans.items()):
            dst = q + 1 if op.kind == "F" else q - 1
            if 0 <= dst < pp:
                events.append(Event(q, "P2P", op.chunk, e, e + p2p(q, dst, op.chunk)))
    elif mode == "ticks":
        table = schedule.to_ticks()
        t0 = 0.0
        for row in table:
            t0 += tick_extra  # the executor's own work of the tick (slot gathers, switches, ...)
            ends, sends = [], [0.0]
            for p in range(pp):
                code, k = int(row[p, 0]), int(row[p, 1])
                if code == 0:
                    continue
                op = Op("F" if code == 1 else "B", k)
                ends.append(emit(p, op, t0))
                dst = p + 1 if op.kind == "F" else p - 1
                if 0 <= dst < pp:
                    sends.append(p2p(p, dst, k))
                    end = spans[(p, op)][1]
                    events.append(Event(p, "P2P", k, end, end + sends[-1]))
            t0 = max(ends, default=t0) + max(sends)
    elif mode == "paired":
        table = paired_ticks(schedule, keep=ckpt[:, -1] > 0)  # fused as the executor fuses
        t0 = 0.0
        for row in table:
            t0 += tick_extra
            ends, sends = [], [0.0]
            for p in range(pp):
                t = t0
                for lane in (LANE_B, LANE_F):
                    code, k = int(row[p, lane, 0]), int(row[p, lane, 1])
                    if code == IDLE:
                        continue
                    if code == FUSED:  # F then B of one chunk, nothing recomputed
                        t = emit(p, Op("B", k), emit(p, Op("F", k), t), recompute=False)
                        kind = "B"
                    else:
                        kind = "F" if code == FWD else "B"
                        t = emit(p, Op(kind, k), t)
                    dst = p + 1 if kind == "F" else p - 1
                    if 0 <= dst < pp:
                        sends.append(p2p(p, dst, k))
                        events.append(Event(p, "P2P", k, t, t + sends[-1]))
                ends.append(t)
            t0 = max(ends, default=t0) + max(sends)
    else:
        raise ValueError(f"mode must be 'async', 'ticks' or 'paired', got {mode!r}")

    start = 0.0 if mode != "async" else min(s for s, _ in spans.values())  # lock-step: from the first tick
    makespan = max(e for _, e in spans.values()) - start
    busy = np.zeros(pp)
    recompute = np.zeros(pp)
    for e in events:
        if e.kind in ("F", "B", "R", "A2A"):
            busy[e.stage] += e.duration
        if e.kind == "R":
            recompute[e.stage] += e.duration
    # idle gaps per stage
    for p in range(pp):
        t = start
        for s, e in sorted(v for (q, _), v in spans.items() if q == p):
            if s > t + 1e-15:
                events.append(Event(p, "idle", -1, t, s))
            t = max(t, e)
        if start + makespan > t + 1e-15:
            events.append(Event(p, "idle", -1, t, start + makespan))
    bubble = 1.0 - busy.sum() / (pp * makespan) if makespan > 0 else 0.0

    memory, peaks, over = [], np.zeros(pp), []
    budget = cost.memory_budget
    for p in range(pp):
        base = cost.model_state_memory(p)
        deltas = []
        for k in range(n):
            m = cost.activation_memory(chunk_shapes[k], int(ckpt[k, p]), p)
            w = cost.backward_memory(chunk_shapes[k], int(ckpt[k, p]))
            b0, b1 = spans[(p, Op("B", k))]
            deltas.append((spans[(p, Op("F", k))][0], 1, m))
            deltas.append((b0, 1, w))
            deltas.append((b1, 0, -m - w))  # frees sort before allocations at a tie
        deltas.sort(key=lambda x: (x[0], x[1]))
        times, values, cur = [start], [base], base
        for t, _, dm in deltas:
            cur += dm
            if times[-1] == t:
                values[-1] = cur
            else:
                times.append(t)
                values.append(cur)
        times_a, values_a = np.asarray(times), np.asarray(values)
        memory.append((times_a, values_a))
        peaks[p] = values_a.max()
        for t, v in zip(times_a, values_a):
            if v > budget:
                over.append((p, float(t), float(v)))
    events.sort(key=lambda e: (e.stage, e.start, EVENT_KINDS.index(e.kind)))
    return SimResult(
        events=events,
        makespan=makespan,
        iteration_time=makespan + cost.step_overhead(),
        stage_busy=busy,
        stage_recompute=recompute,
        bubble_ratio=float(bubble),
        memory=memory,
        peak_memory=peaks,
        memory_budget=budget,
        over_budget=over,
    )


def simulate_pipelines(
    pipelines: Sequence[tuple[Schedule, Sequence[ChunkShape], Optional[np.ndarray]]],
    cost: CostModel,
    mode: Literal["async", "ticks", "paired"] = "async",
) -> MultiSimResult:
    """Simulates pipelines that run concurrently (dp replicas, each ``(schedule, chunks, ckpt)``);
    the iteration ends with the slowest. Sequential 1F1B units of one pipeline are one schedule
    built with :func:`jvarlen.plan.schedule.sequential`."""
    if not pipelines:
        raise ValueError("simulate_pipelines needs at least one pipeline")
    results = [simulate(s, c, k, cost, mode) for s, c, k in pipelines]
    slowest = int(np.argmax([r.iteration_time for r in results]))
    return MultiSimResult(results, slowest, results[slowest].iteration_time)
