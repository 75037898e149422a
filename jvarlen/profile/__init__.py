"""The profiler: fits the cost model (jvarlen.plan.cost) on the backend in use.

``python -m jvarlen.profile`` (:mod:`.cli`) measures the real decoder on a grid of chunks with the
dual-layer method of DCP §3.5 (:mod:`.harness` runs chunks, :mod:`.measure` measures them), fits
the coefficients (:mod:`.fit`) and saves a profile JSON keyed by model shape, backend and device
kind; :mod:`.memory` checks the cost model's memory terms against XLA's ``memory_analysis``.

Importing this package does not start JAX: the command line sets XLA flags first.
"""

# Asks XLA's CPU backend for one Eigen thread. JAX 0.10.2 still runs a program over every core the
# process may use, so the one-core clock is the pinned process (:mod:`jvarlen.profile.clock`); the
# flag is kept for older reports and `--cpu_single_thread true`.
SINGLE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"


def main(args=None) -> str:
    """``python -m jvarlen.profile [flags]``; returns the path of the saved (or reused) profile."""
    from jvarlen.profile.cli import main as cli_main

    return cli_main(args)
