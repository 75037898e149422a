"""``python -m jvarlen.profile``: fit the cost model on this backend and save the profile JSON.

Example: ``python -m jvarlen.profile --config configs/default.yaml --out_dir runs/profiles``;
add Ulysses sp = 2 coefficients to a saved profile with ``--sp '[1,2]' --extend_report
PATH.report.json``; re-measure only its whole-model calibration chunks with ``--extend_report
PATH.report.json --recalibrate true`` (every degree of the report, ``--calibration_rounds`` rounds).
On CPU the process is pinned to one core and the sp = 1 calibration's reading of the reference
probe is saved with the profile (:mod:`jvarlen.profile.clock`, "Reference units").
The file name is keyed by model shape, backend and device kind
(:func:`jvarlen.plan.cost.profile_filename`); an existing file is reused unless ``--force``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

import draccus

from jvarlen.profile import SINGLE_THREAD_XLA_FLAGS


@dataclasses.dataclass
class ProfileConfig:
    config: Optional[str] = None  # run YAML whose model section is profiled (default: ModelConfig())
    out_dir: str = os.path.join(  # where the profile (JSON) and its measurement report are written
        os.path.expanduser("~"), ".cache", "jvarlen", "profiles"
    )
    repeats: int = 5  # timings per measurement; the minimum is kept
    # rounds of the whole-model calibration steps (the profile's scale and reference reading)
    calibration_rounds: int = 20
    force: bool = False  # re-profile even if a profile for this key exists
    compilation_cache: Optional[str] = os.path.join(  # persistent XLA compilation cache (None: off)
        os.path.expanduser("~"), ".cache", "jvarlen", "xla"
    )
    refit_from: Optional[str] = None  # a saved *.report.json: fit again without measuring
    # CPU clock (jvarlen.profile.clock): the process pinned to one core (``cpu_core``, default the first
    # allowed one) and timed by process CPU time; XLA's own single-thread flag does not give one core
    cpu_pin: bool = True
    cpu_core: Optional[int] = None  # the core cpu_pin pins to (default: the first the process may use)
    cpu_single_thread: bool = False  # also pass --xla_cpu_multi_thread_eigen=false (old profiles did)
    # Ulysses degrees to profile; degrees > 1 use the reduced grid measure.SP_GRID and need that
    # many devices (on CPU, fake devices are added before JAX starts).
    sp: list[int] = dataclasses.field(default_factory=lambda: [1])
    extend_report: Optional[str] = None  # a saved *.report.json: measure only the degrees of `sp` it lacks, refit
    # with extend_report: measure the whole-model calibration chunks again (every degree of the
    # report, the current ProfileGrid.calibration) and refit; the layer grid is kept
    recalibrate: bool = False

    def __post_init__(self):
        if self.repeats < 1 or self.calibration_rounds < 1:
            raise ValueError(
                f"repeats and calibration_rounds must be >= 1, got {self.repeats}, {self.calibration_rounds}"
            )
        if any(d < 1 for d in self.sp):
            raise ValueError(f"sp degrees must be >= 1, got {self.sp}")
        if 1 not in self.sp and not self.extend_report:
            raise ValueError("sp must include 1 (the base profile) unless extend_report names a saved sp = 1 report")
        if self.recalibrate and not self.extend_report:
            raise ValueError("recalibrate needs extend_report (the saved *.report.json to recalibrate)")
        if self.refit_from:  # fits again without measuring: the measuring flags would be ignored
            measuring = ("sp", "extend_report", "recalibrate", "repeats", "calibration_rounds")
            named = [f"--{k}" for k in measuring if getattr(self, k) != _field_default(k)]
            if named:
                raise ValueError(f"refit_from fits a saved report again without measuring; {', '.join(named)} measure")


def _field_default(name: str):
    field = {f.name: f for f in dataclasses.fields(ProfileConfig)}[name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def cli(args: Optional[list[str]] = None) -> int:
    """The command line: prints the profile's path; bad flags or input files are one line on
    stderr and exit code 2."""
    try:
        print(main(args))
    except (ValueError, OSError, draccus.utils.DraccusException) as error:
        cause = error
        while isinstance(cause, draccus.utils.DraccusException) and cause.__cause__ is not None:
            cause = cause.__cause__
        print(f"jvarlen.profile: {type(cause).__name__}: {cause}", file=sys.stderr)
        return 2
    return 0


def main(args: Optional[list[str]] = None) -> str:
    cfg = draccus.parse(ProfileConfig, args=args, exit_on_error=False)
    # must happen before JAX initialises its CPU client; a recalibration runs every degree of its report
    degrees = list(cfg.sp)
    if cfg.extend_report and cfg.recalibrate:
        import json

        with open(cfg.extend_report) as f:
            degrees += [int(k) for k in json.load(f).get("sp_reports", {})]
    if max(degrees) > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            f"--xla_force_host_platform_device_count={max(degrees)} " + os.environ.get("XLA_FLAGS", "")
        ).strip()
    if cfg.cpu_single_thread:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + SINGLE_THREAD_XLA_FLAGS).strip()
    from jvarlen.profile.clock import cpu_backend_expected, pin_one_core

    if cfg.cpu_pin and cpu_backend_expected():
        pin_one_core(cfg.cpu_core)
    from jvarlen.profile.fit import run_profiler

    return run_profiler(cfg)
