"""Background planning service (InfiniPipe §3.3.4 "pre-solving"; docs/architecture.md, principle 6).

The producer (fed by the sampler) submits the document lengths of upcoming
iterations; worker processes solve them with the full policy while training runs.
The consumer asks for iteration i's plan and never waits for a solver: if the plan
is not ready (or its worker failed) it gets a fast fallback plan computed on the
spot (``epp-fast``: no N tuning, greedy checkpointing) and the event is logged.

Determinism: every plan is a pure function of (lengths, cost, policy, options).
CP-SAT runs with one worker and a fixed seed, and :func:`deterministic_options`
makes the deterministic-time limit the binding one (the wall-clock limit is only a
safety net), so a solved plan does not depend on machine load. Every fallback is logged
(the latest :data:`EVENTS_KEPT` are in :attr:`PlanningService.events`, and each plan says so in
its stats and events); replaying with ``wait=True`` reproduces a run exactly.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Hashable, Iterable, Iterator, Optional, Sequence

from jvarlen.plan import cpsat
from jvarlen.plan.api import PlannerOptions, PlanningError, plan_iteration
from jvarlen.plan.checkpointing import SolverOptions
from jvarlen.plan.plan import Plan

log = logging.getLogger(__name__)


def deterministic_options(options: PlannerOptions = PlannerOptions(), safety_s: float = 30.0) -> PlannerOptions:
    """``options`` with the MILP's wall-clock limit raised to a safety net, so that only the
    deterministic-time limit can stop CP-SAT (results independent of machine load)."""
    solver = dataclasses.replace(options.solver, time_limit_s=safety_s, workers=1)
    return dataclasses.replace(options, solver=solver)


def exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Worker initializer: a daemon thread ends the worker within ``poll_s`` of its parent's death
    (a trainer killed with SIGKILL cannot shut its pool down; its workers would live on)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


_WORKER: dict = {}  # in a worker process: the solver its service started it with


def _start_worker(parent_pid: int, solve: Callable, reproducible: bool = False) -> None:
    """Worker initializer: :func:`exit_with_parent`, and the solver, sent once and kept, so that
    what its cost models keep between calls (slice meshes, the schemes' cost tables) serves every
    batch the worker plans (a copy sent with each batch started cold: 1.27× the planning time,
    docs/benchmarks.md, "Strategies")."""
    exit_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group and a scheduler's SIGTERM every process of the job: the
    # trainer stops after its step (StopSignals) and then closes the pool; a worker that died of the
    # signal instead would raise KeyboardInterrupt in the trainer waiting for its plan
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if reproducible:
        cpsat.set_reproducible()
    _WORKER["solve"] = solve


def _solve(lengths: Sequence[int], delay_s: float):
    if delay_s > 0:  # test hook: a slow solver
        time.sleep(delay_s)
    return _WORKER["solve"](lengths)


# A batch whose worker dies is solved again this many times in all when the consumer waits (plan.wait,
# several processes): a fallback plan there would differ from the other processes' plans.
WAIT_ATTEMPTS = 3
EVENTS_KEPT = 1024  # the latest fallback events a service keeps (a long run falls back without end)


def _name(key: Hashable) -> str:
    """A batch's key in messages: ``iteration 3``, or the key's own words (the feed's ``PlanKey``)."""
    return f"iteration {key}" if isinstance(key, int) else str(key)


def _stop(pool: cf.ProcessPoolExecutor) -> None:
    """Shuts ``pool`` down without waiting for the solves it is running (nobody will take their
    plans): its worker processes are killed (they ignore SIGTERM, :func:`_start_worker`)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        with contextlib.suppress(Exception):
            process.kill()
    for process in processes:
        with contextlib.suppress(Exception):
            process.join(timeout=5)


@dataclasses.dataclass(frozen=True)
class ServiceEvent:
    iteration: Hashable  # the batch's key
    kind: str  # "late" | "failed"
    detail: str
    fallback_policy: str


class PlanningService:
    """Producer/consumer planning with ``workers`` background processes (spawned, no JAX).

    >>> svc = PlanningService(cost)                           # doctest: +SKIP
    >>> svc.submit(0, lengths_0); svc.submit(1, lengths_1)    # producer, ahead of training
    >>> plan = svc.get(0)                                     # consumer: never blocks on a solver
    """

    def __init__(
        self,
        cost,
        policy: str = "epp",
        options: Optional[PlannerOptions] = None,
        fallback_policy: str = "epp-fast",
        workers: int = 1,
        delay_s: float = 0.0,
        *,
        solve: Optional[Callable] = None,
        fallback: Optional[Callable] = None,
        reproducible: bool = False,
    ):
        """``cost``/``policy``/``options``: an EPP-family policy of :func:`plan_iteration`, with the
        fast fallbacks ``fallback_policy``, ``epp-fast`` and ``seq1f1b-tuned``. Any other planner:
        ``solve(lengths) -> plan`` (picklable: it runs in the worker) and ``fallback(lengths) ->
        plan`` (runs here when the solver is late or failed). ``reproducible``: every solve in
        :func:`jvarlen.plan.cpsat.reproducible` mode (a run that waits for its plans)."""
        self.cost = cost
        self.policy = policy
        self.options = deterministic_options() if options is None else options
        self.fallback_policy = fallback_policy
        self.fallback_options = dataclasses.replace(self.options, solver=SolverOptions(time_limit_s=0.0))
        self.delay_s = delay_s
        self.solve = solve or functools.partial(plan_iteration, cost=cost, policy=policy, options=self.options)
        self.fallback = fallback
        self.workers = workers
        self.reproducible = reproducible
        self._pool = self._new_pool()
        self._jobs: dict[Hashable, tuple[list[int], cf.Future]] = {}
        self.events: collections.deque[ServiceEvent] = collections.deque(maxlen=EVENTS_KEPT)
        self.restarts = 0
        self._told: set[str] = set()  # solver errors whose traceback was logged

    def _new_pool(self) -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=mp.get_context("spawn"),
            initializer=_start_worker,
            initargs=(os.getpid(), self.solve, self.reproducible),
        )

    def _restart(self, detail: str, first: Optional[list[int]] = None) -> Optional[cf.Future]:
        """A worker died (killed by the OS, out of memory, a crash in native code), which leaves the
        whole pool unusable: a new pool takes over, and the batches that were waiting on the old
        one are submitted to it again, ``first`` (the batch the consumer waits for) before them;
        returns ``first``'s future."""
        log.warning("planning worker died (%s); restarting the planning processes", detail)
        _stop(self._pool)
        self._pool = self._new_pool()
        self.restarts += 1
        waited = None if first is None else self._pool.submit(_solve, first, self.delay_s)
        for iteration, (lengths, fut) in list(self._jobs.items()):
            if not fut.done() or fut.cancelled() or isinstance(fut.exception(), BrokenProcessPool):
                self._jobs[iteration] = (lengths, self._pool.submit(_solve, lengths, self.delay_s))
        return waited

    # ---- producer
    def submit(self, iteration: Hashable, lengths: Sequence[int]) -> None:
        """Queues iteration ``iteration``'s batch for background solving (returns at once)."""
        lengths = [int(x) for x in lengths]
        try:
            fut = self._pool.submit(_solve, lengths, self.delay_s)
        except BrokenProcessPool as e:
            self._restart(f"{type(e).__name__}: {e}")
            fut = self._pool.submit(_solve, lengths, self.delay_s)
        self._jobs[iteration] = (lengths, fut)

    # ---- consumer
    def get(self, iteration: Hashable, wait: bool = False, timeout_s: float = 0.0) -> Plan:
        """The plan for ``iteration``: the solved one if ready (after at most ``timeout_s``,
        or until done with ``wait=True``), else a fast fallback plan and a logged event."""
        if iteration not in self._jobs:
            raise KeyError(f"{_name(iteration)} was never submitted")
        lengths, fut = self._jobs.pop(iteration)
        for attempt in range(1, WAIT_ATTEMPTS + 1):
            try:
                plan = fut.result(timeout=None if wait else timeout_s)
                plan.stats["service_source"] = "solver"
                return plan
            except cf.TimeoutError:
                fut.cancel()
                return self._fallback(iteration, lengths, "late", "solver not finished when the consumer asked")
            except BrokenProcessPool as e:  # its worker died (the OS killed it, a native crash)
                # waiting means the solver's plan, which the other processes get too: solved again first
                again = wait and attempt < WAIT_ATTEMPTS
                fut = self._restart(f"{type(e).__name__}: {e}", first=lengths if again else None)
                if not wait:  # never stall training
                    return self._fallback(iteration, lengths, "failed", f"{type(e).__name__}: {e}")
                if not again:
                    raise PlanningError(
                        f"{_name(iteration)}: the planning worker died {attempt} times solving it ({e}); with "
                        "plan.wait (or several processes) the plan must be the solver's, so training stops here"
                    ) from None
            except Exception as e:  # the solver raised: the same on every process, so is its fallback
                self._tell_traceback(e)
                return self._fallback(iteration, lengths, "failed", f"{type(e).__name__}: {e}")
        raise AssertionError("unreachable")

    def _tell_traceback(self, error: Exception) -> None:
        """Logs the worker's traceback of a solver error, once per distinct error (a solver bug
        otherwise shows as a fallback line per plan, without where it happened)."""
        what = f"{type(error).__name__}: {error}"
        if what not in self._told:
            self._told.add(what)
            where = getattr(error.__cause__, "tb", None) or "(no traceback)"
            log.error("the planner raised %s; every plan it fails falls back. Worker traceback:\n%s", what, where)

    def _fallback(self, iteration: Hashable, lengths: list[int], kind: str, detail: str) -> Plan:
        event = ServiceEvent(iteration, kind, detail, self.fallback_policy)
        self.events.append(event)
        log.warning("plan for %s %s (%s); using %s", _name(iteration), kind, detail, self.fallback_policy)
        if self.fallback is not None:
            with cpsat.reproducible() if self.reproducible else contextlib.nullcontext():
                plan = self.fallback(lengths)
            plan.stats["service_source"] = f"fallback:{kind}"
            plan.events.append(f"service: {kind} ({detail}); fallback plan")
            return plan
        errors = []
        for policy in (self.fallback_policy, "epp-fast", "seq1f1b-tuned"):  # last resorts, in order
            try:
                plan = plan_iteration(lengths, cost=self.cost, policy=policy, options=self.fallback_options)
            except PlanningError as e:
                errors.append(f"{policy}: {e}")
                continue
            plan.stats["service_source"] = f"fallback:{kind}"
            plan.events.append(f"service: {kind} ({detail}); fallback {policy}")
            return plan
        raise PlanningError(f"{_name(iteration)}: no fallback plan fits: " + "; ".join(errors))

    def stream(self, batches: Iterable[Sequence[int]], ahead: int = 2, wait: bool = False) -> Iterator[Plan]:
        """Producer/consumer loop over a sampler's batches: keeps ``ahead`` iterations
        submitted beyond the one being consumed and yields plans in order (fallbacks
        when late, unless ``wait``)."""
        it = iter(batches)
        submitted = consumed = 0
        exhausted = False
        while True:
            while not exhausted and submitted <= consumed + ahead:
                try:
                    self.submit(submitted, next(it))
                    submitted += 1
                except StopIteration:
                    exhausted = True
            if consumed >= submitted:
                return
            yield self.get(consumed, wait=wait)
            consumed += 1

    def peek(self, iteration: Hashable) -> Optional[Plan]:
        """The solved plan for ``iteration`` if its worker has finished (without taking it), else None."""
        job = self._jobs.get(iteration)
        if job is None or not job[1].done() or job[1].cancelled() or job[1].exception() is not None:
            return None
        return job[1].result()

    def done(self, iteration: Hashable, timeout_s: float = 0.0) -> bool:
        """Whether ``iteration``'s solver has finished (or failed), waiting up to ``timeout_s``."""
        job = self._jobs.get(iteration)
        if job is None:
            return False
        cf.wait([job[1]], timeout=timeout_s)
        return job[1].done()

    def pending(self) -> list:
        return sorted(self._jobs)

    def close(self) -> None:
        """Ends the workers without waiting for their solves (nobody will take those plans)."""
        self._jobs.clear()
        _stop(self._pool)

    def __enter__(self) -> "PlanningService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
