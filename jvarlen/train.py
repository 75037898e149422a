"""``python -m jvarlen.train [--config FILE.yaml] [--section.field=value ...]``.

With no arguments it trains the default tiny model on the embedded corpus (the running
Python's standard library sources).
"""

from __future__ import annotations

import os
import sys

from jvarlen.config import ConfigError, parse_config
from jvarlen.layout import requested_devices, resolve_layout


def host_device_flags(flags: str, devices: int) -> str:
    """``XLA_FLAGS`` giving the host platform the ``devices`` a run's layout asks for (every path:
    the pipeline, the device groups, data-parallel and Ulysses layouts), so that it runs on a
    CPU-only host as it would on as many GPUs (the flag has no effect on GPU/TPU devices); a device
    count already set is kept."""
    if devices <= 1 or "xla_force_host_platform_device_count" in flags:
        return flags
    return f"{flags} --xla_force_host_platform_device_count={devices}".strip()


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv)
        resolve_layout(config)  # the layout the run asks for, checked before JAX starts
    except (ConfigError, FileNotFoundError) as error:
        print(f"jvarlen.train: configuration error: {error}", file=sys.stderr)
        return 2
    flags = os.environ.get("XLA_FLAGS", "")
    wanted = host_device_flags(flags, requested_devices(config))
    if "jax" not in sys.modules and wanted != flags:
        os.environ["XLA_FLAGS"] = wanted
    from jvarlen.data import DataError
    from jvarlen.plan.api import PlanningError
    from jvarlen.runtime.checkpoint import (
        CheckpointMismatchError,
        CheckpointReadError,
        CheckpointWriteError,
        NonFiniteStateError,
        NoReadableCheckpointError,
    )
    from jvarlen.runtime.distributed import report_failure
    from jvarlen.runtime.loop import Interrupted, NonFiniteError, train

    try:
        train(config)
    except (ConfigError, DataError, CheckpointMismatchError, PlanningError) as error:  # fix the input
        print(f"jvarlen.train: {type(error).__name__}: {error}", file=sys.stderr)
        report_failure(2, error)
        return 2
    except (
        NonFiniteError,
        NonFiniteStateError,
        NoReadableCheckpointError,
        CheckpointReadError,
        CheckpointWriteError,
    ) as error:
        print(f"jvarlen.train: {type(error).__name__}: {error}", file=sys.stderr)
        report_failure(1, error)
        return 1
    except Interrupted as stop:  # every process stops after the same step (agreed in the loop)
        print(f"jvarlen.train: {stop}; continue with --checkpoint.resume=true", file=sys.stderr)
        return stop.exit_code
    # a bug, a second Ctrl-C: the other processes of a distributed run must not wait for this one
    except (Exception, KeyboardInterrupt) as error:
        report_failure(130 if isinstance(error, KeyboardInterrupt) else 1, error)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
