"""Plans of a multi-process run, each solved once and read by every other process.

Without an exchange every process of a distributed run plans every iteration itself: the
planner is a pure function of the lengths, the cost model and its options (CP-SAT in its
reproducible mode), so the plans agree, but the run spends ``P`` times the planning CPU, and a
plan that came out different on one host (a numpy reduction whose rounding follows the CPU's
vector width, say) would have the processes compile different programs. With a
:class:`PlanExchange`, plan ``g`` of step ``s`` (``G`` plans a step) is solved by process
``(s·G + g) mod P`` alone, which publishes it in JAX's coordination service (the key-value store
that ``jax.distributed`` runs anyway); the others block on that key. Each process so solves
``1/P`` of the plans with its own planning workers, and every process trains on the same bytes.

A process keeps its published plans for :attr:`PlanExchange.keep` steps and then deletes them
(the processes meet in every step's collectives, so none reads a plan that many steps old), and
deletes the rest when the run ends. Each run of a process has its own keys (the processes start
their runs in the same order), so a second run in one ``jax.distributed`` session never reads the
first one's plan of the same step. Values are pickled and zlib-compressed (a 64-device ``auto``
plan of 200K tokens: ~4 KB).
"""

from __future__ import annotations

import collections
import itertools
import pickle
import time
import zlib
from typing import Callable, Optional, Protocol

NOTE_AFTER_S = 5.0  # say that this process waits for another's plan after this long
NOTE_EVERY_S = 60.0  # and again this often
_RUNS = itertools.count()  # the runs of this process, numbered alike on every process


class KeyValueStore(Protocol):
    """What the exchange needs of a key-value store shared by the processes."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout_s: float) -> Optional[bytes]:
        """The value, once set (None after ``timeout_s`` without it)."""

    def try_get(self, key: str) -> Optional[bytes]:
        """The value if set, else None, at once."""

    def delete(self, key: str) -> None: ...


class CoordinationStore:
    """:class:`KeyValueStore` of ``jax.distributed``'s coordination service (``client``: its
    ``DistributedRuntimeClient``). The service answers a missing key with ``NOT_FOUND`` and a
    blocking read that times out with ``DEADLINE_EXCEEDED``; both read here as None."""

    def __init__(self, client):
        self.client = client

    def set(self, key: str, value: bytes) -> None:
        self.client.key_value_set_bytes(key, value)

    def get(self, key: str, timeout_s: float) -> Optional[bytes]:
        try:
            return self.client.blocking_key_value_get_bytes(key, max(1, int(timeout_s * 1000)))
        except Exception as e:  # jax.errors.JaxRuntimeError; its status is only in the text
            if "DEADLINE_EXCEEDED" in str(e):
                return None
            raise

    def try_get(self, key: str) -> Optional[bytes]:
        try:
            return self.client.key_value_try_get_bytes(key)
        except Exception as e:
            if "NOT_FOUND" in str(e):
                return None
            raise

    def delete(self, key: str) -> None:
        self.client.key_value_delete(key)


class PlanExchange:
    """Who solves which plan of a run of ``processes`` processes, and the plans' exchange through
    ``store`` (module docstring). ``me``: this process's index."""

    def __init__(self, store: KeyValueStore, me: int, processes: int, keep: int = 16, prefix: str = "jvarlen/plans/"):
        if not 0 <= me < processes:
            raise ValueError(f"process {me} of {processes}")
        if keep < 2:
            raise ValueError(f"keep must be >= 2 steps (the processes may be a step apart), got {keep}")
        self.store, self.me, self.processes, self.keep, self.prefix = store, me, processes, keep, prefix
        self._published: collections.deque = collections.deque()  # (step, key) of this process's plans

    @classmethod
    def for_run(cls) -> Optional["PlanExchange"]:
        """The exchange of this JAX run's processes over its coordination service; None with one process."""
        import jax

        from jvarlen.runtime.distributed import coordination_client

        if jax.process_count() == 1:
            return None
        store = CoordinationStore(coordination_client())
        return cls(store, jax.process_index(), jax.process_count(), prefix=f"jvarlen/plans/{next(_RUNS)}/")

    def owner(self, step: int, g: int, plans: int) -> int:
        """The process that solves plan ``g`` of the ``plans`` of step ``step``."""
        return (step * plans + g) % self.processes

    def mine(self, step: int, g: int, plans: int) -> bool:
        return self.owner(step, g, plans) == self.me

    def _key(self, step: int, g: int) -> str:
        return f"{self.prefix}{step}/{g}"

    def publish(self, step: int, g: int, plan) -> None:
        """Makes this process's plan ``g`` of ``step`` readable by the others, and forgets its own plans
        of :attr:`keep` or more steps before."""
        key = self._key(step, g)
        self.store.set(key, zlib.compress(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)))
        self._published.append((step, key))
        while self._published and self._published[0][0] <= step - self.keep:
            self.store.delete(self._published.popleft()[1])

    def fetch(self, step: int, g: int, plans: int, say: Callable[[str], None] = lambda _: None):
        """Plan ``g`` of ``step`` as its owner published it, waiting as long as that takes (saying so
        after :data:`NOTE_AFTER_S`, then every :data:`NOTE_EVERY_S`). A process that fails while this
        one waits ends the run (``jvarlen.runtime.distributed.FailureWatch``)."""
        key, start, wait = self._key(step, g), time.monotonic(), NOTE_AFTER_S
        while True:
            data = self.store.get(key, wait)
            if data is not None:
                return _loads(data)
            say(
                f"[jvarlen] step {step + 1} plan {g}: waiting for process {self.owner(step, g, plans)}'s plan "
                f"({time.monotonic() - start:.0f} s so far)"
            )
            wait = NOTE_EVERY_S

    def close(self) -> None:
        """Deletes the plans this process published and still keeps (the end of the run; every other
        process has read them, since they met in the steps after). Where the run fails, the
        coordination service may be gone: nothing to delete then."""
        try:
            while self._published:
                self.store.delete(self._published.popleft()[1])
        except Exception:
            self._published.clear()

    def peek(self, step: int, g: int):
        """Plan ``g`` of ``step`` if its owner has published it, else None (at once)."""
        data = self.store.try_get(self._key(step, g))
        return None if data is None else _loads(data)


def _loads(data: bytes):
    return pickle.loads(zlib.decompress(data))


__all__ = ["CoordinationStore", "KeyValueStore", "PlanExchange"]
