"""Iterations sampled ahead of training and planned in the background.

The EPP training path asks :class:`PlanFeed` for the next iteration: its documents in
``dp`` groups, one plan per group and the data-pipeline state *after* it (what a
checkpoint of that step must hold, since the sampler has already run ahead). With
``ahead > 0`` the next ``ahead`` iterations are sampled early and solved by a
:class:`jvarlen.plan.service.PlanningService` in worker processes while the current one
trains; a plan that is not ready when asked for is replaced by the service's fast
fallback (logged), unless ``wait`` is set. The first iteration always waits: nothing
trains yet that solving could overlap with, and a fallback plan of another shape would
cost an extra compilation. ``ahead = 0`` plans inline.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Optional

from jvarlen.data.packer import Piece
from jvarlen.layout import Layout
from jvarlen.plan.api import PlannerOptions, PlanningError, plan_iteration
from jvarlen.plan.cost import CostModel
from jvarlen.plan.plan import Plan
from jvarlen.plan.service import PlanningService


def group_documents(pipeline, sample, dp: int) -> list[list[Piece]]:
    """The sampled pieces in ``dp`` groups: pipeline ``g`` takes rows ``[g R/dp, (g+1) R/dp)``. Each
    piece keeps the token that follows it in its corpus document (the target of its last token)."""
    rows = pipeline.rows
    groups: list[list[Piece]] = [[] for _ in range(dp)]
    for pid, row in zip(sample.piece_ids, sample.rows):
        groups[int(row) * dp // rows].append(pipeline.piece(int(pid)))
    return groups


@dataclasses.dataclass
class Iteration:
    step: int
    groups: list  # dp lists of data.Piece (tokens + the target of the last token)
    data_state: dict  # data pipeline state after this iteration's sample
    plans: list = dataclasses.field(default_factory=list)
    plan_s: float = 0.0  # time the consumer spent obtaining the plans (waiting or planning)
    fallbacks: int = 0  # plans replaced by the fast fallback because the solver was late or failed


class PlanFeed:
    """Yields :class:`Iteration` s for steps ``start, start + 1, ..., end - 1`` in order."""

    def __init__(
        self,
        pipeline,
        layout: Layout,
        cost: CostModel,
        policy: str,
        options: PlannerOptions,
        start: int,
        end: int,
        *,
        ahead: int = 2,
        wait: bool = False,
        service: Optional[PlanningService] = None,
        say: Callable[[str], None] = lambda _: None,
    ):
        self.pipeline, self.layout, self.cost = pipeline, layout, cost
        self.policy, self.options, self.wait, self.say = policy, options, wait, say
        self.next_step, self.end, self.ahead = start, end, ahead
        self.first = True
        self.queue: collections.deque[Iteration] = collections.deque()
        if service is None and ahead > 0:
            service = PlanningService(cost, policy, options)
        self.service = service if ahead > 0 else None

    def _key(self, step: int, g: int) -> int:
        return step * self.layout.dp + g

    def _fill(self) -> None:
        while len(self.queue) <= self.ahead and self.next_step < self.end:
            sample = self.pipeline.sampler.next()
            groups = group_documents(self.pipeline, sample, self.layout.dp)
            for g, docs in enumerate(groups):
                if not docs:
                    raise PlanningError(f"pipeline {g} drew no documents (data.tokens_per_batch too small for dp?)")
                if self.service is not None:
                    self.service.submit(self._key(self.next_step, g), [len(d.tokens) for d in docs])
            self.queue.append(Iteration(self.next_step, groups, self.pipeline.state()))
            self.next_step += 1

    def next(self) -> Iteration:
        self._fill()
        if not self.queue:
            raise StopIteration("no iterations left")
        it = self.queue.popleft()
        start = time.perf_counter()
        for g, docs in enumerate(it.groups):
            lengths = [len(d.tokens) for d in docs]
            if self.service is None:
                plan = plan_iteration(lengths, cost=self.cost, policy=self.policy, options=self.options)
            else:
                plan = self.service.get(self._key(it.step, g), wait=self.wait or self.first)
                if plan.stats.get("service_source", "solver") != "solver":
                    it.fallbacks += 1
                    self.say(f"[jvarlen] step {it.step + 1} pipeline {g}: {plan.events[-1]}")
            plan.validate(lengths)
            it.plans.append(plan)
        it.plan_s = time.perf_counter() - start
        self.first = False
        self._fill()  # keep the service busy while this iteration trains
        return it

    def peek_plans(self) -> Optional[tuple[list[Plan], list]]:
        """(plans, groups) of the next iteration if the service has already solved all of them."""
        if self.service is None or not self.queue:
            return None
        it = self.queue[0]
        plans = [self.service.peek(self._key(it.step, g)) for g in range(len(it.groups))]
        return None if any(p is None for p in plans) else (plans, it.groups)

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
