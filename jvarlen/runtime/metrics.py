"""Run output: a progress bar, a JSONL metrics file and TensorBoard event files."""

from __future__ import annotations

import json
import math
import os
from typing import Optional

from tqdm.auto import tqdm

from jvarlen.config import LoggingConfig


class MetricsLogger:
    """Writes one JSON object per step to ``<run_dir>/metrics.jsonl`` and to TensorBoard."""

    def __init__(
        self,
        run_dir: str,
        cfg: LoggingConfig,
        *,
        total_steps: int,
        initial_step: int = 0,
        show_progress: bool = True,
        write: bool = True,
    ):
        """``initial_step``: the step the run continues after (its checkpoint). Records of later
        steps, written by an earlier process that died before its next checkpoint, are dropped
        from ``metrics.jsonl`` and hidden from TensorBoard (``purge_step``), so every step
        appears once. ``write=False`` (processes other than 0) touches no file."""
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = None
        self._writer = None
        if write:
            truncate_records(self.path, initial_step)
            self._file = open(self.path, "a", encoding="utf-8")
        if write and cfg.tensorboard:
            from tensorboardX import SummaryWriter

            # also at step 0: a resume that found no checkpoint starts over, as metrics.jsonl does
            self._writer = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=initial_step + 1)
        self._bar = None
        if show_progress and cfg.progress_bar:
            self._bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict, postfix: Optional[dict] = None) -> None:
        if self._file is not None:
            self._file.write(json.dumps(_strict({"step": step, **metrics}), allow_nan=False) + "\n")
            self._file.flush()
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._writer.add_scalar(key, value, step)
        if self._bar is not None:
            self._bar.update(1)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)

    def write(self, message: str) -> None:
        """Prints without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()


def _strict(value):
    """``value`` with every non-finite float as None: JSON has no NaN or Infinity, and strict
    readers (jq, JavaScript, Go) reject a whole file holding one (Python's json writes them
    unless told not to). The step of a NaN loss says so in its ``nonfinite`` field."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def truncate_records(path: str, last_step: int) -> int:
    """Drops the records of steps after ``last_step`` (and a torn last line) from a metrics
    JSONL file; returns how many lines were dropped. The file is rewritten atomically."""
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                step = json.loads(line).get("step", 0)
            except json.JSONDecodeError:
                dropped += 1  # a line cut short by a kill
                continue
            if step <= last_step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        path = os.path.realpath(path)  # a link's target is rewritten and the link kept (os.replace would replace it)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    return dropped
