"""The one CP-SAT setup of every planner model (checkpointing, FlexSP, Hydraulis' packing and
dispatch): limits, workers and seed, and the reproducible mode.

Each model has a deterministic-time limit, which makes its result independent of machine load,
and a wall-clock limit as a safety net. When the wall-clock limit binds (a loaded machine, a
stalled process) the result depends on timing. Processes of one distributed run must plan
exactly the same, and a run with ``plan.wait`` promises plans independent of load; their
planning runs in :func:`reproducible` mode: one worker per solve, and the wall-clock limit raised
to a safety net far above what the deterministic limit takes, so that only the latter stops a solve.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from ortools.sat.python import cp_model

REPRODUCIBLE_SAFETY_S = 120.0
_safety_s: Optional[float] = None  # set: reproducible mode (this process, or inside the context)


def set_reproducible(safety_s: Optional[float] = REPRODUCIBLE_SAFETY_S) -> None:
    """Reproducible mode for the rest of this process (a planning worker); None turns it off."""
    global _safety_s
    _safety_s = safety_s


@contextlib.contextmanager
def reproducible(safety_s: float = REPRODUCIBLE_SAFETY_S) -> Iterator[None]:
    """Reproducible mode inside the ``with`` block (planning inline in the trainer)."""
    before = _safety_s
    set_reproducible(safety_s)
    try:
        yield
    finally:
        set_reproducible(before)


def call_reproducibly(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in reproducible mode (picklable with ``functools.partial``)."""
    with reproducible():
        return fn(*args, **kwargs)


def solver(time_limit_s: float, deterministic_time: float, workers: int = 1, seed: int = 0) -> cp_model.CpSolver:
    """A CP-SAT solver with these limits, or, in reproducible mode, with one worker and the
    wall-clock limit raised to the safety net."""
    s = cp_model.CpSolver()
    if _safety_s is not None:
        time_limit_s, workers = max(float(time_limit_s), _safety_s), 1
    s.parameters.max_time_in_seconds = float(time_limit_s)
    s.parameters.max_deterministic_time = float(deterministic_time)
    s.parameters.num_workers = int(workers)
    s.parameters.random_seed = int(seed)
    return s


__all__ = ["REPRODUCIBLE_SAFETY_S", "call_reproducibly", "reproducible", "set_reproducible", "solver"]
