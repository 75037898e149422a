"""One run at a time in a run directory: an advisory lock on ``<run_dir>/.lock``.

Two runs writing one directory interleave their metric records and mix their checkpoints; the
fresh-run check (an earlier run's records or checkpoints) cannot see a second run that is still
starting (data loading, compiles). The first process of a run holds an exclusive ``flock`` on the
file for the run's life; the kernel drops it when the process ends, however it ends, so a killed
run leaves no stale lock. The file names its holder, for the refusal's message.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from typing import Callable

from jvarlen.config import ConfigError

LOCK_NAME = ".lock"


class RunDirLock:
    """Held from :meth:`acquire` to :meth:`release` (idempotent)."""

    def __init__(self, file):
        self._file = file

    @classmethod
    def acquire(cls, run_dir: str, say: Callable[[str], None]) -> "RunDirLock":
        """Raises :class:`ConfigError` naming the holder if another run holds ``run_dir``; on a file
        system without locks, says so and runs unguarded."""
        path = os.path.join(run_dir, LOCK_NAME)
        file = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "a process that has not written its name yet"
            file.close()
            raise ConfigError(
                f"logging.run_dir {run_dir!r} is in use by another run ({holder}); wait for it to end, "
                "or choose another logging.run_dir"
            ) from None
        except OSError as error:  # e.g. ENOLCK on a file system without locks
            say(f"[jvarlen] cannot lock {path} ({error.strerror or error}): nothing keeps a second run out of it")
            return cls(file)
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        file.flush()
        return cls(file)

    def remove_directory_if_unused(self) -> None:
        """Deletes the lock file, then the run directory and its subdirectories where they hold
        nothing else (a run refused at its start, in a directory it created); still held, so no
        other run can have taken the directory meanwhile."""
        if self._file is None:
            return
        run_dir = os.path.dirname(self._file.name)
        with contextlib.suppress(OSError):
            os.unlink(self._file.name)
        for folder, _, _ in sorted(os.walk(run_dir), key=lambda entry: -len(entry[0])):  # deepest first
            with contextlib.suppress(OSError):  # not empty: kept
                os.rmdir(folder)

    def release(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.close()  # closing the last descriptor of the open file drops the flock
