"""What a run directory holds, for the run that claims it: an earlier run's records and
checkpoints (refused, or deleted with ``logging.overwrite``), and with several processes the check
that the directory is one directory to all of them."""

from __future__ import annotations

import os
import shutil
from typing import Optional

import jax
import numpy as np

from jvarlen.config import ConfigError
from jvarlen.runtime import distributed
from jvarlen.runtime.checkpoint import CheckpointWriteError


def claim_fresh(run_dir: str, overwrite: bool) -> Optional[str]:
    """A run that starts at step 0 in ``run_dir``: refuses one holding an earlier run (whose
    records it would drop and whose checkpoints it would mix with its own); with ``overwrite``,
    what that run left, in words (for :func:`delete_earlier_run`), or None if nothing."""
    found = earlier_run(run_dir)
    if found is not None and not overwrite:
        raise ConfigError(
            f"logging.run_dir {run_dir!r} holds an earlier run ({found}). Continue it with "
            f"--checkpoint.resume=true, start over with --logging.overwrite=true (deletes its metrics, "
            f"TensorBoard events and checkpoints), or choose another logging.run_dir"
        )
    return found


def earlier_run(run_dir: str) -> Optional[str]:
    """What an earlier run left in ``run_dir`` (metric records, checkpoints), in words; None if
    nothing."""
    found = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            records = sum(1 for line in f if line.strip())
        if records:
            found.append(f"{records} metric records")
    steps = checkpoint_steps(run_dir)
    if steps:
        found.append(f"checkpoints of steps {', '.join(map(str, steps))}")
    return " and ".join(found) or None


def delete_earlier_run(run_dir: str) -> None:
    """Deletes what :func:`earlier_run` found. A ``checkpoints/`` or ``tensorboard/`` that links
    to another disk is emptied and the link kept, as is a linked ``metrics.jsonl`` (rmtree refuses a link; before, that was
    swallowed and the earlier run's newer steps made Orbax decline every save of the new run).
    Raises where anything of the earlier run is left."""
    earlier_configs = [n for n in os.listdir(run_dir) if n.startswith("config.until-step-")]
    for name in ("metrics.jsonl", "config.json", *earlier_configs):
        path = os.path.join(run_dir, name)
        if name == "metrics.jsonl" and os.path.islink(path) and os.path.isfile(path):
            open(path, "w").close()  # records linked to elsewhere: emptied there, and the new run's go there too
        elif os.path.lexists(path):
            os.remove(path)
    for name in ("checkpoints", "tensorboard"):
        path = os.path.join(run_dir, name)
        if os.path.islink(path) and os.path.isdir(path):
            for entry in os.scandir(path):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.remove(entry.path)
        elif os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):  # a file, or a link to nothing
            os.remove(path)
    left = earlier_run(run_dir)
    if left is not None:
        raise CheckpointWriteError(f"logging.overwrite could not delete the earlier run in {run_dir}: {left} remain")


def checkpoint_steps(run_dir: str) -> list[int]:
    """The finalized checkpoints' steps in ``run_dir`` as its directory lists them (no Orbax
    manager: read before a run claims the directory)."""
    ckpt = os.path.join(run_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(ckpt) if n.isdigit()) if os.path.isdir(ckpt) else []


def check_one_run_dir(run_dir: str, main: bool) -> None:
    """With several processes: refuses a ``logging.run_dir`` that is not one directory to all of
    them (a local disk per host, or a mount that differs): process 0 writes a file there that every
    process must read back, and all must list the same checkpoints. Checkpoint writes would otherwise
    wait for each other's files until Orbax's 20-minute timeout, and a resume would read different
    steps on different processes."""
    if jax.process_count() == 1:
        return
    import secrets

    from jax.experimental import multihost_utils

    # a name no earlier run used (a client's cached lookup of an old one cannot answer for it)
    token = secrets.randbits(31) if main else 0  # int32: what a device array holds without x64
    token = int(multihost_utils.broadcast_one_to_all(np.int32(token)))
    probe = os.path.join(run_dir, f".jvarlen-shared-{token:x}")
    if main:
        with open(probe, "w", encoding="utf-8") as f:
            f.write(f"{token:x}")
    try:
        multihost_utils.sync_global_devices("jvarlen: run directory probe written")
        try:
            with open(probe, encoding="utf-8") as f:
                seen = f.read()
        except OSError:
            seen = ""
        distributed.check_same(
            {
                f"the file process 0 wrote into logging.run_dir={run_dir}": seen,
                "the checkpoints they see there": checkpoint_steps(run_dir),
            },
            advice="logging.run_dir must be one directory to every process: a file system they all mount at that path",
        )
    finally:
        if main and os.path.exists(probe):
            os.remove(probe)
