"""Run output: a progress bar, a JSONL metrics file and TensorBoard event files."""

from __future__ import annotations

import json
import os
from typing import Optional

from tqdm.auto import tqdm

from jvarlen.config import LoggingConfig


class MetricsLogger:
    """Writes one JSON object per step to ``<run_dir>/metrics.jsonl`` and to TensorBoard."""

    def __init__(
        self, run_dir: str, cfg: LoggingConfig, *, total_steps: int, initial_step: int = 0, show_progress: bool = True
    ):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")
        self._writer = None
        if cfg.tensorboard:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        self._bar = None
        if show_progress and cfg.progress_bar:
            self._bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict, postfix: Optional[dict] = None) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
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
        self._file.close()
