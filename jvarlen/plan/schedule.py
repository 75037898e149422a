"""Pipeline schedule tables: which op each stage runs, in which order (pure Python/numpy).

A :class:`Schedule` holds one :data:`StageProgram` (ordered ops) per stage plus the
token-level links between chunks: ``chunk_prev[k]`` is the chunk holding the previous
slice of the document that chunk ``k`` continues (``-1`` when ``k`` has context 0).
Dependencies (InfiniPipe §3.1.1, docs/architecture.md, "Token-level order"):

* ``F(k)`` on stage ``p`` needs ``F(k)`` on ``p-1`` (activations) and ``F(chunk_prev[k])`` on ``p``
  (the K/V of earlier slices);
* ``B(k)`` on stage ``p`` needs ``F(k)`` on ``p``, ``B(k)`` on ``p+1`` (cotangent) and ``B(j)`` on ``p``
  for the chunk ``j`` with ``chunk_prev[j] == k`` (dK/dV of the later slice).

The single-op tick form is an int32 array ``[ticks, stages, 2]`` of ``(op, chunk)`` with ``op``
in {IDLE=0, F=1, B=2} and ``chunk = -1`` when idle; a message sent at tick ``t`` is usable at
tick ``t + 1``. The pipeline executor runs the *paired* form ``[ticks, stages, 2 lanes, 2]``
(:func:`paired_ticks`): in one tick a stage runs lane 0 (a B, or on the last stage a FUSED
forward + backward of one chunk) and then lane 1 (an F), as in steady-state 1F1B.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Optional, Sequence

import numpy as np

IDLE, FWD, BWD = 0, 1, 2
FUSED = 3  # paired ticks only: F(k) and B(k) of one stage in one op (lane 0)
LANE_B, LANE_F = 0, 1  # lanes of a paired tick, run in this order
_CODE = {"F": FWD, "B": BWD}
_KIND = {FWD: "F", BWD: "B"}


class ScheduleError(ValueError):
    """A schedule is malformed or deadlocks; the message names tick/position, stage and chunk."""


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str  # "F" (forward) or "B" (backward, including any recomputation)
    chunk: int

    def __post_init__(self):
        if self.kind not in _CODE:
            raise ScheduleError(f"Op.kind must be 'F' or 'B', got {self.kind!r}")
        if self.chunk < 0:
            raise ScheduleError(f"Op.chunk must be >= 0, got {self.chunk}")

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}"


StageProgram = tuple[Op, ...]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """``stages[p]`` is stage ``p``'s ordered program; ``chunk_prev`` the token-level links.

    ``chunk_docs[k]`` (optional) lists the document ids packed into chunk ``k``, first the one
    whose slice is ``slices[0]``; only pictures use it.
    """

    stages: tuple[StageProgram, ...]
    chunk_prev: tuple[int, ...]
    chunk_docs: Optional[tuple[tuple[int, ...], ...]] = None

    def __post_init__(self):
        object.__setattr__(self, "stages", tuple(tuple(p) for p in self.stages))
        object.__setattr__(self, "chunk_prev", tuple(int(x) for x in self.chunk_prev))
        if self.chunk_docs is not None:
            object.__setattr__(self, "chunk_docs", tuple(tuple(int(d) for d in ds) for ds in self.chunk_docs))

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_prev)

    @functools.cached_property
    def chunk_next(self) -> tuple[int, ...]:
        """``next[k]``: the chunk continuing chunk k's split slice, or -1 (computed once: the tick
        table and the simulator ask for it per op)."""
        nxt = [-1] * self.n_chunks
        for k, j in enumerate(self.chunk_prev):
            if j >= 0:
                nxt[j] = k
        return tuple(nxt)

    @functools.cached_property
    def fusable(self) -> tuple[bool, ...]:
        """``[n]``: the last stage's program runs B(k) right after F(k) (:func:`paired_ticks` fuses them)."""
        last = self.stages[-1]
        pairs = {a.chunk for a, b in zip(last, last[1:]) if a.kind == "F" and b.kind == "B" and a.chunk == b.chunk}
        return tuple(k in pairs for k in range(self.n_chunks))

    def docs(self) -> tuple[tuple[int, ...], ...]:
        """Document ids per chunk; without ``chunk_docs`` a chain of linked chunks is one document."""
        if self.chunk_docs is not None:
            return self.chunk_docs
        root = []
        for k, j in enumerate(self.chunk_prev):
            root.append(root[j] if 0 <= j < k else k)
        return tuple((r,) for r in root)

    def forward_order(self, stage: int) -> list[int]:
        return [op.chunk for op in self.stages[stage] if op.kind == "F"]

    def backward_order(self, stage: int) -> list[int]:
        return [op.chunk for op in self.stages[stage] if op.kind == "B"]

    def f2b(self, stage: int) -> list[int]:
        """Eq. 16's f2b: position in the backward order of the chunk at each forward position."""
        pos = {c: i for i, c in enumerate(self.backward_order(stage))}
        return [pos[c] for c in self.forward_order(stage)]

    def validate(self) -> None:
        """Raises :class:`ScheduleError` naming the stage, position/tick and chunk at fault."""
        _check_links(self.chunk_prev)
        n = self.n_chunks
        if self.chunk_docs is not None and len(self.chunk_docs) != n:
            raise ScheduleError(f"chunk_docs has {len(self.chunk_docs)} entries for {n} chunks")
        if self.pp < 1:
            raise ScheduleError("a schedule needs at least one stage")
        for p, prog in enumerate(self.stages):
            seen_f: dict[int, int] = {}
            seen_b: dict[int, int] = {}
            for i, op in enumerate(prog):
                if op.chunk >= n:
                    raise ScheduleError(
                        f"stage {p}, position {i}: {op} names chunk {op.chunk} but there are {n} chunks"
                    )
                seen = seen_f if op.kind == "F" else seen_b
                if op.chunk in seen:
                    raise ScheduleError(f"stage {p}, position {i}: {op} repeats the op at position {seen[op.chunk]}")
                seen[op.chunk] = i
                if op.kind == "B" and op.chunk not in seen_f:
                    raise ScheduleError(f"stage {p}, position {i}: B{op.chunk} comes before F{op.chunk}")
            for k in range(n):
                if k not in seen_f:
                    raise ScheduleError(f"stage {p}: chunk {k} has no forward op")
                if k not in seen_b:
                    raise ScheduleError(f"stage {p}: chunk {k} has no backward op")
        self.to_ticks()  # raises on deadlock, naming tick, stage and chunk

    def to_ticks(self) -> np.ndarray:
        """Unit-time ASAP tick table ``[ticks, stages, 2]`` int32 of ``(op, chunk)``.

        Each op takes one tick; a cross-stage dependency finished at tick ``t`` allows the op at
        ``t + 1``. Raises :class:`ScheduleError` when no stage can make progress (deadlock).
        """
        return _ticks(self)

    @classmethod
    def from_ticks(
        cls, table: np.ndarray, chunk_prev: Sequence[int], chunk_docs: Optional[Sequence[Sequence[int]]] = None
    ) -> "Schedule":
        """Inverse of :meth:`to_ticks` (drops idle ticks); checks the tick order is feasible."""
        table = np.asarray(table)
        if table.ndim != 3 or table.shape[2] != 2:
            raise ScheduleError(f"tick table must be [ticks, stages, 2], got shape {table.shape}")
        bad = np.argwhere(~np.isin(table[..., 0].T, (IDLE, FWD, BWD)))  # stage by stage, as programs are read
        if len(bad):
            raise ScheduleError(
                f"tick {bad[0][1]}, stage {bad[0][0]}: unknown op code {table[bad[0][1], bad[0][0], 0]}"
            )
        stages = [tuple(Op(_KIND[int(c)], int(k)) for c, k in table[:, p] if c != IDLE) for p in range(table.shape[1])]
        sched = cls(tuple(stages), tuple(chunk_prev), None if chunk_docs is None else tuple(map(tuple, chunk_docs)))
        sched.validate()
        _check_tick_table(table, sched)
        return sched

    def __str__(self) -> str:
        return "\n".join(f"stage {p}: " + " ".join(map(str, prog)) for p, prog in enumerate(self.stages))


# --------------------------------------------------------------------------- dependencies


def _check_links(chunk_prev: Sequence[int]) -> None:
    n = len(chunk_prev)
    succ: dict[int, int] = {}
    for k, j in enumerate(chunk_prev):
        if j < -1 or j >= n or j == k:
            raise ScheduleError(f"chunk {k}: chunk_prev = {j} is not -1 or another chunk id in [0, {n})")
        if j >= 0:
            if j in succ:
                raise ScheduleError(
                    f"chunks {succ[j]} and {k} both continue chunk {j}; a chunk holds at most one split slice"
                )
            succ[j] = k
    state = [0] * n  # cycles, each chunk walked once: 0 new, 1 on the current walk, 2 known to end
    for k in range(n):
        walk, j = [], k
        while j >= 0 and state[j] == 0:
            state[j] = 1
            walk.append(j)
            j = chunk_prev[j]
        if j >= 0 and state[j] == 1:
            raise ScheduleError(f"chunk {k}: chunk_prev links form a cycle")
        for w in walk:
            state[w] = 2


def dependencies(sched: Schedule, stage: int, op: Op) -> list[tuple[int, Op]]:
    """(stage, op) pairs that must finish before ``op`` runs on ``stage`` (program order aside)."""
    deps: list[tuple[int, Op]] = []
    k = op.chunk
    if op.kind == "F":
        if stage > 0:
            deps.append((stage - 1, Op("F", k)))
        if sched.chunk_prev[k] >= 0:
            deps.append((stage, Op("F", sched.chunk_prev[k])))
    else:
        deps.append((stage, Op("F", k)))
        if stage < sched.pp - 1:
            deps.append((stage + 1, Op("B", k)))
        nxt = sched.chunk_next[k]
        if nxt >= 0:
            deps.append((stage, Op("B", nxt)))
    return deps


def _progress(sched: Schedule, never: int):
    """(done_f, done_b, ready_f, ready_b): ``[pp][n]`` ticks F(k), B(k) ran (``never`` before) and
    :func:`dependencies` met before tick ``t`` (``ready_x(p, k, t)``), on lists (Op dicts: 10x slower)."""
    pp, n, last = sched.pp, sched.n_chunks, sched.pp - 1
    prev, nxt = sched.chunk_prev, sched.chunk_next
    done_f, done_b = [[never] * n for _ in range(pp)], [[never] * n for _ in range(pp)]

    def ready_f(p: int, k: int, t: int) -> bool:  # the previous stage, the previous slice
        return (p == 0 or done_f[p - 1][k] < t) and (prev[k] < 0 or done_f[p][prev[k]] < t)

    def ready_b(p: int, k: int, t: int) -> bool:  # its forward, the next stage, the next slice
        return done_f[p][k] < t and (p == last or done_b[p + 1][k] < t) and (nxt[k] < 0 or done_b[p][nxt[k]] < t)

    return done_f, done_b, ready_f, ready_b


def _table(placed: list, shape: tuple) -> np.ndarray:
    """int32 ``[*shape, 2]`` of ``(op, chunk)``, idle but where ``placed`` (index..., op, chunk) puts an op."""
    table = np.tile(np.array([IDLE, -1], np.int32), shape + (1,))
    if placed:
        *index, op, chunk = np.array(placed, np.int32).T
        table[tuple(index)] = np.stack([op, chunk], axis=1)
    return table


def _ticks(sched: Schedule) -> np.ndarray:
    pp, total, pos, placed, t = sched.pp, sum(len(p) for p in sched.stages), [0] * sched.pp, [], 0
    done_f, done_b, ready_f, ready_b = _progress(sched, total + 1)  # placed: (tick, stage, op, chunk)
    while len(placed) < total:
        ran = [
            (p, op)
            for p, op in ((p, sched.stages[p][pos[p]]) for p in range(pp) if pos[p] < len(sched.stages[p]))
            if (ready_f if op.kind == "F" else ready_b)(p, op.chunk, t)
        ]
        if not ran:
            waiting = []
            for p in range(pp):
                if pos[p] < len(sched.stages[p]):
                    op = sched.stages[p][pos[p]]
                    missing = [
                        f"{o} on stage {q}"
                        for q, o in dependencies(sched, p, op)
                        if (done_f if o.kind == "F" else done_b)[q][o.chunk] > t
                    ]
                    waiting.append(f"stage {p} waits at {op} (chunk {op.chunk}) for {', '.join(missing)}")
            raise ScheduleError(f"deadlock at tick {t}: " + "; ".join(waiting))
        for p, op in ran:
            done = done_f if op.kind == "F" else done_b
            if done[p][op.chunk] <= total:  # a program that repeats an op (validate() names its position)
                raise ScheduleError(f"stage {p}: {op} (chunk {op.chunk}) runs twice")
            done[p][op.chunk] = t
            placed.append((t, p, _CODE[op.kind], op.chunk))
            pos[p] += 1
        t += 1
    return _table(placed, (t, pp))


def paired_ticks(sched: Schedule, fuse_last: bool = True, keep: Optional[Sequence[bool]] = None) -> np.ndarray:
    """The executor's paired tick table ``[ticks, pp, 2, 2]`` int32 of ``(op, chunk)`` per lane.

    ASAP, one tick at a time; a stage takes in one tick at most one backward (lane 0, run first)
    and one forward (lane 1). Backwards keep their program order and so do forwards; a backward
    whose dependencies are met may run before forwards that precede it in the stage's program,
    but a forward never runs before a backward that precedes it, so a stage never holds more
    chunks in flight than its program does (the memory bound and the slot count are kept).
    ``fuse_last``: on the last stage an F(k) directly followed by B(k) in its program runs as one
    ``FUSED`` op in lane 0 (the stage needs nothing from another stage in between; such a chunk
    never continues into a later slice, so it stores no K/V context and no residuals). Every such
    chunk is fused: its forward is never started alone in lane 1 (its backward could not run
    before the next tick, where the fused op ends at the same time), so the table has as many
    ticks as without the rule.
    ``keep [n]`` (bool): chunks never fused (a plan's: :func:`jvarlen.plan.buffers.kept_apart`).
    A dependency met at tick ``t`` allows the op at ``t + 1`` (messages are filed at the end of a
    tick), as in :meth:`Schedule.to_ticks`.
    """
    pp, n, last = sched.pp, sched.n_chunks, sched.pp - 1
    f_queue = [[op.chunk for op in prog if op.kind == "F"] + [-1] for prog in sched.stages]  # -1: done
    b_queue = [[op.chunk for op in prog if op.kind == "B"] + [-1] for prog in sched.stages]
    pos_f, pos_b = [[-1] * n for _ in range(pp)], [[-1] * n for _ in range(pp)]
    for p, prog in enumerate(sched.stages):
        for i, op in enumerate(prog):
            (pos_f if op.kind == "F" else pos_b)[p][op.chunk] = i
    remaining = sum(len(prog) for prog in sched.stages)
    done_f, done_b, ready_f, ready_b = _progress(sched, remaining + 1)  # never: every tick runs an op
    fusable = [fuse_last and f and (keep is None or not keep[k]) for k, f in enumerate(sched.fusable)]

    fi, bi, t = [0] * pp, [0] * pp, 0
    placed: list[tuple[int, int, int, int, int]] = []  # (tick, stage, lane, op, chunk): one array at the end
    while remaining:
        ran = 0  # ops done at t are never "< t": updating at once is updating after the tick
        for p in range(pp):
            nf, nb = f_queue[p][fi[p]], b_queue[p][bi[p]]
            fuse = p == last and nf >= 0 and fusable[nf]
            if fuse and nb == nf and ready_f(p, nf, t):
                placed.append((t, p, LANE_B, FUSED, nf))
                done_f[p][nf] = done_b[p][nb] = t
                fi[p], bi[p], ran = fi[p] + 1, bi[p] + 1, ran + 2
                nf, nb = f_queue[p][fi[p]], b_queue[p][bi[p]]
                fuse = p == last and nf >= 0 and fusable[nf]
            elif nb >= 0 and ready_b(p, nb, t):
                placed.append((t, p, LANE_B, BWD, nb))
                done_b[p][nb] = t
                bi[p], ran = bi[p] + 1, ran + 1
                nb = b_queue[p][bi[p]]
            # a fusable forward waits to run fused in lane 0 of a later tick (see the docstring)
            if nf >= 0 and (nb < 0 or pos_b[p][nb] > pos_f[p][nf]) and ready_f(p, nf, t) and not fuse:
                placed.append((t, p, LANE_F, FWD, nf))
                done_f[p][nf] = t
                fi[p], ran = fi[p] + 1, ran + 1
        if not ran:
            raise ScheduleError(f"deadlock at paired tick {t}")  # to_ticks() (validate) names the ops
        remaining, t = remaining - ran, t + 1
    return _table(placed, (t, pp, 2))


def lanes(table: np.ndarray) -> np.ndarray:
    """A single-op tick table ``[ticks, pp, 2]`` (codes IDLE/F/B/FUSED) in paired form
    ``[ticks, pp, 2, 2]``: B and FUSED in lane 0, F in lane 1, one op per stage and tick."""
    table = np.asarray(table, np.int32)
    out = np.tile(np.array([IDLE, -1], np.int32), table.shape[:2] + (2, 1))
    is_f = table[..., 0] == FWD
    out[..., LANE_F, :] = np.where(is_f[..., None], table, out[..., LANE_F, :])
    out[..., LANE_B, :] = np.where((table[..., 0] != IDLE)[..., None] & ~is_f[..., None], table, out[..., LANE_B, :])
    return out


def check_paired_table(table: np.ndarray, sched: Schedule) -> None:
    """Raises :class:`ScheduleError` unless the paired table runs exactly ``sched``'s ops, lane 0
    holding B/FUSED and lane 1 F, each after its dependencies (FUSED: F before B inside the op)."""
    table = np.asarray(table)
    if table.ndim != 4 or table.shape[2:] != (2, 2) or table.shape[1] != sched.pp:
        raise ScheduleError(f"paired tick table must be [ticks, {sched.pp}, 2, 2], got {table.shape}")
    when: dict[tuple[int, Op], tuple[int, int]] = {}  # (tick, phase): lane 0 before lane 1
    for t in range(table.shape[0]):
        for p in range(table.shape[1]):
            for lane in (LANE_B, LANE_F):
                code, k = int(table[t, p, lane, 0]), int(table[t, p, lane, 1])
                if code == IDLE:
                    continue
                if code not in ((FWD,) if lane == LANE_F else (BWD, FUSED)):
                    raise ScheduleError(f"tick {t}, stage {p}: op code {code} in lane {lane}")
                if code == FUSED and p != sched.pp - 1:
                    raise ScheduleError(f"tick {t}, stage {p}: FUSED only runs on the last stage")
                ops = [Op("F", k), Op("B", k)] if code == FUSED else [Op(_KIND[code], k)]
                for op in ops:
                    if (p, op) in when:
                        raise ScheduleError(f"tick {t}, stage {p}: {op} runs twice")
                    when[(p, op)] = (t, lane)
    for p, prog in enumerate(sched.stages):
        for op in prog:
            if (p, op) not in when:
                raise ScheduleError(f"stage {p}: {op} (chunk {op.chunk}) is missing from the paired table")
    for (p, op), (t, _lane) in when.items():
        for q, dep in dependencies(sched, p, op):
            dt, _ = when[(q, dep)]
            fused_pair = q == p and dep.chunk == op.chunk and int(table[t, p, LANE_B, 0]) == FUSED
            if dt >= t and not fused_pair:
                raise ScheduleError(
                    f"tick {t}, stage {p}: {op} (chunk {op.chunk}) runs before {dep} on stage {q} finished"
                )


def _check_tick_table(table: np.ndarray, sched: Schedule) -> None:
    when: dict[tuple[int, Op], int] = {}
    for t in range(table.shape[0]):
        for p in range(table.shape[1]):
            code, chunk = int(table[t, p, 0]), int(table[t, p, 1])
            if code != IDLE:
                when[(p, Op(_KIND[code], chunk))] = t
    for (p, op), t in when.items():
        for d in dependencies(sched, p, op):
            if when[d] >= t:
                raise ScheduleError(
                    f"tick {t}, stage {p}: {op} (chunk {op.chunk}) runs before {d[1]} on stage {d[0]} finished"
                )


# --------------------------------------------------------------------------- builders


def _backward_order(chunk_prev: Sequence[int]) -> list[int]:
    """Seq1F1B order: documents in forward order, the slices of one document in reverse."""
    nxt = {j: k for k, j in enumerate(chunk_prev) if j >= 0}
    order = []
    for k in (k for k, j in enumerate(chunk_prev) if j < 0):
        chain = [k]
        while chain[-1] in nxt:
            chain.append(nxt[chain[-1]])
        order.extend(reversed(chain))
    return order


def gpipe(n_chunks: int, pp: int, chunk_prev: Optional[Sequence[int]] = None, chunk_docs=None) -> Schedule:
    """GPipe: every stage runs all forwards in chunk order, then all backwards in reverse order."""
    prev = tuple(chunk_prev) if chunk_prev is not None else (-1,) * n_chunks
    _check_sizes(n_chunks, pp, prev)
    prog = tuple([Op("F", k) for k in range(n_chunks)] + [Op("B", k) for k in reversed(range(n_chunks))])
    sched = Schedule(tuple(prog for _ in range(pp)), prev, chunk_docs)
    sched.validate()
    return sched


def token_level_1f1b(chunk_prev: Sequence[int], pp: int, chunk_docs=None) -> Schedule:
    """1F1B over chunks in index order with Seq1F1B's token-level backward order.

    Forwards run in chunk order (a slice after the slices it continues: needs
    ``chunk_prev[k] < k``); backwards run documents in order and each document's slices in
    reverse. Before its ``i``-th backward, stage ``p`` has run
    ``pp - p - 1 + max(i + 1, need_i)`` forwards (capped at n), where ``need_i`` is one past
    the latest forward position among the first ``i+1`` backwards. With no links this is
    DAPPLE's 1F1B (warm-up of ``pp - p - 1`` forwards); with a document split into
    ``N_prefill`` slices the window is Eq. 7's ``d_p - p + N_prefill`` (p 1-indexed).
    """
    prev = tuple(int(x) for x in chunk_prev)
    n = len(prev)
    _check_sizes(n, pp, prev)
    for k, j in enumerate(prev):
        if j >= k:
            raise ScheduleError(f"chunk {k}: token_level_1f1b needs chunk_prev[k] < k, got {j}")
    border = _backward_order(prev)
    stages = []
    for p in range(pp):
        prog: list[Op] = []
        f_done, need = 0, 0
        for i, b in enumerate(border):
            need = max(need, b + 1)
            target = min(n, pp - p - 1 + max(i + 1, need))
            while f_done < target:
                prog.append(Op("F", f_done))
                f_done += 1
            prog.append(Op("B", b))
        stages.append(tuple(prog))
    sched = Schedule(tuple(stages), prev, chunk_docs)
    sched.validate()
    return sched


def one_f_one_b(n_chunks: int, pp: int, chunk_docs=None) -> Schedule:
    """DAPPLE 1F1B: stage p warms up with ``pp - p - 1`` forwards, then alternates F and B."""
    return token_level_1f1b((-1,) * n_chunks, pp, chunk_docs)


def sequential(units: Iterable[Schedule]) -> Schedule:
    """Runs several pipelines (e.g. InfiniPipe's 1F1B units of Eq. 14) one after another on the
    same stages; chunk ids of unit ``u`` are offset by the chunk counts of the units before it."""
    units = list(units)
    if not units:
        raise ScheduleError("sequential() needs at least one schedule")
    pp = units[0].pp
    stages: list[list[Op]] = [[] for _ in range(pp)]
    prev: list[int] = []
    docs: list[tuple[int, ...]] = []
    offset = doc_offset = 0
    for u in units:
        if u.pp != pp:
            raise ScheduleError(f"sequential(): all units need the same pp, got {u.pp} and {pp}")
        for p in range(pp):
            stages[p].extend(Op(op.kind, op.chunk + offset) for op in u.stages[p])
        prev.extend(j + offset if j >= 0 else -1 for j in u.chunk_prev)
        udocs = u.docs()
        docs.extend(tuple(d + doc_offset for d in ds) for ds in udocs)
        doc_offset += 1 + max((d for ds in udocs for d in ds), default=-1)
        offset += u.n_chunks
    sched = Schedule(tuple(map(tuple, stages)), tuple(prev), tuple(docs))
    sched.validate()
    return sched


def _check_sizes(n: int, pp: int, prev: Sequence[int]) -> None:
    if n < 1 or pp < 1:
        raise ScheduleError(f"need n_chunks >= 1 and pp >= 1, got n_chunks={n}, pp={pp}")
    if len(prev) != n:
        raise ScheduleError(f"chunk_prev has {len(prev)} entries for {n} chunks")
    _check_links(prev)
