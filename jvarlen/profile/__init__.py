"""The profiler: fits the cost model (jvarlen.plan.cost) on the backend in use.

``python -m jvarlen.profile`` (:mod:`.cli`) measures the real decoder on a grid of chunks with the
dual-layer method of DCP §3.5 (:mod:`.harness` runs chunks, :mod:`.measure` measures them), fits
the coefficients (:mod:`.fit`) and saves a profile JSON keyed by model shape, backend and device
kind; :mod:`.memory` checks the cost model's memory terms against XLA's ``memory_analysis``.

Importing this package does not start JAX: the command line sets XLA flags first.
"""

# XLA's CPU backend on one thread: profile times are then process CPU times of that thread
SINGLE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"


def main(args=None) -> str:
    """``python -m jvarlen.profile [flags]``; returns the path of the saved (or reused) profile."""
    from jvarlen.profile.cli import main as cli_main

    return cli_main(args)
