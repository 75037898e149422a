"""Export: a run's checkpoint -> a Hugging Face model directory that transformers loads.

``python -m jvarlen.export --run_dir RUN_DIR --out_dir OUT_DIR [--dtype bfloat16] [--step N]``
reads the run's newest (or given) checkpoint, only its parameters, as numpy arrays (Orbax partial
restore: the optimizer moments are not read), and writes ``config.json``
(:func:`jvarlen.hf.hf_config.hf_config_dict`), the weights in ``--dtype`` as ``model.safetensors``
or shards of at most ``--max_shard_gb`` with their index, and ``tokenizer.json``: ``--tokenizer``,
else the run's ``data.tokenizer`` file, else the one beside ``model.init_from``. Host memory: the
parameters once (in their checkpoint dtype) plus one output shard.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Literal, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jvarlen.config import ModelConfig
from jvarlen.hf.hf_config import HFCheckpointError, hf_config_dict, read_hf_config
from jvarlen.hf.safetensors_dir import write_sharded
from jvarlen.hf.weights import tensor_maps
from jvarlen.model import abstract_model

DTYPES = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16, "float16": np.float16}


@dataclasses.dataclass
class ExportConfig:
    run_dir: Optional[str] = None  # a jvarlen run directory (holds checkpoints/ and config.json)
    out_dir: Optional[str] = None  # the Hugging Face directory to write (created; files in it are replaced)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    step: Optional[int] = None  # checkpoint step; default the newest
    tokenizer: Optional[str] = None  # tokenizer.json to copy; default the run's data.tokenizer or init_from's
    max_shard_gb: float = 5.0  # larger weights are split into several safetensors files plus an index

    def __post_init__(self):
        if not self.run_dir or not self.out_dir:
            raise ValueError("give --run_dir (a jvarlen run directory) and --out_dir (where to write)")
        if self.max_shard_gb <= 0:
            raise ValueError(f"max_shard_gb must be > 0, got {self.max_shard_gb}")


def restore_params(run_dir: str, step: Optional[int] = None) -> tuple[ModelConfig, object, int]:
    """(model config, parameters as numpy arrays in an nnx State, step) of a run's checkpoint."""
    directory = os.path.join(os.path.abspath(run_dir), "checkpoints")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{run_dir!r} has no checkpoints/ directory: not a jvarlen run directory")
    manager = ocp.CheckpointManager(directory)
    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {directory}")
    saved = manager.restore(step, args=ocp.args.Composite(model=ocp.args.JsonRestore()))["model"]
    # init_from only said where the first weights came from; the checkpoint holds the model itself
    model = ModelConfig(**{**saved, "init_from": None})
    _, abstract = nnx.split(abstract_model(model), nnx.Param)
    target = {"params": jax.tree.map(lambda x: np.empty(x.shape, x.dtype), abstract)}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
    params = manager.restore(step, args=ocp.args.Composite(state=args))["state"]["params"]
    manager.close()
    return dataclasses.replace(model, init_from=saved.get("init_from")), params, step


def _parameter_arrays(params) -> dict[tuple[str, ...], np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {tuple(str(k.key) for k in p if isinstance(k, jax.tree_util.DictKey)): np.asarray(x) for p, x in leaves}


def write_hf(
    params,
    model: ModelConfig,
    out_dir: str,
    dtype: str = "bfloat16",
    *,
    base_config: Optional[dict] = None,
    tokenizer: Optional[str] = None,
    max_shard_bytes: int = 5 << 30,
) -> list[str]:
    """Writes ``params`` (jvarlen's parameter tree, numpy or JAX arrays) of ``model`` as a Hugging
    Face directory; returns the files written."""
    os.makedirs(out_dir, exist_ok=True)
    arrays = _parameter_arrays(params)
    np_dtype = np.dtype(DTYPES[dtype])

    def tensors():
        for m in tensor_maps(model):
            full = arrays[m.path]
            for layer in range(model.num_layers) if m.stacked else [None]:
                jv = full if layer is None else full[layer]
                yield m.hf_name(layer), m.hf_shape, np_dtype, (lambda m=m, jv=jv: m.to_hf(jv).astype(np_dtype))

    files = write_sharded(out_dir, tensors(), max_shard_bytes)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config_dict(model, dtype, base_config), f, indent=2)
    files.append("config.json")
    if tokenizer is not None:
        shutil.copyfile(tokenizer, os.path.join(out_dir, "tokenizer.json"))
        files.append("tokenizer.json")
    return files


def _tokenizer_for(run_dir: str, model: ModelConfig) -> Optional[str]:
    try:
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            spec = json.load(f)["data"]["tokenizer"]
        if spec != "byte" and os.path.isfile(spec):
            return spec
    except (OSError, KeyError, ValueError):
        pass
    if model.init_from and os.path.isfile(os.path.join(model.init_from, "tokenizer.json")):
        return os.path.join(model.init_from, "tokenizer.json")
    return None


def export_run(cfg: ExportConfig, say=print) -> list[str]:
    """The CLI's work: restore the parameters of ``cfg.run_dir`` and write ``cfg.out_dir``."""
    model, params, step = restore_params(cfg.run_dir, cfg.step)
    base = None
    if model.init_from:
        try:
            base = read_hf_config(model.init_from)
        except HFCheckpointError:
            say(f"[jvarlen] {model.init_from} (model.init_from) is gone; config.json gets default token ids")
    tokenizer = cfg.tokenizer or _tokenizer_for(cfg.run_dir, model)
    files = write_hf(
        params,
        dataclasses.replace(model, init_from=None),
        cfg.out_dir,
        cfg.dtype,
        base_config=base,
        tokenizer=tokenizer,
        max_shard_bytes=int(cfg.max_shard_gb * 2**30),
    )
    say(f"[jvarlen] step {step} of {cfg.run_dir} -> {cfg.out_dir} ({cfg.dtype}): {', '.join(files)}")
    if tokenizer is None:
        say("[jvarlen] no tokenizer.json copied (the run used the byte tokenizer); pass --tokenizer to add one")
    return files
