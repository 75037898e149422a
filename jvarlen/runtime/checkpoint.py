"""Orbax checkpoints of the train state, the sampler position and the run's model shape."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from jvarlen.config import CheckpointConfig, ModelConfig


class CheckpointMismatchError(ValueError):
    """The checkpoint does not belong to this model (shape or dtype differ)."""


class Checkpointer:
    """Saves ``TrainState`` + data-pipeline state + model config every N steps (async)."""

    def __init__(self, directory: str | os.PathLike, cfg: CheckpointConfig):
        self.cfg = cfg
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.max_to_keep,
            enable_async_checkpointing=cfg.async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def should_save(self, step: int, last_step: int) -> bool:
        return step % self.cfg.every_steps == 0 or step == last_step

    def save(self, step: int, state: Any, data_state: dict, model_cfg: ModelConfig) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                model=ocp.args.JsonSave(dataclasses.asdict(model_cfg)),
            ),
        )

    def restore(self, abstract_state: Any, model_cfg: ModelConfig, step: Optional[int] = None):
        """Returns (step, state, data_state); ``abstract_state`` gives shapes and shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.directory}")
        saved_model = self.manager.restore(step, args=ocp.args.Composite(model=ocp.args.JsonRestore()))["model"]
        _check_same_model(saved_model, dataclasses.asdict(model_cfg), self.directory)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
            ),
        )
        return step, restored["state"], restored["data"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _check_same_model(saved: dict, current: dict, directory: str) -> None:
    shape_keys = [k for k in current if k not in ("attention", "remat", "compute_dtype")]
    diffs = [
        f"model.{key}: checkpoint has {saved.get(key)!r}, config has {current[key]!r}"
        for key in shape_keys
        if saved.get(key) != current[key]
    ]
    if diffs:
        raise CheckpointMismatchError(
            f"cannot resume from {directory}: the checkpoint was written by a different model ("
            + "; ".join(diffs)
            + "). Use the original model settings or a fresh logging.run_dir."
        )


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a concrete pytree, as orbax restore targets."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
