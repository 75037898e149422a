"""Stopping a run on a signal: SIGTERM/SIGINT ask the loop to finish its step, checkpoint it and
stop (every process of a distributed run after the same step); :class:`Interrupted` is how the
stop ends the run."""

from __future__ import annotations

import signal
import threading
from typing import Optional

import jax
import numpy as np


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived; the step it arrived in was finished and checkpointed."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {step} written")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 143 for SIGTERM, 130 for SIGINT


class StopSignals:
    """SIGTERM/SIGINT handlers for the run (main thread only): the first signal asks the loop to
    finish the current step, checkpoint it and stop; a second SIGINT interrupts at once."""

    def __init__(self):
        self.received: Optional[int] = None
        self._previous: dict = {}

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        print(
            f"[jvarlen] {signal.Signals(signum).name} received: finishing this step, writing a checkpoint, stopping",
            flush=True,
        )

    def agreed(self) -> Optional[int]:
        """The signal this step stops on: with several processes, one any of them received (the
        lowest process's), so that every process checkpoints and stops after the same step; a stop
        on one process alone would leave the others waiting in the next step's collectives."""
        if jax.process_count() == 1:
            return self.received
        from jax.experimental import multihost_utils

        codes = np.ravel(multihost_utils.process_allgather(np.int32(self.received or 0)))
        return next((int(c) for c in codes if c), None)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
