"""Planning service: background solving, never blocking the consumer, fallback + event, determinism."""

import json
import multiprocessing.connection
import os
import time

import pytest
from conftest import small_cost, tight_budget

from jvarlen.plan import cpsat
from jvarlen.plan.api import PlannerOptions, PlanningError, plan_iteration
from jvarlen.plan.service import PlanningService, deterministic_options
from jvarlen.plan.workloads import sample_batch

K = 1024
OPTS = deterministic_options(PlannerOptions(n_candidates=2))


def _cost():
    cost = small_cost(pp=4, sp=2)
    return small_cost(pp=4, sp=2, budget=tight_budget(cost, 20_000))


def _strip(plan) -> str:
    data = plan.to_json()
    for key in ("solve_seconds", "simulate_seconds", "service_source"):
        data["stats"].pop(key, None)
    data["events"] = [e for e in data["events"] if not e.startswith("service:")]
    return json.dumps(data, sort_keys=True)


@pytest.mark.parametrize("workers", [1, 2])
def test_service_solves_in_background_and_matches_direct_planning(workers):
    cost = _cost()
    batches = [sample_batch("github", 32, 24 * K, seed=s) for s in range(3)]
    with PlanningService(cost, options=OPTS, workers=workers) as svc:
        plans = list(svc.stream(iter(batches), ahead=2, wait=True))  # fed like a sampler
        assert not svc.events and svc.pending() == []
    for b, plan in zip(batches, plans):
        assert plan.stats["service_source"] == "solver"
        plan.validate(b, cost)
        # Determinism: another process, same data and options -> the same plan.
        assert _strip(plan) == _strip(plan_iteration(b, cost=cost, policy="epp", options=OPTS))


def test_late_plan_gives_a_fast_fallback_and_logs_it():

    cost = _cost()
    batch = sample_batch("github", 32, 24 * K, seed=7)
    with PlanningService(cost, options=OPTS, workers=1, delay_s=3.0) as svc:
        svc.submit(0, batch)
        t0 = time.perf_counter()
        plan = svc.get(0)  # the worker sleeps 3 s: the consumer must not wait
        waited = time.perf_counter() - t0
        assert waited < 2.0
        assert plan.stats["service_source"] == "fallback:late"
        assert [e.kind for e in svc.events] == ["late"] and svc.events[0].iteration == 0
        assert any(e.startswith("service: late") for e in plan.events)
        plan.validate(batch, cost)
        assert plan.policy == "epp-fast"
        # The fallback is deterministic too.
        again = plan_iteration(batch, cost=cost, policy="epp-fast", options=svc.fallback_options)
        assert _strip(again) == _strip(plan)


def test_failed_worker_falls_back(caplog):
    """A solver that raises: the fallback plan, and the worker's traceback logged once (before: only
    the error's message, one line per plan, without where it happened)."""
    cost = _cost()
    with PlanningService(cost, policy="no-such-policy", options=OPTS, workers=1) as svc:
        batch = [3000, 2000, 1000]
        for i in (5, 6):
            svc.submit(i, batch)
            plan = svc.get(i, wait=True)
            assert plan.stats["service_source"] == "fallback:failed"
            assert svc.events[-1].kind == "failed" and "ValueError" in svc.events[-1].detail
            plan.validate(batch, cost)
    told = [r.getMessage() for r in caplog.records if "Worker traceback" in r.getMessage()]
    assert len(told) == 1 and "Traceback (most recent call last)" in told[0] and "plan_iteration" in told[0]


def test_close_ends_the_workers_without_waiting_for_their_solves(tmp_path):
    """Nobody takes the plans of a closing service: its workers are ended (before: close waited for
    every running and queued solve, 17.7 s for 10 s solves; forever for a solve that hangs)."""
    marker = tmp_path / "solving"
    with PlanningService(None, workers=1, solve=_SignalledWhileSolving(marker, 60.0)) as svc:
        for i in range(3):
            svc.submit(i, [3000, 2000])
        _wait_for(marker)  # the worker is in its solve (and ignores SIGTERM by now)
        workers = list(svc._pool._processes.values())
        start = time.perf_counter()
    assert time.perf_counter() - start < 10.0
    # ended: their sentinels are ready (is_alive() may still say True for a moment: the pool's own
    # thread, blocked in waitpid, reaps a killed worker and records its exit code a little later)
    assert workers and all(multiprocessing.connection.wait([p.sentinel], timeout=5.0) for p in workers)
    assert time.perf_counter() - start < 10.0


def _wait_for(marker, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the worker never started its solve"


class _SignalledWhileSolving:
    """A solver that marks a file once it is solving (the worker's initializer has run), then takes
    ``seconds``."""

    def __init__(self, marker, seconds):
        self.marker, self.seconds = str(marker), seconds

    def __call__(self, lengths):
        open(self.marker, "w").close()
        time.sleep(self.seconds)
        return plan_iteration(lengths, cost=_cost(), policy="epp-fast", options=OPTS)


def test_ctrl_c_does_not_end_a_solving_worker(tmp_path):
    """Ctrl-C reaches the worker processes too: they ignore it (and SIGTERM), and the trainer, which
    stops after its step, gets the solver's plan (before: the worker raised KeyboardInterrupt, which
    the waiting trainer raised in turn, losing the steps since the last checkpoint)."""
    import signal

    marker = tmp_path / "solving"
    with PlanningService(None, workers=1, solve=_SignalledWhileSolving(marker, 2.0)) as svc:
        svc.submit(0, [3000, 2000])
        _wait_for(marker)
        for process in svc._pool._processes.values():
            os.kill(process.pid, signal.SIGINT)
            os.kill(process.pid, signal.SIGTERM)
        assert svc.get(0, wait=True).stats["service_source"] == "solver" and svc.restarts == 0


def test_the_service_keeps_only_the_latest_fallback_events(monkeypatch):
    """A long run falls back without end: the service keeps the latest events only (before: every
    one, ~95 bytes each, for the whole run)."""
    from jvarlen.plan import service

    monkeypatch.setattr(service, "EVENTS_KEPT", 3)
    plan = plan_iteration([3000, 2000], cost=_cost(), policy="epp-fast", options=OPTS)
    with PlanningService(None, workers=1, solve=_Counting(), fallback=lambda lengths: plan, delay_s=30.0) as svc:
        for i in range(5):
            svc.submit(i, [3000, 2000])
            svc.get(i)
        assert [e.iteration for e in svc.events] == [2, 3, 4]


class _Counting:
    """A solver that numbers the batches it has planned."""

    def __init__(self):
        self.calls = 0

    def __call__(self, lengths):
        self.calls += 1
        plan = plan_iteration(lengths, cost=_cost(), policy="epp-fast", options=OPTS)
        plan.stats["solver_calls"] = self.calls
        return plan


def test_a_worker_keeps_its_solver_between_batches():
    """The solver is sent to a worker once, so what its cost models keep between calls (slice
    meshes, the schemes' cost tables) serves every later batch; one copy sent per batch would
    start each cold."""
    with PlanningService(None, workers=1, solve=_Counting()) as svc:
        plans = list(svc.stream(iter([[3000, 2000, 1000]] * 3), ahead=2, wait=True))
    assert [p.stats["solver_calls"] for p in plans] == [1, 2, 3]


class _DiesOn:
    """A solver whose process dies (as under the OOM killer) on one batch."""

    def __init__(self, fatal):
        self.fatal = fatal

    def __call__(self, lengths):
        if list(lengths) == self.fatal:
            os._exit(1)
        return plan_iteration(lengths, cost=_cost(), policy="epp-fast", options=OPTS)


def test_a_dead_worker_is_replaced_and_its_waiting_batches_solved():
    """A worker that dies breaks its whole process pool: the service starts a new one, the dead
    worker's batch falls back (the consumer does not wait), and the batches queued behind it and
    every later one are solved."""
    fallback = lambda lengths: plan_iteration(lengths, cost=_cost(), policy="seq1f1b-tuned", options=OPTS)  # noqa: E731
    with PlanningService(None, workers=1, solve=_DiesOn([666]), fallback=fallback) as svc:
        svc.submit(0, [666])
        svc.submit(1, [3000, 2000])
        assert svc.get(0, timeout_s=120).stats["service_source"] == "fallback:failed"
        assert svc.events[0].kind == "failed" and "BrokenProcessPool" in svc.events[0].detail
        assert svc.restarts == 1
        assert svc.get(1, wait=True).stats["service_source"] == "solver"
        svc.submit(2, [3000, 1000])
        assert svc.get(2, wait=True).stats["service_source"] == "solver"
        assert len(svc.events) == 1


class _DiesOnce:
    """Kills its worker the first time it sees a batch (a marker file says it did)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __call__(self, lengths):
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return plan_iteration(lengths, cost=_cost(), policy="epp-fast", options=OPTS)


def test_a_waiting_consumer_gets_the_solvers_plan_after_a_worker_dies(tmp_path):
    """With wait (plan.wait, or several processes, which must all run the same plan) a batch whose
    worker died is solved again, never replaced by a fallback that the other processes do not
    have; a batch that kills its worker every time stops training with PlanningError."""
    fallback = lambda lengths: plan_iteration(lengths, cost=_cost(), policy="seq1f1b-tuned", options=OPTS)  # noqa: E731
    with PlanningService(None, workers=1, solve=_DiesOnce(tmp_path / "died"), fallback=fallback) as svc:
        svc.submit(0, [3000, 2000])
        plan = svc.get(0, wait=True)
        assert plan.stats["service_source"] == "solver" and svc.restarts == 1 and not svc.events
        assert _strip(plan) == _strip(plan_iteration([3000, 2000], cost=_cost(), policy="epp-fast", options=OPTS))
    with PlanningService(None, workers=1, solve=_DiesOn([666]), fallback=fallback) as svc:
        svc.submit(0, [666])
        with pytest.raises(PlanningError, match="iteration 0: the planning worker died 3 times"):
            svc.get(0, wait=True)
        assert svc.restarts == 3 and not svc.events


class _DiesOnceAndLogs(_DiesOnce):
    """:class:`_DiesOnce`, writing each batch it solves to a log file."""

    def __init__(self, marker, log):
        super().__init__(marker)
        self.log = str(log)

    def __call__(self, lengths):
        plan = super().__call__(lengths)
        with open(self.log, "a") as f:
            f.write(f"{lengths[0]}\n")
        return plan


def test_after_a_worker_dies_the_batch_waited_for_is_solved_first(tmp_path):
    """The new pool solves the batch the consumer waits for before those queued behind it (before:
    last, so the trainer waited for ``ahead`` extra solves)."""
    log = tmp_path / "solved"
    with PlanningService(None, workers=1, solve=_DiesOnceAndLogs(tmp_path / "died", log)) as svc:
        for i, first in enumerate((3000, 3001, 3002)):
            svc.submit(i, [first, 200])
        assert svc.get(0, wait=True).stats["service_source"] == "solver" and svc.restarts == 1
        assert svc.get(1, wait=True).stats["service_source"] == svc.get(2, wait=True).stats["service_source"]
    assert log.read_text().split() == ["3000", "3001", "3002"]


class _Limits:
    def __init__(self, limits):
        self.stats = {"limits": limits}


def _solver_limits(lengths):
    """The limits a planner model's CP-SAT solve gets in this process."""
    s = cpsat.solver(0.01, 0.5, workers=4)
    return _Limits((s.parameters.max_time_in_seconds, s.parameters.num_workers))


def test_a_service_that_waits_solves_on_the_deterministic_limit_alone():
    """With ``reproducible`` (a run that waits for its plans, ``plan.wait``) the
    wall-clock limits of every planner model are raised to a safety net and CP-SAT runs one worker:
    only the deterministic limit stops a solve, so a loaded or stalled process plans the same."""
    with PlanningService(None, workers=1, solve=_solver_limits, reproducible=True) as svc:
        svc.submit(0, [1])
        assert svc.get(0, wait=True).stats["limits"] == (cpsat.REPRODUCIBLE_SAFETY_S, 1)
    with PlanningService(None, workers=1, solve=_solver_limits) as svc:
        svc.submit(0, [1])
        assert svc.get(0, wait=True).stats["limits"] == (0.01, 4)
    assert cpsat.call_reproducibly(_solver_limits, [1]).stats["limits"] == (cpsat.REPRODUCIBLE_SAFETY_S, 1)
    assert _solver_limits([1]).stats["limits"] == (0.01, 4)  # the mode ends with the call
