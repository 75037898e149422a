"""Multi-host start-up: ``jax.distributed.initialize`` from the config or the cluster.

Call :func:`initialize` before anything touches a device. With
``parallel.distributed=true``:

* ``coordinator_address`` + ``num_processes`` + ``process_id`` given: used as is (any
  launcher; e.g. ``127.0.0.1:12345`` for processes on one machine);
* none of them: JAX's cluster auto-detection (SLURM ``srun``, Open MPI, Kubernetes…);
  outside a detectable cluster this fails with JAX's message.

Every process then runs the same program; ``jax.devices()`` lists all devices of all
processes and the layouts span them (jvarlen.parallel.layouts orders them by process).

A process that fails (bad input on one host, a bug) says so through the coordination service
(:func:`report_failure`) before it exits; the others stop with its exit code instead of waiting
for it in the next collective (:class:`FailureWatch`). A process that dies without a word (SIGKILL,
a power loss) cannot report: the coordination service ends the others once it has missed its
heartbeats for ``parallel.heartbeat_timeout_s`` seconds.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Optional

import jax

from jvarlen.config import ConfigError, ParallelConfig

_initialized = False
_FAILED = "jvarlen/failed/"  # coordination-service key prefix: one key per failed process
_watch: Optional["FailureWatch"] = None


def initialize(cfg: ParallelConfig) -> bool:
    """Initialises jax.distributed when ``cfg.distributed``; returns whether it did."""
    global _initialized
    if not cfg.distributed or _initialized:
        return _initialized
    explicit = (cfg.coordinator_address, cfg.num_processes, cfg.process_id)
    if any(x is not None for x in explicit):
        if any(x is None for x in explicit):
            raise ConfigError(
                "parallel.coordinator_address, parallel.num_processes and parallel.process_id must be set "
                "together (or none of them, to auto-detect the cluster, e.g. under SLURM)"
            )
        jax.distributed.initialize(
            coordinator_address=cfg.coordinator_address,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
            heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
        )
    else:  # auto-detects SLURM / MPI / ... or raises
        jax.distributed.initialize(heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
    _initialized = True
    if jax.process_count() > 1:
        _start_watch()
    return True


class FailureWatch(threading.Thread):
    """Ends this process when another process of the run reports a failure.

    The main thread may be inside a collective that will never complete (on a GPU it waits
    for the failed process indefinitely; on the CPU backend gloo gives up after 30 s with an
    unrelated message), so the watch polls the coordination service's key-value store and, after
    ``grace_s`` in which this process did not report a failure of its own (every process may
    have hit the same error), shuts the distributed client down and exits with the failed
    process's code. The exit skips clean-up as a kill would: a checkpoint being written is
    left unfinished, which resume already handles. The shutdown fails whatever the main thread
    waits for in the coordination service (a collective's rendezvous): its error must not end the
    process first, with its own exit code (:func:`report_failure` waits for the watch instead,
    ``stopping`` set).
    """

    def __init__(self, client, me: int, poll_s: float = 0.5, grace_s: float = 3.0):
        super().__init__(name="jvarlen-failure-watch", daemon=True)
        self.client, self.me, self.poll_s, self.grace_s = client, me, poll_s, grace_s
        self._done = threading.Event()
        self.stopping: Optional[int] = None  # the exit code this watch is ending the process with

    def run(self) -> None:
        first_seen = None
        while not self._done.wait(self.poll_s):
            try:
                reports = [kv for kv in self.client.key_value_dir_get(_FAILED) if kv[0] != f"{_FAILED}{self.me}"]
            except Exception:  # the coordination service is gone: the run is ending anyway
                return
            if not reports:
                continue
            first_seen = time.monotonic() if first_seen is None else first_seen
            if time.monotonic() - first_seen >= self.grace_s and not self._done.is_set():
                self._stop_this_process(min(reports))

    def _stop_this_process(self, report: tuple[str, str]) -> None:
        key, value = report
        code, _, reason = value.partition("\n")
        self.stopping = int(code)
        print(
            f"jvarlen.train: process {key[len(_FAILED) :]} of this run failed ({reason}); process {self.me} stops too",
            file=sys.stderr,
            flush=True,
        )
        try:
            jax.distributed.shutdown()  # the failed process's own shutdown waits for this one
        except Exception:
            pass
        os._exit(self.stopping)

    def stop(self) -> None:
        self._done.set()

    def wait_until_it_ends_the_process(self, timeout_s: float = 60.0) -> None:
        """(Another thread, once ``stopping``.) Never returns: the watch ends the process, or after
        ``timeout_s`` this thread does, with the same code."""
        self.join(timeout_s)
        os._exit(self.stopping)


def coordination_client():
    """The coordination service's client of this ``jax.distributed`` run (the one
    ``jax.experimental.multihost_utils`` uses too): its key-value store reports failures here and
    carries the plans of :mod:`jvarlen.runtime.plan_exchange`."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def _start_watch() -> None:
    global _watch
    _watch = FailureWatch(coordination_client(), jax.process_index())
    _watch.start()
    atexit.register(_watch.stop)  # runs before JAX's own exit hook shuts the client down


def report_failure(exit_code: int, error: BaseException) -> None:
    """Tells the other processes of a distributed run that this one exits with ``exit_code``
    because of ``error``, so that they stop too (:class:`FailureWatch`). A no-op with one
    process. Where the watch is already stopping this process because another one failed,
    ``error`` is what its shutdown did to this thread: nothing is reported, and this does not
    return (the process ends with the failed process's code).

    Then this process leaves the coordination service, as JAX's exit hook would, but before the
    interpreter waits for the process's threads: a save thread of Orbax's may wait in a barrier
    that the others, stopping, never reach (a checkpoint write that failed here only), and
    leaving ends that wait. The shutdown returns once the others' watches have shut down too."""
    if _watch is None:
        return
    if _watch.stopping is not None:
        _watch.wait_until_it_ends_the_process()
    _watch.stop()
    reason = " ".join(f"{type(error).__name__}: {error}".split())
    try:
        _watch.client.key_value_set(f"{_FAILED}{_watch.me}", f"{exit_code}\n{reason[:1000]}")
    except Exception:  # the coordination service is gone (its host failed first): nothing to tell
        pass
    try:
        jax.distributed.shutdown()
    except Exception:  # the service is gone already: so are the barriers
        pass


_AGREE = "jvarlen/agree/"  # coordination-service key prefix of :func:`agree`
_agreements = 0  # agreements so far in this process: the same sequence on every process
AGREE_TIMEOUT_S = 3600.0  # a checkpoint read of a large state on a slow file system may take this long


def agree(tag: str, mine: str, timeout_s: float = AGREE_TIMEOUT_S) -> list[str]:
    """Every process's ``mine`` for ``tag``, in process order (``[mine]`` with one process), through
    the coordination service's key-value store: neither a device collective nor a barrier, so it
    cannot be mismatched with one that another library (Orbax) holds. Every process must call it,
    in the same order; a process that dies first ends the others (:class:`FailureWatch`, the
    heartbeat) rather than this call's timeout."""
    global _agreements
    if jax.process_count() == 1:
        return [mine]
    _agreements += 1
    client = coordination_client()
    key = f"{_AGREE}{_agreements}/{tag}/"
    client.key_value_set(key + str(jax.process_index()), mine)
    return [client.blocking_key_value_get(key + str(p), int(timeout_s * 1000)) for p in range(jax.process_count())]


SAME_INPUTS = (
    "every process must see the same config, data, cost profile (train.cost_profile, ~/.cache/jvarlen/profiles) "
    "and caches (data.cache_dir) or they would train differently"
)


def check_same(named: dict, advice: str = SAME_INPUTS) -> None:
    """Raises :class:`ConfigError` when the processes of a distributed run disagree on any of
    ``named`` (what -> its text): they would plan, sample or compile differently, and hang in a
    collective or train on different data. A no-op with one process."""
    if jax.process_count() == 1:
        return
    import hashlib

    import numpy as np
    from jax.experimental import multihost_utils

    names = sorted(named)
    digests = [hashlib.sha256(str(named[k]).encode()).digest()[:4] for k in names]
    mine = np.frombuffer(b"".join(digests), dtype=np.int32).copy()
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), len(names))
    differ = [k for i, k in enumerate(names) if len(set(every[:, i].tolist())) > 1]
    if differ:
        raise ConfigError(f"the {jax.process_count()} processes of this run differ in {', '.join(differ)}; {advice}")
