"""Iterations sampled (and planned) ahead of training, for every execution strategy.

The run loop asks :class:`IterationFeed` for the next :class:`Iteration`: its sampled pieces,
their rows, the documents of each plan, the plans a strategy's :class:`~jvarlen.runtime.strategy.Planner`
made for them, and the data-pipeline state *after* it (what a checkpoint of that step must
hold, since the sampler may have run ahead). With a planning service the next ``ahead``
iterations are sampled early and solved in worker processes while the current one trains; a
plan that is not ready when asked for is replaced by the service's fast fallback (logged),
unless the planner waits. The first iteration always waits: nothing trains yet that solving
could overlap with, and a fallback plan of another shape would cost an extra compilation.
Without a service, plans are made inline; a strategy without a planner gets none. In a run of
several processes each plan is solved by one of them and read by the others
(:class:`~jvarlen.runtime.plan_exchange.PlanExchange`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, NamedTuple, Optional

import numpy as np

from jvarlen.data.packer import Piece

WAIT_NOTE_S = 5.0  # say that the step waits for the planner when it waits longer than this


def idle_piece(like: Piece) -> Piece:
    """A one-token document without a target: no loss, no gradient. It stands in for the documents of
    a pipeline that an iteration has none for (an epoch's last batch may hold fewer pieces than
    there are pipelines), since every pipeline runs its plan in the same step."""
    return Piece(np.zeros(1, like.tokens.dtype), -1, -1)


def split_by_rows(dp: int, rows_per_batch: int) -> Callable:
    """``split(pieces, rows)`` for ``dp`` pipelines: pipeline ``g`` takes the pieces placed in rows
    ``[g R/dp, (g+1) R/dp)`` (each piece keeps the token that follows it in its document).

    A pipeline left without pieces (an epoch's last batch, best fit filling the first rows) takes
    the shortest piece of the pipeline holding the most, while one holds two or more; it fits,
    since a piece fits a row. With fewer pieces than pipelines the rest get an :func:`idle_piece`."""

    def split(pieces: list[Piece], rows: np.ndarray) -> list[list[Piece]]:
        groups: list[list[Piece]] = [[] for _ in range(dp)]
        for piece, row in zip(pieces, rows):
            groups[int(row) * dp // rows_per_batch].append(piece)
        for empty in [g for g in groups if not g]:
            donor = max(groups, key=len)
            if len(donor) > 1:
                shortest = min(range(len(donor)), key=lambda i: (len(donor[i].tokens), i))
                empty.append(donor.pop(shortest))
            else:
                empty.append(idle_piece(pieces[0]))
        return groups

    return split


class PlanKey(NamedTuple):
    """A plan's key in the planning service: plan ``plan`` of 0-based step ``step`` (named so in the
    service's messages; an int key ``step * 1024 + plan`` made plan 1024 of a step the next step's
    plan 0)."""

    step: int
    plan: int

    def __str__(self) -> str:
        return f"step {self.step + 1} plan {self.plan}"


@dataclasses.dataclass
class Iteration:
    step: int
    pieces: list  # the sampled data.Piece s (tokens + the target of the last token), in sample order
    rows: np.ndarray  # int [len(pieces)]: the packing row of each piece
    data_state: dict  # data pipeline state after this iteration's sample
    groups: list = dataclasses.field(default_factory=list)  # the documents of each plan
    plans: list = dataclasses.field(default_factory=list)
    plan_s: float = 0.0  # time the consumer spent obtaining the plans (waiting or planning)
    fallbacks: int = 0  # plans replaced by the fast fallback because the solver was late or failed
    fetched: int = 0  # plans another process solved (PlanExchange)

    @property
    def documents(self) -> int:
        """Distinct corpus documents (the pieces of one document count once)."""
        return len({p.doc_id for p in self.pieces})


class IterationFeed:
    """Yields :class:`Iteration` s for steps ``start, start + 1, ..., end - 1`` in order."""

    def __init__(
        self,
        pipeline,
        planner=None,
        start: int = 0,
        end: int = 0,
        *,
        ahead: int = 0,
        say: Callable[[str], None] = lambda _: None,
        exchange=None,
    ):
        """``exchange``: a :class:`~jvarlen.runtime.plan_exchange.PlanExchange` (several processes):
        this process solves only the plans it owns and reads the others'."""
        self.pipeline, self.planner, self.say = pipeline, planner, say
        self.exchange = exchange if planner is not None else None
        self.next_step, self.end = start, end
        self.service = planner.service if planner is not None else None
        self.ahead = ahead if self.service is not None else 0
        self.first = True
        self.queue: collections.deque[Iteration] = collections.deque()

    def _key(self, step: int, g: int) -> PlanKey:
        return PlanKey(step, g)

    def _fill(self) -> None:
        while len(self.queue) <= self.ahead and self.next_step < self.end:
            sample = self.pipeline.sampler.next()
            pieces = [self.pipeline.piece(int(p)) for p in sample.piece_ids]
            it = Iteration(self.next_step, pieces, np.asarray(sample.rows), self.pipeline.state())
            if self.planner is not None:
                it.groups = self.planner.split(pieces, it.rows)
                if self.service is not None:
                    for g, docs in enumerate(it.groups):
                        if self._mine(it.step, g, len(it.groups)):
                            self.service.submit(self._key(it.step, g), [len(d.tokens) for d in docs])
            self.queue.append(it)
            self.next_step += 1

    def next(self) -> Iteration:
        self._fill()
        if not self.queue:
            raise StopIteration("no iterations left")
        it = self.queue.popleft()
        start = time.perf_counter()
        n = len(it.groups)
        mine = [g for g in range(n) if self._mine(it.step, g, n)]
        plans = {}
        for g in mine:  # first, each published once solved: the other processes may be waiting on it
            if self.service is None:
                plans[g] = self.planner.solve([len(d.tokens) for d in it.groups[g]])
            else:
                plans[g] = self._solved(it.step, g)
            if self.exchange is not None:
                self.exchange.publish(it.step, g, plans[g])
        for g in range(n):
            if g not in plans:  # another process's
                plans[g] = self.exchange.fetch(it.step, g, n, self.say)
                it.fetched += 1
        for g, docs in enumerate(it.groups):
            lengths, plan = [len(d.tokens) for d in docs], plans[g]
            if plan.stats.get("service_source", "solver") != "solver":
                it.fallbacks += 1
                self.say(f"[jvarlen] step {it.step + 1} plan {g}: {plan.events[-1]}")
            plan.validate(lengths)
            if plan.stats.get("fits_memory") is False:  # a policy found no candidate within the budget
                why = f" ({plan.events[-1]})" if plan.events else ""
                self.say(
                    f"[jvarlen] step {it.step + 1} plan {g}: over the memory budget by the planner's account{why}; "
                    "the step may run out of device memory"
                )
            it.plans.append(plan)
        it.plan_s = time.perf_counter() - start
        self.first = False
        self._fill()  # keep the service busy while this iteration trains
        return it

    def _mine(self, step: int, g: int, plans: int) -> bool:
        """Whether this process solves plan ``g`` of ``step`` (always, with one process)."""
        return self.exchange is None or self.exchange.mine(step, g, plans)

    def _solved(self, step: int, g: int):
        key = self._key(step, g)
        wait = self.planner.wait or self.first
        if wait and not self.service.done(key, timeout_s=WAIT_NOTE_S):
            self.say(f"[jvarlen] step {step + 1}: waiting for the planner (more than {WAIT_NOTE_S:.0f} s so far)")
        return self.service.get(key, wait=wait)

    def peek(self) -> Optional[Iteration]:
        """The next iteration with its plans if the planning service has already solved all of them
        (for an ahead-of-time compile of its signature); None otherwise (and without a service)."""
        if not self.queue or self.service is None:
            return None
        it, n = self.queue[0], len(self.queue[0].groups)
        plans = [
            self.service.peek(self._key(it.step, g)) if self._mine(it.step, g, n) else self.exchange.peek(it.step, g)
            for g in range(n)
        ]
        if any(p is None for p in plans):
            return None
        return dataclasses.replace(it, plans=plans)
