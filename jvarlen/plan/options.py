"""The planner's options and its error, shared by :mod:`jvarlen.plan.api` and the EPP search
(:mod:`jvarlen.plan.epp`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from jvarlen.plan.checkpointing import SolverOptions

# execution models of PlannerOptions.simulation: InfiniPipe's async events, lock-step ticks with one
# op per stage, the executor's paired ticks (a backward and a forward per stage and tick)
SIMULATIONS = ("async", "ticks", "paired")
LOCKSTEP = ("ticks", "paired")


class PlanningError(RuntimeError):
    """No plan of the requested policy fits (e.g. a document too long for any chunking)."""


class SlowerThanCeiling(PlanningError):
    """No plan of the batch is faster than the ``ceiling`` the caller passed (it has a faster one)."""


@dataclasses.dataclass(frozen=True)
class PlannerOptions:
    """Knobs of :func:`jvarlen.plan.api.plan_iteration`.

    ``n_slices``: fix Alg. 1's N (None: tune over at most ``n_candidates`` values
    of :func:`jvarlen.plan.epp.slice_candidates`). ``min_slice_tokens``: the finest average slice a split
    document is cut into (4096 here, the paper-scale default: finer chunks lose GPU efficiency,
    InfiniPipe App. B; the training config's ``plan.min_slice_tokens`` passes its own, 512 by default,
    for the short documents of its CPU-sized runs). ``solver``: limits of each checkpointing MILP. ``chunk_tokens``: candidate
    fixed chunk sizes for seq1f1b-tuned / wo-wbc (the best simulated one is used).
    ``seq1f1b_chunk_tokens`` / ``seq1f1b_reference_context``: the paper-protocol
    Seq1F1B baseline's fixed chunk size and the context its uniform recomputation is
    sized for (InfiniPipe §5.1: "checkpointing configurations optimized for 96K").
    ``simulation``: the execution model candidates are simulated in and the plan's
    ``iteration_time_s`` is reported for: ``"async"`` (InfiniPipe's simulator: a stage starts an
    op as soon as its inputs are ready), ``"ticks"`` (lock-step, every stage runs one op per tick,
    a tick lasts as long as its slowest op) or ``"paired"`` (jvarlen's pipeline executor: lock-step
    ticks in which a stage runs a backward and a forward, the last stage's adjacent F and B fused).
    ``gpipe_units`` (EPP policies, with a lock-step ``simulation`` only): a unit runs in GPipe order
    where the lock-step simulation says that is faster and it fits memory
    (:func:`jvarlen.plan.grouping.lockstep_order`); the baselines keep their schedules.
    ``prune`` (EPP policies): a candidate chunking whose lower bound
    (:func:`jvarlen.plan.simulator.lower_bound`) exceeds the best time found so far is not
    checkpointed, ordered or simulated (:func:`jvarlen.plan.epp.plan_epp`); False simulates every
    candidate the search visits.
    """

    n_slices: Optional[int] = None
    n_candidates: int = 3
    n_ratio: float = 2.0
    min_slice_tokens: int = 4096
    solver: SolverOptions = SolverOptions()
    chunk_tokens: tuple[int, ...] = (4096, 8192, 16384, 32768)
    seq1f1b_chunk_tokens: int = 8192
    seq1f1b_reference_context: int = 96 * 1024
    simulation: str = "async"
    gpipe_units: bool = True
    prune: bool = True

    def __post_init__(self):
        if self.simulation not in SIMULATIONS:
            raise ValueError(f"simulation must be one of {SIMULATIONS}, got {self.simulation!r}")
        positive = dict(
            n_candidates=self.n_candidates,
            min_slice_tokens=self.min_slice_tokens,
            seq1f1b_chunk_tokens=self.seq1f1b_chunk_tokens,
            seq1f1b_reference_context=self.seq1f1b_reference_context,
            n_slices=1 if self.n_slices is None else self.n_slices,
            chunk_tokens=min(self.chunk_tokens, default=0),
        )
        bad = [k for k, v in positive.items() if v < 1]
        if bad:
            raise ValueError(f"PlannerOptions: {', '.join(f'{k}={getattr(self, k)}' for k in bad)} must be >= 1")


__all__ = ["LOCKSTEP", "SIMULATIONS", "PlannerOptions", "PlanningError", "SlowerThanCeiling"]
