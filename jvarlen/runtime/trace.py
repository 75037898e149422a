"""A profiler trace of chosen steps (``logging.trace_steps``): JAX's profiler over whole iterations
(sampling, planning waits, dispatch, the device's programs, the checkpoint's start), written where
TensorBoard's profile plugin looks: ``<run_dir>/tensorboard/plugins/profile/<time>/``, as XPlane
and as a Chrome trace (``*.trace.json.gz``, which Perfetto opens).
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import jax


class StepTrace:
    """Traces steps ``first..last`` (1-based, inclusive) of those this run takes, ``start + 1..end``."""

    def __init__(self, run_dir: str, steps: Optional[list[int]], start: int, end: int, say: Callable[[str], None]):
        self.say, self.active = say, False
        self.first = self.last = None
        if not steps:
            return
        first, last = max(steps[0], start + 1), min(steps[1], end)
        if first > last:
            say(
                f"[jvarlen] logging.trace_steps={list(steps)} lies outside the steps this run takes "
                f"({start + 1}-{end}): no trace"
            )
            return
        self.first, self.last = first, last
        self.directory = os.path.join(run_dir, "tensorboard")
        if jax.process_count() > 1:  # one host name per process would not tell two of one host apart
            self.directory = os.path.join(self.directory, f"process-{jax.process_index()}")

    def before(self, step: int) -> None:
        """Called before 0-based step ``step``: starts the trace at the first step."""
        if self.first is not None and step + 1 == self.first:
            jax.profiler.start_trace(self.directory)
            self.active = True

    def after(self, step: int) -> None:
        """Called after 0-based step ``step`` (its record and checkpoint): stops at the last step."""
        if self.active and step + 1 == self.last:
            self.close()

    def close(self) -> None:
        """Stops and writes a running trace (also when the run ends inside the range)."""
        if not self.active:
            return
        self.active = False
        jax.profiler.stop_trace()
        self.say(
            f"[jvarlen] profiler trace of steps {self.first}-{self.last} written under "
            f"{os.path.join(self.directory, 'plugins', 'profile')} (TensorBoard's profile tab, or its "
            "*.trace.json.gz in Perfetto)"
        )
