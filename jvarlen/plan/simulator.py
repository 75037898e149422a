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
  (:func:`jvarlen.plan.chunk.executor_bucket` of the longest chunk), as the executor pads them.

In both lock-step modes every tick also costs ``CostModel.tick_overhead()`` (the executor's own
per-tick work: slot gathers and scatters, the ``ppermute`` pair, the switch), every op
``CostModel.op_overhead()``, and a recomputation ``CostModel.executor_recompute_time``; all are
fitted on executor steps (not charged in the async model).

Per op on stage ``p`` for chunk ``k``: ``F`` = forward compute then its all-to-all (Eq. 4);
``B`` = recomputation of ``ckpt_layers[k, p]`` layers (Eq. 11), backward compute, all-to-all;
with sharded stage weights each op then waits ``AG``, the gathers (and a backward's
reduce-scatters) its compute does not hide (``CostModel.weights_fwd_exposed`` / ``_bwd_``), and,
sharded over dp too, a plain backward in a step with fused ops also the gathers of the ascending
pass it runs without compute (``CostModel.weights_idle_pass``, paired mode); where the executor
splits the embedding and head by vocabulary, the first and the last stage's ops wait ``V``, their
collectives over sp (``CostModel.vocab_time``).
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

from jvarlen.plan.buffers import plan_tick_rows
from jvarlen.plan.chunk import ChunkShape, executor_bucket, executor_context
from jvarlen.plan.cost import CostModel
from jvarlen.plan.schedule import FUSED, FWD, IDLE, LANE_B, LANE_F, Schedule, dependencies

EVENT_KINDS = ("F", "B", "R", "A2A", "AG", "V", "P2P", "idle")


@dataclasses.dataclass(frozen=True)
class Event:
    stage: int
    kind: str  # one of EVENT_KINDS; "R" = recomputation, "AG" = exposed weight gathers, "V" = vocabulary
    # split collectives, "P2P" is drawn on the sender
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
    stage_busy: np.ndarray  # [pp] seconds of F + B + R + A2A + AG + V per stage
    stage_recompute: np.ndarray  # [pp] seconds of R per stage
    bubble_ratio: float  # 1 - sum(stage_busy) / (pp * makespan)
    memory: list[tuple[np.ndarray, np.ndarray]]
    peak_memory: np.ndarray  # [pp] bytes per device
    memory_budget: float
    # (stage, time, bytes) where memory > budget; None: simulated without memory (``memory=False``)
    over_budget: Optional[list[tuple[int, float, float]]]

    @property
    def fits(self) -> bool:
        if self.over_budget is None:
            raise ValueError("simulated with memory=False: the memory time line is not known")
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


class _Durations:
    """Per-op durations ``[(kind, seconds), ...]`` of one simulation, each chunk shape's cost terms
    asked of the cost model once per cost model (its ``op_terms`` memo: the planner's searches
    simulate the same chunks many times); an op's terms depend on its stage only through the last
    stage's head and the first stage's lookup (their collectives where the vocabulary is split)."""

    def __init__(self, cost: CostModel, shapes: Sequence[ChunkShape], extra: float, lockstep: bool):
        self.cost, self.shapes, self.extra, self.lockstep = cost, shapes, extra, lockstep
        self.last = cost.layout.pp - 1
        self.memo: dict = cost.op_terms

    def __call__(self, stage: int, kind: str, k: int, layers: int) -> list[tuple[str, float]]:
        chunk = self.shapes[k]
        key = (kind, chunk, stage == self.last, stage == 0, layers, self.extra, self.lockstep)
        got = self.memo.get(key)
        if got is None:
            cost, extra = self.cost, self.extra
            a2a = cost.alltoall_time(chunk)
            if kind == "F":
                got = [("F", cost.fwd_compute_time(chunk, stage) + extra), ("A2A", a2a)]
                got.append(("AG", cost.weights_fwd_exposed(chunk)))
                got.append(("V", cost.vocab_time(chunk, stage, False)))
            else:
                redo = cost.executor_recompute_time if self.lockstep else cost.recompute_time
                got = [("R", redo(chunk, layers)), ("B", cost.bwd_compute_time(chunk, stage) + extra), ("A2A", a2a)]
                got.append(("AG", cost.weights_bwd_exposed(chunk)))
                got.append(("V", cost.vocab_time(chunk, stage, True)))
            self.memo.put(key, got)
        return got


def simulate(
    schedule: Schedule,
    chunk_shapes: Sequence[ChunkShape],
    ckpt_layers: Optional[np.ndarray],
    cost: CostModel,
    mode: Literal["async", "ticks", "paired"] = "async",
    validate: bool = True,
    timeline: bool = True,
    memory: bool = True,
) -> SimResult:
    """Simulates one pipeline. ``ckpt_layers``: int array ``[n_chunks, pp]`` of recomputed layers
    per chunk and stage (None = no recomputation). ``validate=False`` skips the schedule check
    (for callers that re-simulate an already validated schedule many times). ``timeline=False``
    leaves :attr:`SimResult.events` empty (the planner reads times and memory only);
    ``memory=False`` skips the memory time line (``memory`` empty, ``peak_memory`` NaN,
    ``fits`` unknown: for the planner's searches that compare times only, about a third of a
    simulation's CPU)."""
    memory_on = memory  # the name is the result's memory time line below
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
        cost = cost.padded(executor_bucket(max(c.tokens for c in chunk_shapes), cost.layout.sp))

    # start and end of F(k) and B(k) on each stage: begin[side][p][k], end[side][p][k], side 0 = F, 1 = B
    begin = [[[None] * n for _ in range(pp)] for _ in range(2)]
    end = [[[None] * n for _ in range(pp)] for _ in range(2)]
    events: list[Event] = []
    busy, recompute = [0.0] * pp, [0.0] * pp
    emitted: list[tuple[int, str, int]] = []  # (stage, kind, chunk) in the order they ran (async timeline)
    layers_of = ckpt.tolist()

    op_extra = cost.op_overhead() if mode != "async" else 0.0
    context = executor_context(chunk_shapes, cost.pad_to) if mode == "paired" else 0
    tick_extra = cost.tick_overhead(context) if mode != "async" else 0.0
    durations = _Durations(cost, chunk_shapes, op_extra, mode != "async")

    def emit(stage: int, kind: str, k: int, start: float, recompute_layers: bool = True, wait: float = 0.0) -> float:
        t = start
        terms = durations(stage, kind, k, layers_of[k][stage] if recompute_layers and kind == "B" else 0)
        for what, d in terms + [("AG", wait)] if wait else terms:
            if d > 0:
                if timeline:
                    events.append(Event(stage, what, k, t, t + d))
                took = (t + d) - t  # Event.duration (not d: the sums stay those of the events)
                busy[stage] += took
                if what == "R":
                    recompute[stage] += took
            t += d
        side = 0 if kind == "F" else 1
        begin[side][stage][k], end[side][stage][k] = start, t
        if timeline:
            emitted.append((stage, kind, k))
        return t

    def p2p(src: int, dst: int, chunk: int) -> float:
        return cost.p2p_time(chunk_shapes[chunk], min(src, dst))

    def send(stage: int, kind: str, k: int, t: float) -> float:
        """The P2P of ``kind``'s output leaving ``stage`` at ``t`` (0 when it leaves no stage)."""
        dst = stage + 1 if kind == "F" else stage - 1
        if not 0 <= dst < pp:
            return 0.0
        d = p2p(stage, dst, k)
        if timeline:
            events.append(Event(stage, "P2P", k, t, t + d))
        return d

    if mode == "async":
        free, pos = [0.0] * pp, [0] * pp
        total, placed = sum(len(p) for p in schedule.stages), 0
        while placed < total:
            progressed = False
            for p in range(pp):
                prog = schedule.stages[p]
                while pos[p] < len(prog):
                    op = prog[pos[p]]
                    k = op.chunk
                    deps = [(0 if d.kind == "F" else 1, q, d.chunk) for q, d in dependencies(schedule, p, op)]
                    if any(end[s][q][j] is None for s, q, j in deps):
                        break
                    ready = free[p]
                    for s, q, j in deps:
                        ready = max(ready, end[s][q][j] + (p2p(q, p, k) if q != p else 0.0))
                    free[p] = emit(p, op.kind, k, ready)
                    pos[p] += 1
                    placed += 1
                    progressed = True
            if not progressed:  # validate() rules this out
                raise RuntimeError("simulator made no progress")
        if timeline:
            for q, kind, k in emitted:
                send(q, kind, k, end[0 if kind == "F" else 1][q][k])
    elif mode == "ticks":
        t0 = 0.0
        for row in schedule.to_ticks().tolist():
            t0 += tick_extra  # the executor's own work of the tick (slot gathers, switches, ...)
            ends, sends = [], [0.0]
            for p in range(pp):
                code, k = row[p]
                if code == IDLE:
                    continue
                kind = "F" if code == FWD else "B"
                ends.append(emit(p, kind, k, t0))
                sends.append(send(p, kind, k, ends[-1]))
            t0 = max(ends, default=t0) + max(sends)
    elif mode == "paired":
        t0 = 0.0
        rows = plan_tick_rows(schedule, ckpt)  # fused as the executor fuses
        # sharded over dp, a plain backward also runs the fused ops' ascending pass (its gathers only)
        fused = any(row[p][LANE_B][0] == FUSED for row in rows for p in range(pp))
        idle_pass = cost.weights_idle_pass() if fused else 0.0
        for row in rows:
            t0 += tick_extra
            ends, sends = [], [0.0]
            for p in range(pp):
                t = t0
                for lane in (LANE_B, LANE_F):
                    code, k = row[p][lane]
                    if code == IDLE:
                        continue
                    if code == FUSED:  # F then B of one chunk, nothing recomputed
                        t = emit(p, "B", k, emit(p, "F", k, t), recompute_layers=False)
                        kind = "B"
                    else:
                        kind = "F" if code == FWD else "B"
                        t = emit(p, kind, k, t, wait=idle_pass if kind == "B" else 0.0)
                    sends.append(send(p, kind, k, t))
                ends.append(t)
            t0 = max(ends, default=t0) + max(sends)
    else:
        raise ValueError(f"mode must be 'async', 'ticks' or 'paired', got {mode!r}")

    start = (
        0.0 if mode != "async" else min(min(min(row) for row in side) for side in begin)
    )  # lock-step: the first tick
    makespan = max(max(max(row) for row in side) for side in end) - start
    if timeline:  # idle gaps per stage
        for p in range(pp):
            t = start
            for s, e in sorted(zip(begin[0][p] + begin[1][p], end[0][p] + end[1][p])):
                if s > t + 1e-15:
                    events.append(Event(p, "idle", -1, t, s))
                t = max(t, e)
            if start + makespan > t + 1e-15:
                events.append(Event(p, "idle", -1, t, start + makespan))
        events.sort(key=lambda e: (e.stage, e.start, EVENT_KINDS.index(e.kind)))
    busy_a = np.asarray(busy)
    bubble = 1.0 - busy_a.sum() / (pp * makespan) if makespan > 0 else 0.0

    memory, peaks, over = [], np.zeros(pp), []
    budget = cost.memory_budget
    if not memory_on:
        peaks, over = np.full(pp, np.nan), None
    for p in range(pp if memory_on else 0):
        base = cost.model_state_memory(p)
        at, flag, dm = [], [], []
        for k in range(n):
            layers = layers_of[k][p]
            m = cost.activation_memory(chunk_shapes[k], layers, p)
            w = cost.backward_memory(chunk_shapes[k], layers)
            at += (begin[0][p][k], begin[1][p][k], end[1][p][k])
            flag += (1, 1, 0)  # frees sort before allocations at a tie
            dm += (m, w, -m - w)
        order = np.lexsort((flag, at))  # stable: ties keep the order above
        times = np.concatenate([[start], np.asarray(at)[order]])
        values = np.cumsum(np.concatenate([[base], np.asarray(dm)[order]]))  # one sum at a time, in order
        last = np.append(times[1:] != times[:-1], True)  # of equal times the value after the last change
        times_a, values_a = times[last], values[last]
        memory.append((times_a, values_a))
        peaks[p] = values_a.max()
        over += [(p, float(times_a[i]), float(values_a[i])) for i in np.nonzero(values_a > budget)[0]]
    return SimResult(
        events=events,
        makespan=makespan,
        iteration_time=makespan + cost.step_overhead(),
        stage_busy=busy_a,
        stage_recompute=np.asarray(recompute),
        bubble_ratio=float(bubble),
        memory=memory,
        peak_memory=peaks,
        memory_budget=budget,
        over_budget=over,
    )


def lower_bound(
    chunk_shapes: Sequence[ChunkShape],
    cost: CostModel,
    mode: Literal["async", "ticks", "paired"] = "async",
    ckpt_layers: Optional[np.ndarray] = None,
) -> float:
    """A lower bound on :func:`simulate`'s ``iteration_time`` for these chunks under any valid
    schedule and recomputation, from the chunk shapes alone (the planner's searches skip a candidate
    chunking whose bound exceeds the best time found so far, before its checkpointing and schedule
    are solved); with ``ckpt_layers [n, pp]``, under any recomputation at least that (the
    executor-memory fit only raises it; a floor above 0 on the last stage keeps the chunk unfused
    there, and a fused chunk recomputes nothing, its floor 0). Per stage ``p``: its ops run one after
    another (``busy``, recomputing nothing or ``ckpt_layers``); its
    first op waits for some chunk's forwards on stages ``0..p-1`` (``fill``, the cheapest chunk's)
    and its last backward is followed by that chunk's backwards on ``p-1..0`` (``drain``); P2P
    counted as 0. Lock-step modes add ``tick_overhead`` per tick, at least ``n + 2(pp - 1)`` ticks
    in ``"paired"`` (the last stage runs one forward per tick after ``pp - 1`` ticks of fill, then
    ``pp - 1`` ticks of drain) and ``2n + 2(pp - 1)`` in ``"ticks"`` (one op per tick). Less a
    relative 1e-9: the simulator adds the same terms in another order, and where nothing overlaps
    the bound is the simulated time itself."""
    pp, n = cost.layout.pp, len(chunk_shapes)
    if n == 0:
        return cost.step_overhead()
    if mode == "paired" and cost.pad_to is None:
        cost = cost.padded(executor_bucket(max(c.tokens for c in chunk_shapes), cost.layout.sp))
    lockstep = mode != "async"
    durations = _Durations(cost, chunk_shapes, cost.op_overhead() if lockstep else 0.0, lockstep)

    def per_stage(kind: str) -> np.ndarray:
        """``[n, pp]`` raw sums of the terms (as the simulator advances its clock); the stages before
        the last share theirs where nothing is recomputed."""
        if ckpt_layers is not None and kind == "B":
            layers = np.asarray(ckpt_layers).tolist()
            return np.asarray(
                [[sum(d for _, d in durations(p, kind, k, layers[k][p])) for p in range(pp)] for k in range(n)]
            )
        inner, last = ([sum(d for _, d in durations(p, kind, k, 0)) for k in range(n)] for p in (0, pp - 1))
        return np.column_stack([inner] * (pp - 1) + [last])

    fwd, bwd = per_stage("F"), per_stage("B")
    fill = np.concatenate([[0.0], np.cumsum(fwd, axis=1)[:, :-1].min(axis=0)])
    drain = np.concatenate([[0.0], np.cumsum(bwd, axis=1)[:, :-1].min(axis=0)])
    makespan = float((fill + fwd.sum(axis=0) + bwd.sum(axis=0) + drain).max())
    if lockstep:
        ticks = (n if mode == "paired" else 2 * n) + 2 * (pp - 1)
        context = executor_context(chunk_shapes, cost.pad_to) if mode == "paired" else 0
        makespan += ticks * cost.tick_overhead(context)
    return (makespan + cost.step_overhead()) * (1 - 1e-9)


def simulate_in_parts(
    schedule: Schedule,
    chunk_shapes: Sequence[ChunkShape],
    ckpt_layers: Optional[np.ndarray],
    cost: CostModel,
    parts: Sequence[int],
    mode: Literal["async", "ticks", "paired"] = "async",
    validate: bool = True,
    timeline: bool = True,
    memory: bool = True,
) -> SimResult:
    """:func:`simulate` of a step in ``parts`` (:attr:`jvarlen.plan.plan.Plan.parts`, chunk counts):
    each part its own step (in ``"paired"`` mode padded to its own bucket), one after the other
    (:func:`one_after_another`)."""
    from jvarlen.plan.plan import part_ranges, part_schedule

    n = len(chunk_shapes)
    ckpt = np.zeros((n, cost.layout.pp), np.int64) if ckpt_layers is None else np.asarray(ckpt_layers)
    ranges = part_ranges(parts, n)
    sims = [
        simulate(part_schedule(schedule, a, b), chunk_shapes[a:b], ckpt[a:b], cost, mode, validate, timeline, memory)
        for a, b in ranges
    ]
    return one_after_another(sims, [a for a, _ in ranges], cost.step_overhead())


def one_after_another(results: Sequence[SimResult], offsets: Sequence[int], step_overhead: float) -> SimResult:
    """Steps run back to back on the same devices as one iteration (a plan's parts,
    docs/design/bucket-parts.md): their makespans add up, the step overhead is paid once, memory
    is each step's own time line in turn (unknown where a step's is, ``memory=False``);
    ``offsets[i]``: the first chunk id of step i."""
    start, events, memory, over = 0.0, [], [], []
    pp = len(results[0].peak_memory)
    with_memory = all(r.over_budget is not None for r in results)
    for r, k0 in zip(results, offsets):
        events += [dataclasses.replace(e, chunk=e.chunk + k0 if e.chunk >= 0 else -1, start=e.start + start,
                                       end=e.end + start) for e in r.events]  # fmt: skip
        over += [(p, t + start, b) for p, t, b in r.over_budget or ()]
        start += r.makespan
    for p in range(pp if with_memory else 0):
        times, values, t0 = [], [], 0.0
        for r in results:
            times.append(r.memory[p][0] - r.memory[p][0][0] + t0)
            values.append(r.memory[p][1])
            t0 += r.makespan
        memory.append((np.concatenate(times), np.concatenate(values)))
    busy = np.sum([r.stage_busy for r in results], axis=0)
    return SimResult(
        events=events,
        makespan=start,
        iteration_time=start + step_overhead,
        stage_busy=busy,
        stage_recompute=np.sum([r.stage_recompute for r in results], axis=0),
        bubble_ratio=float(1.0 - busy.sum() / (pp * start)) if start > 0 else 0.0,
        memory=memory,
        peak_memory=np.max([r.peak_memory for r in results], axis=0),
        memory_budget=results[0].memory_budget,
        over_budget=over if with_memory else None,
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
