"""The cost model's clock on the CPU backend: the process pinned to one core.

JAX 0.10.2's CPU runtime runs a program over every core the process may use, whatever
``--xla_cpu_multi_thread_eigen`` says; process CPU time then counts the helper threads too (it
was 1.48× wall time on a quiet 2-core machine, ~1.0× under load), so neither clock meant "one
core". Pinned to one core before JAX starts (:func:`pin_one_core`), XLA sizes its thread pools
from the affinity mask and every thread of the process shares that core: process CPU time is then
the time the core spent on this process, which equals wall time on a core nobody else uses and
stays put when other jobs share the core (they delay the wall clock, not the CPU clock).

One pinned core per device is also how the multi-process pipeline benchmark emulates devices with
their own compute (``scripts/bench_pipeline.py --parts processes``), so profile, validation and
benchmark time the same thing. On GPU the clock is wall time. No JAX import here: the entry points
pin before JAX starts.

Reference units. A pinned core of this kind of VM does not keep its speed: the same plan took
20-30 % longer an hour later (docs/benchmarks.md, "The one-core clock"), so seconds measured in one
hour do not predict seconds measured in another. The profiler therefore records, with its
calibration, the reading of a reference probe (the whole-model steps of three fixed chunks of
different size and context, :data:`jvarlen.profile.harness.REFERENCE_CHUNKS`), and the validation
times the same probe beside every plan; :func:`to_profile_clock` converts a measurement to the
seconds it would have taken at the profile's speed. Readings are minima on both sides (a probe
chunk's and a plan's least disturbed run). The drift is not uniform over programs, so the probe
is a mix: a single 512-token step once got 17 % faster within minutes while the plans beside it
kept their speed.

Both sides must also be the same statistic. A minimum over fewer draws is larger: the profile's
reading is each chunk's minimum over the calibration's rounds (20), and the minimum of 5 of those
20 rounds is 1.3-2.3 % larger on average, so a plan converted with only its own 5 probe calls
was converted 1-2 % too fast. :func:`nearest_probe_reading` takes as many calls as the
calibration had rounds (:func:`calibration_rounds`): the plan's own and those of the plans
measured next to it; the pipeline benchmark spreads that many calls over its rounds
(:func:`calls_per_round`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Optional, Sequence

CORE_ENV = "JVARLEN_CPU_CORE"  # which core the profiler / validation pin to (default: the first allowed)
CLOCK_NAME = "process CPU time, process pinned to one core"


def cpu_backend_expected() -> bool:
    """Whether JAX will run on the CPU backend (``JAX_PLATFORMS=cpu`` or no GPU/TPU plugin
    installed): only then is the process pinned."""
    import importlib.util

    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms:
        return platforms.split(",")[0] == "cpu"
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "libtpu")
    return not any(importlib.util.find_spec(name) for name in plugins)


def jax_started() -> bool:
    """Whether JAX has created its backends (after that, the thread pools' size is fixed)."""
    xb = sys.modules.get("jax._src.xla_bridge")
    return bool(xb is not None and xb.backends_are_initialized())


def pin_one_core(core: Optional[int] = None) -> int:
    """Restricts this process to one core (``core``, else ``$JVARLEN_CPU_CORE``, else the first core
    it may use) and returns it. Must run before JAX starts; raises otherwise (the thread pools
    would keep the size they were created with)."""
    if jax_started():
        raise RuntimeError("pin_one_core must run before JAX starts (XLA sizes its thread pools once)")
    allowed = sorted(os.sched_getaffinity(0))
    if core is None:
        core = int(os.environ.get(CORE_ENV, allowed[0]))
    if core not in allowed:
        raise ValueError(f"core {core} is not one this process may use ({allowed})")
    os.sched_setaffinity(0, {core})
    os.environ[CORE_ENV] = str(core)  # child processes (planner workers) inherit the mask anyway
    return core


def pinned() -> bool:
    """Whether this process may use exactly one core."""
    return len(os.sched_getaffinity(0)) == 1


def cpu_clock() -> Callable[[], float]:
    """The CPU backend's clock: process CPU time. Meaningful as one core's time when :func:`pinned`."""
    return time.process_time


def describe() -> str:
    cores = sorted(os.sched_getaffinity(0))
    return CLOCK_NAME if len(cores) == 1 else f"process CPU time over {len(cores)} cores (NOT a one-core clock)"


def nearest_probe_reading(calls_per_plan: Sequence[Sequence[Sequence[float]]], index: int, calls: int) -> float:
    """The reference reading beside plan ``index`` taken as the profile's calibration takes it: per
    probe chunk the minimum over ``calls`` probe calls (the calibration's round count), summed over
    the chunks. ``calls_per_plan``: every plan's probe calls in measurement order, each call a
    reading per chunk. The calls are the plan's own, then those of the plans measured nearest to it
    (one before, one after, two before, ...), the last plan's cut to make ``calls``; all there are
    when the plans have fewer. The machine's speed drifts over tens of minutes; the calls of a few
    neighbouring plans span one or two."""
    if not 0 <= index < len(calls_per_plan):
        raise IndexError(f"plan {index} of {len(calls_per_plan)}")
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    order = sorted(range(len(calls_per_plan)), key=lambda j: (abs(j - index), j))
    pool = [call for j in order for call in calls_per_plan[j]][:calls]
    if not pool:
        raise ValueError(f"plan {index} has no probe calls")
    return float(sum(min(chunk) for chunk in zip(*pool)))


def calibration_rounds(profile_path: str) -> Optional[int]:
    """Probe calls the profile's reference reading is the minimum over: its ``meta.reference_calls``,
    for profiles written before that field the ``calibration_rounds`` of the report beside it;
    None when neither says."""
    with open(profile_path) as f:
        calls = json.load(f).get("meta", {}).get("reference_calls", 0)
    report = profile_path.replace(".json", ".report.json")
    if not calls and os.path.exists(report):
        with open(report) as f:
            calls = json.load(f).get("calibration_rounds", 0)
    return int(calls) or None


def calls_per_round(calls: int, rounds: int) -> list[int]:
    """``calls`` probe calls spread as evenly as they go over ``rounds`` rounds (sum = ``calls``),
    so that the run's reading is the profile's statistic and follows the machine over the run."""
    if calls < 0 or rounds < 1:
        raise ValueError(f"need calls >= 0 and rounds >= 1, got {calls} and {rounds}")
    return [calls * (r + 1) // rounds - calls * r // rounds for r in range(rounds)]


def to_profile_clock(measured_s: float, reference_now_s: float, reference_profile_s: float) -> float:
    """``measured_s``, timed while the reference probe read ``reference_now_s``, in the seconds of a
    profile whose calibration saw the probe at ``reference_profile_s``: the machine's speed change
    between the two is taken out (both readings on the same clock, the same probe)."""
    if not (reference_now_s > 0 and reference_profile_s > 0):
        raise ValueError(f"reference readings must be > 0, got {reference_now_s} and {reference_profile_s}")
    return measured_s * reference_profile_s / reference_now_s
