"""The ``Plan`` of one iteration: chunks, 1F1B units, op order and recomputation table, as data.

A plan is everything the pipeline executor needs (docs/architecture.md, principle 1):
JSON-serialisable, versioned, and checked by :meth:`Plan.validate` — every token
exactly once, chunk well-formedness, slice order, 1F1B dependencies and per-stage
peak memory within the budget under the cost model (Eq. 6-10).

Pure Python/numpy: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.json_file import JsonFile
from jvarlen.plan.schedule import Op, Schedule, ScheduleError
from jvarlen.plan.units import Piece, PlannedChunk

PLAN_VERSION = 1


class PlanError(ValueError):
    """A plan breaks an invariant; the message lists every violation found."""


def part_schedule(schedule: Schedule, first: int, end: int) -> Schedule:
    """The ops of chunks ``first..end-1`` of ``schedule``, in order, renumbered from 0 (a part of a
    plan, :attr:`Plan.parts`)."""
    stages = tuple(
        tuple(Op(op.kind, op.chunk - first) for op in prog if first <= op.chunk < end) for prog in schedule.stages
    )
    prev = tuple(j - first if j >= 0 else -1 for j in schedule.chunk_prev[first:end])
    return Schedule(stages, prev)


def part_ranges(parts: Sequence[int], n_chunks: int) -> list[tuple[int, int]]:
    """``[(first chunk, end)]`` of each of ``parts`` (chunk counts; ``()``: one part of ``n_chunks``)."""
    sizes = tuple(parts) or (n_chunks,)
    ends = np.cumsum(sizes).tolist()
    return [(int(e - n), int(e)) for n, e in zip(sizes, ends)]


def chunk_prev_of(chunks: Sequence[PlannedChunk], lengths: Sequence[int]) -> list[int]:
    """Token-level links: ``prev[k]`` = the chunk holding the slice right before chunk k's first piece, or -1."""
    where: dict[tuple[int, int], int] = {}  # (doc, end) -> chunk
    for k, c in enumerate(chunks):
        doc, start, length = c.pieces[0]
        where[(doc, start + length)] = k
    prev = []
    for c in chunks:
        doc, start, _ = c.pieces[0]
        prev.append(where.get((doc, start), -1) if start > 0 else -1)
    return prev


@dataclasses.dataclass
class Plan(JsonFile):
    """One iteration's plan.

    * ``lengths [n_docs]``: the document lengths (tokens) the plan was made for.
    * ``chunks``: n chunks in execution (forward) order, each a tuple of pieces
      ``(doc, start, length)``; ``pieces[0]`` may continue a split document.
    * ``unit_sizes [n_units]``: units are consecutive runs of chunks, each one 1F1B pipeline.
    * ``schedule``: per-stage op programs over global chunk ids (units back to back).
    * ``ckpt_layers [n, pp]`` int32: layers stage p recomputes for chunk k.
    * ``stats``: solver and simulator figures (solve_seconds, iteration_time_s, ...).
    * ``events``: notable things that happened while planning (fallbacks, perturbations).
    * ``parts``: chunk counts of the step's *parts*, consecutive runs of the chunks (``pp = 1``
      only): each part runs as its own executor step, padded to its own bucket, one after the
      other from the same gradient accumulators (docs/design/bucket-parts.md); ``()``: one part.
    """

    policy: str
    layout: Layout
    num_layers: int
    lengths: tuple[int, ...]
    chunks: tuple[tuple[Piece, ...], ...]
    unit_sizes: tuple[int, ...]
    schedule: Schedule
    ckpt_layers: np.ndarray
    memory_budget_bytes: float
    stats: dict = dataclasses.field(default_factory=dict)
    events: list = dataclasses.field(default_factory=list)
    version: int = PLAN_VERSION
    parts: tuple[int, ...] = ()

    # ---- views
    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    @property
    def planned_chunks(self) -> list[PlannedChunk]:
        return [PlannedChunk(tuple(c)) for c in self.chunks]

    def chunk_shapes(self) -> list[ChunkShape]:
        return [c.shape(self.lengths) for c in self.planned_chunks]

    def part_ranges(self) -> list[tuple[int, int]]:
        """``[(first chunk, end)]`` of each part (one range without parts)."""
        return part_ranges(self.parts, self.n_chunks)

    def part_plans(self) -> list["Plan"]:
        """The parts as plans of their own (the same documents; each its chunks, in order, its
        recomputation and its stages' ops renumbered); ``[self]`` without parts."""
        if not self.parts:
            return [self]
        out, units = [], np.cumsum((0,) + tuple(self.unit_sizes)).tolist()
        for a, b in self.part_ranges():
            cuts = sorted({a, b} | {u for u in units if a < u < b})
            out.append(
                dataclasses.replace(
                    self,
                    chunks=self.chunks[a:b],
                    unit_sizes=tuple(y - x for x, y in zip(cuts, cuts[1:])),
                    schedule=part_schedule(self.schedule, a, b),
                    ckpt_layers=np.asarray(self.ckpt_layers)[a:b],
                    stats={},
                    events=[],
                    parts=(),
                )
            )
        return out

    @property
    def tokens_in(self) -> int:
        return int(sum(self.lengths))

    @property
    def tokens_planned(self) -> int:
        return int(sum(p[2] for c in self.chunks for p in c))

    # ---- JSON
    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "policy": self.policy,
            "layout": dataclasses.asdict(self.layout),
            "num_layers": self.num_layers,
            "lengths": list(self.lengths),
            "chunks": [[list(p) for p in c] for c in self.chunks],
            "unit_sizes": list(self.unit_sizes),
            "schedule": {
                "stages": [[str(op) for op in prog] for prog in self.schedule.stages],
                "chunk_prev": list(self.schedule.chunk_prev),
            },
            "ckpt_layers": np.asarray(self.ckpt_layers).tolist(),
            "memory_budget_bytes": self.memory_budget_bytes,
            "parts": list(self.parts),
            "stats": _jsonable(self.stats),
            "events": list(self.events),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Plan":
        if data.get("version") != PLAN_VERSION:
            raise PlanError(f"plan version {data.get('version')!r} is not supported (expected {PLAN_VERSION})")
        stages = tuple(tuple(Op(s[0], int(s[1:])) for s in prog) for prog in data["schedule"]["stages"])
        n = len(data["chunks"])
        ckpt = np.asarray(data["ckpt_layers"], dtype=np.int32).reshape(n, len(stages))
        return cls(
            policy=data["policy"],
            layout=Layout(**data["layout"]),
            num_layers=int(data["num_layers"]),
            lengths=tuple(int(x) for x in data["lengths"]),
            chunks=tuple(tuple(tuple(int(v) for v in p) for p in c) for c in data["chunks"]),
            unit_sizes=tuple(int(x) for x in data["unit_sizes"]),
            schedule=Schedule(stages, tuple(data["schedule"]["chunk_prev"])),
            ckpt_layers=ckpt,
            memory_budget_bytes=float(data["memory_budget_bytes"]),
            stats=dict(data.get("stats", {})),
            events=list(data.get("events", [])),
            version=int(data["version"]),
            parts=tuple(int(x) for x in data.get("parts", ())),
        )

    # ---- validation
    def validate(self, lengths: Sequence[int], cost: Optional[Any] = None) -> None:
        """Raises :class:`PlanError` listing every violation; memory is checked when ``cost`` is given."""
        errors = _check_tokens(self, [int(x) for x in lengths])
        if not errors:
            errors += _check_schedule(self)
        if not errors and cost is not None:
            errors += _check_memory(self, cost)
        if errors:
            raise PlanError(f"{len(errors)} problem(s) in plan ({self.policy}): " + "; ".join(errors[:20]))


def _check_tokens(plan: Plan, lengths: list[int]) -> list[str]:
    errors = []
    if plan.version != PLAN_VERSION:
        errors.append(f"version {plan.version} != {PLAN_VERSION}")
    if list(plan.lengths) != lengths:
        errors.append("plan.lengths differ from the batch being validated")
    covered: dict[int, list[tuple[int, int]]] = {d: [] for d in range(len(lengths))}
    for k, chunk in enumerate(plan.chunks):
        if not chunk:
            errors.append(f"chunk {k} is empty")
            continue
        for i, (doc, start, length) in enumerate(chunk):
            if not 0 <= doc < len(lengths):
                errors.append(f"chunk {k}: piece {(doc, start, length)} names an unknown document")
                continue
            if length <= 0 or start < 0 or start + length > lengths[doc]:
                errors.append(
                    f"chunk {k}: piece {(doc, start, length)} is outside document {doc} (length {lengths[doc]})"
                )
                continue
            if i > 0 and (start != 0 or length != lengths[doc]):
                errors.append(f"chunk {k}: piece {i} {(doc, start, length)} is a slice; only the first piece may be")
            covered[doc].append((start, start + length))
    for doc, spans in covered.items():
        pos = 0
        for s, e in sorted(spans):
            if s != pos:
                kind = "overlap" if s < pos else "gap"
                errors.append(f"document {doc}: tokens {min(s, pos)}..{max(s, pos)} ({kind})")
            pos = max(pos, e)
        if pos != lengths[doc]:
            errors.append(f"document {doc}: tokens {pos}..{lengths[doc]} missing")
    if sum(plan.unit_sizes) != plan.n_chunks or any(u <= 0 for u in plan.unit_sizes):
        errors.append(f"unit_sizes {list(plan.unit_sizes)} do not partition {plan.n_chunks} chunks")
    if plan.parts and (sum(plan.parts) != plan.n_chunks or min(plan.parts) <= 0):
        errors.append(f"parts {list(plan.parts)} do not partition {plan.n_chunks} chunks")
    elif plan.parts and plan.layout.pp != 1:
        errors.append(f"parts need one stage, the layout has pp={plan.layout.pp}")
    return errors


def _check_parts(plan: Plan) -> list[str]:
    """Each part runs alone: its ops come before the next part's, and no slice continues a
    document from an earlier part."""
    errors = []
    part_of = np.repeat(np.arange(len(plan.parts)), plan.parts)
    for p, prog in enumerate(plan.schedule.stages):
        order = [int(part_of[op.chunk]) for op in prog]
        if order != sorted(order):
            errors.append(f"stage {p}: the ops of the parts interleave")
    for k, j in enumerate(plan.schedule.chunk_prev):
        if j >= 0 and part_of[j] != part_of[k]:
            errors.append(f"chunk {k} continues chunk {j} of another part")
    return errors


def _check_schedule(plan: Plan) -> list[str]:
    errors = []
    sched = plan.schedule
    expected_prev = chunk_prev_of(plan.planned_chunks, plan.lengths)
    if list(sched.chunk_prev) != expected_prev:
        errors.append("schedule.chunk_prev does not link each slice to the chunk holding the previous slice")
    if sched.pp != plan.layout.pp:
        errors.append(f"schedule has {sched.pp} stages, layout.pp = {plan.layout.pp}")
    if sched.n_chunks != plan.n_chunks:
        errors.append(f"schedule covers {sched.n_chunks} chunks, plan has {plan.n_chunks}")
    if errors:
        return errors
    for p in range(sched.pp):  # slice order, stated explicitly (deadlock detection below implies it)
        fpos = {c: i for i, c in enumerate(sched.forward_order(p))}
        bpos = {c: i for i, c in enumerate(sched.backward_order(p))}
        for k, j in enumerate(expected_prev):
            if j >= 0 and j in fpos and k in fpos and fpos[j] > fpos[k]:
                errors.append(f"stage {p}: forward of chunk {k} precedes its earlier slice in chunk {j}")
            if j >= 0 and j in bpos and k in bpos and bpos[j] < bpos[k]:
                errors.append(f"stage {p}: backward of chunk {j} precedes its later slice's in chunk {k}")
    try:
        sched.validate()
    except ScheduleError as e:
        errors.append(f"schedule: {e}")
    if plan.parts:
        errors += _check_parts(plan)
    ckpt = np.asarray(plan.ckpt_layers)
    lps = plan.num_layers // plan.layout.pp
    if ckpt.shape != (plan.n_chunks, plan.layout.pp):
        errors.append(f"ckpt_layers shape {ckpt.shape} != {(plan.n_chunks, plan.layout.pp)}")
    elif ckpt.size and (ckpt.min() < 0 or ckpt.max() > lps):
        errors.append(f"ckpt_layers outside [0, {lps}]")
    return errors


def stage_peak_memory(plan: Plan, cost) -> np.ndarray:
    """``[pp]`` bytes per device: :func:`replay_peaks` of the plan's schedule and recomputation."""
    return replay_peaks(plan.chunk_shapes(), plan.schedule, np.asarray(plan.ckpt_layers), cost)


def replay_peaks(shapes: Sequence[ChunkShape], schedule: Schedule, ckpt: np.ndarray, cost) -> np.ndarray:
    """``[pp]`` peak bytes per device of each stage, replaying its op order: the model states, every
    chunk's activations (``cost.activation_memory``) from its forward to the end of its backward,
    and, while a backward runs, its transients (``cost.backward_memory``), ``ckpt[k, p]`` layers
    recomputed."""
    peaks = np.zeros(schedule.pp)
    for p, prog in enumerate(schedule.stages):
        cur = peak = cost.model_state_memory(p)
        for op in prog:
            layers = int(ckpt[op.chunk, p])
            m = cost.activation_memory(shapes[op.chunk], layers, p)
            if op.kind == "F":
                cur += m
                peak = max(peak, cur)
            else:
                peak = max(peak, cur + cost.backward_memory(shapes[op.chunk], layers))
                cur -= m
        peaks[p] = peak
    return peaks


def _check_memory(plan: Plan, cost) -> list[str]:
    peaks = stage_peak_memory(plan, cost)
    budget = cost.memory_budget
    return [
        f"stage {p}: peak memory {peaks[p] / 2**30:.2f} GiB > budget {budget / 2**30:.2f} GiB"
        for p in range(len(peaks))
        if peaks[p] > budget
    ]


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return x
