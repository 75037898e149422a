"""Multi-host start-up: ``jax.distributed.initialize`` from the config or the cluster.

Call :func:`initialize` before anything touches a device. With
``parallel.distributed=true``:

* ``coordinator_address`` + ``num_processes`` + ``process_id`` given: used as is (any
  launcher; e.g. ``127.0.0.1:12345`` for processes on one machine);
* none of them: JAX's cluster auto-detection (SLURM ``srun``, Open MPI, Kubernetes…);
  outside a detectable cluster this fails with JAX's message.

Every process then runs the same program; ``jax.devices()`` lists all devices of all
processes and the layouts span them (jvarlen.parallel.layouts orders them by process).
"""

from __future__ import annotations

import jax

from jvarlen.config import ConfigError, ParallelConfig

_initialized = False


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
        )
    else:
        jax.distributed.initialize()  # auto-detects SLURM / MPI / ... or raises
    _initialized = True
    return True


def check_same(named: dict) -> None:
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
        raise ConfigError(
            f"the {jax.process_count()} processes of this run differ in {', '.join(differ)}; every process must "
            "see the same config, data, cost profile (train.cost_profile, ~/.cache/jvarlen/profiles) and caches "
            "(data.cache_dir) or they would train differently"
        )
