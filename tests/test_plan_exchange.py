"""PlanExchange: in a run of several processes each plan is solved by one process and read by
the others; every process trains on the plans one process alone would have made."""

import json
import subprocess
import sys
import threading

import pytest
from conftest import small_cost
from test_plan_feed import LAYOUT, OPTS, _pipeline, _strip

from jvarlen.plan.api import plan_iteration
from jvarlen.runtime import plan_exchange
from jvarlen.runtime.feed import IterationFeed, PlanKey, split_by_rows
from jvarlen.runtime.plan_exchange import CoordinationStore, PlanExchange
from jvarlen.runtime.strategy import Planner

STEPS = 5


class MemoryStore:
    """A key-value store shared by threads standing in for processes (the coordination service's
    semantics: a key is set once; a blocking read waits for it)."""

    def __init__(self):
        self.values, self.deleted, self.changed = {}, [], threading.Condition()

    def set(self, key, value):
        with self.changed:
            assert key not in self.values, f"{key} set twice"
            self.values[key] = value
            self.changed.notify_all()

    def get(self, key, timeout_s):
        with self.changed:
            self.changed.wait_for(lambda: key in self.values, timeout=timeout_s)
            return self.values.get(key)

    def try_get(self, key):
        with self.changed:
            return self.values.get(key)

    def delete(self, key):
        with self.changed:
            del self.values[key]
            self.deleted.append(key)


class RecordingService:
    """A planning service that solves on submit and records which keys it was given."""

    def __init__(self, solve):
        self.solve, self.plans, self.submitted = solve, {}, []

    def submit(self, key, lengths):
        self.submitted.append(key)
        self.plans[key] = self.solve(lengths)
        self.plans[key].stats["service_source"] = "solver"

    def get(self, key, wait=False):
        return self.plans.pop(key)

    def done(self, key, timeout_s=0.0):
        return key in self.plans

    def peek(self, key):
        return self.plans.get(key)


def _feeds(corpus_cache, store, processes, service: bool, keep=16):
    """One feed per process, each solving with its own counting planner and cost model."""
    feeds, solved = [], []
    for me in range(processes):
        mine, cost = [], small_cost(pp=2, sp=1)

        def solve(lengths, mine=mine, cost=cost):
            mine.append(tuple(lengths))
            return plan_iteration(lengths, cost=cost, policy="epp", options=OPTS)

        pipeline = _pipeline(corpus_cache)
        planner = Planner(split_by_rows(LAYOUT.dp, pipeline.rows), solve, RecordingService(solve) if service else None)
        exchange = PlanExchange(store, me, processes, keep=keep) if processes > 1 else None
        feeds.append(IterationFeed(pipeline, planner, 0, STEPS, ahead=2 if service else 0, exchange=exchange))
        solved.append(mine)
    return feeds, solved


def _run(feeds):
    """Each feed's iterations, the feeds run at once (a process blocks on another's plan)."""
    out = [None] * len(feeds)

    def drain(i):
        out[i] = [feeds[i].next() for _ in range(STEPS)]

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(feeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(o is not None for o in out), "a feed did not finish"
    return out


@pytest.mark.parametrize("service", [False, True], ids=["inline", "service"])
def test_each_plan_is_solved_once_and_every_process_gets_the_same_plans(corpus_cache, service):
    (alone,), (alone_solved,) = _feeds(corpus_cache, None, 1, service)
    reference = [[_strip(p) for p in it.plans] for it in _run([alone])[0]]
    store = MemoryStore()
    feeds, solved = _feeds(corpus_cache, store, 2, service)
    runs = _run(feeds)
    for me, iterations in enumerate(runs):
        assert [[_strip(p) for p in it.plans] for it in iterations] == reference, me
    plans = STEPS * LAYOUT.dp
    assert len(alone_solved) == plans
    # plan g of step s by process (s·G + g) mod 2, none solved twice
    for me in (0, 1):
        owned = [(s, g) for s in range(STEPS) for g in range(LAYOUT.dp) if (s * LAYOUT.dp + g) % 2 == me]
        expect = [tuple(len(d.tokens) for d in runs[me][s].groups[g]) for s, g in owned]
        assert solved[me] == expect, me
        assert [it.fetched for it in runs[me]] == [LAYOUT.dp - sum(s == t for t, _ in owned) for s in range(STEPS)]
        if service:
            assert feeds[me].service.submitted == [PlanKey(s, g) for s, g in owned]
    assert len(solved[0]) + len(solved[1]) == plans


class LateService(RecordingService):
    """Every plan of step 2 comes back as the service's fallback for a late solver."""

    def get(self, key, wait=False):
        plan = super().get(key, wait)
        if key.step == 2 and not wait:
            plan.stats["service_source"] = "fallback:late"
            plan.events.append("service: late (solver not finished when the consumer asked); fallback plan")
        return plan


def test_a_late_owners_fallback_plan_is_every_processs_plan(corpus_cache):
    """Without plan.wait the owner of a plan takes the fallback when its solver is late, as one
    process would; the others read that plan and count the fallback too, so the processes never
    run different plans and none waits for the solver (the first step aside)."""
    store = MemoryStore()
    feeds, _ = _feeds(corpus_cache, store, 2, service=True)
    for feed in feeds:
        feed.service = feed.planner.service = LateService(feed.planner.service.solve)
    runs = _run(feeds)
    for step in range(STEPS):
        a, b = runs[0][step], runs[1][step]
        assert [_strip(p) for p in a.plans] == [_strip(p) for p in b.plans]
        assert a.fallbacks == b.fallbacks == (LAYOUT.dp if step == 2 else 0)
        assert all(p.stats["service_source"] == ("fallback:late" if step == 2 else "solver") for p in a.plans + b.plans)


def test_published_plans_are_kept_for_keep_steps():
    store = MemoryStore()
    exchange = PlanExchange(store, 1, 2, keep=4)
    for step in range(12):
        for g in range(2):
            if exchange.mine(step, g, 2):
                exchange.publish(step, g, {"step": step, "g": g})
    steps = sorted(int(k.split("/")[-2]) for k in store.values)
    assert steps == [8, 9, 10, 11]  # process 1 owns g = 1 of every step (2 plans a step)
    assert exchange.peek(11, 1) == {"step": 11, "g": 1} and exchange.peek(11, 0) is None
    assert len(store.deleted) == 8
    exchange.close()  # the run's end: its last plans go too
    assert store.values == {} and len(store.deleted) == 12
    gone = PlanExchange(MemoryStore(), 0, 2)
    gone.publish(0, 0, "plan")
    gone.store.delete = lambda key: (_ for _ in ()).throw(RuntimeError("UNAVAILABLE: coordination service gone"))
    gone.close()  # a failed run's clean-up does not raise over the failure
    with pytest.raises(ValueError, match="keep"):
        PlanExchange(store, 0, 2, keep=1)
    with pytest.raises(ValueError, match="process 2 of 2"):
        PlanExchange(store, 2, 2)


def test_a_process_waiting_for_a_plan_says_whose(monkeypatch):
    monkeypatch.setattr(plan_exchange, "NOTE_AFTER_S", 0.05)
    monkeypatch.setattr(plan_exchange, "NOTE_EVERY_S", 0.05)
    store = MemoryStore()
    owner, reader = PlanExchange(store, 0, 2), PlanExchange(store, 1, 2)
    said = []
    timer = threading.Timer(0.3, owner.publish, args=(4, 0, "the plan"))
    timer.start()
    assert reader.fetch(4, 0, 2, said.append) == "the plan"
    assert said and all(line.startswith("[jvarlen] step 5 plan 0: waiting for process 0's plan") for line in said)


class _Client:
    """The coordination client's answers: missing keys and timeouts are errors with a status text."""

    def __init__(self, error):
        self.error = error

    def blocking_key_value_get_bytes(self, key, timeout_ms=None):
        raise self.error

    key_value_try_get_bytes = blocking_key_value_get_bytes


def test_the_coordination_store_reads_missing_keys_as_none_and_raises_other_errors():
    assert CoordinationStore(_Client(RuntimeError("DEADLINE_EXCEEDED: GetKeyValue() timed out"))).get("k", 0.1) is None
    assert CoordinationStore(_Client(RuntimeError("NOT_FOUND: Config key k not found."))).try_get("k") is None
    for read in (lambda s: s.get("k", 0.1), lambda s: s.try_get("k")):
        with pytest.raises(RuntimeError, match="UNAVAILABLE"):
            read(CoordinationStore(_Client(RuntimeError("UNAVAILABLE: connection refused"))))


_TWO_PROCESSES = """
import json
import sys
import jax
jax.distributed.initialize(coordinator_address="127.0.0.1:" + sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))
from jvarlen.runtime.plan_exchange import PlanExchange
exchange = PlanExchange.for_run()
got = []
for step in range(3):
    for g in range(3):
        if exchange.mine(step, g, 3):
            exchange.publish(step, g, {"step": step, "g": g, "by": exchange.me})
        else:
            got.append(exchange.fetch(step, g, 3))
assert exchange.peek(99, 0) is None and exchange.store.get("jvarlen/plans/99/0", 0.1) is None  # the service's errors
again = PlanExchange.for_run()  # a second run in this session: keys of its own
assert again.prefix != exchange.prefix and again.peek(0, 0) is None and again.peek(0, 1) is None
print(json.dumps(sorted([p["step"], p["g"], p["by"]] for p in got)))
jax.distributed.shutdown()
"""


def test_two_processes_exchange_plans_over_the_coordination_service():
    import socket

    from conftest import cli_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = cli_env(1, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TWO_PROCESSES, str(pid), port],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    owned = {me: [(s, g) for s in range(3) for g in range(3) if (s * 3 + g) % 2 == me] for me in (0, 1)}
    for me, (out, _) in enumerate(outs):
        other = 1 - me
        assert json.loads(out.strip().splitlines()[-1]) == [[s, g, other] for s, g in owned[other]]
