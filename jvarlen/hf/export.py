"""Export: a run's checkpoint -> a Hugging Face model directory that transformers loads.

``python -m jvarlen.export --run_dir RUN_DIR --out_dir OUT_DIR [--dtype bfloat16] [--step N]``
reads the run's newest (or given) checkpoint, only its parameters, as numpy arrays (Orbax partial
restore: the optimizer moments are not read), and writes ``config.json``
(:func:`jvarlen.hf.hf_config.hf_config_dict`), the weights in ``--dtype`` as ``model.safetensors``
or shards of at most ``--max_shard_gb`` with their index, and ``tokenizer.json``: ``--tokenizer``,
else the run's ``data.tokenizer`` file (none for the byte tokenizer), else, for a run directory
without ``config.json``, the one beside ``model.init_from``; with the ``tokenizer_config.json``,
``special_tokens_map.json`` and ``chat_template.jinja`` beside it (its special tokens, its chat
template). ``config.json`` carries that tokenizer's BOS/EOS/PAD ids (the byte tokenizer's
256/257/258 too) and a ``max_position_embeddings`` of at least the longest document trained on.
Host memory: the parameters once (in their checkpoint dtype) plus one output shard. The files are written beside
``OUT_DIR`` and moved in when complete; an ``OUT_DIR`` that already holds a model is refused unless
``--overwrite true`` (its earlier weights, index, config and tokenizer files are then replaced), and so
are the run directory and ``model.init_from`` themselves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Literal, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jvarlen.config import ModelConfig
from jvarlen.hf.hf_config import HFCheckpointError, hf_config_dict, read_hf_config
from jvarlen.hf.safetensors_dir import INDEX, write_sharded
from jvarlen.hf.weights import tensor_maps
from jvarlen.model import abstract_model
from jvarlen.runtime.checkpoint import (
    CHECKSUMS,
    is_storage_error,
    read_error_summary,
    state_checksums,
    verify_checksums,
)

# Saved beside a tokenizer.json by Hugging Face: its special tokens and chat template, copied with it
TOKENIZER_SIDECARS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
DTYPES = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16, "float16": np.float16}


# named: draccus reads no help comment beside an annotation with quotes (jvarlen/config.py)
ExportDtype = Literal["float32", "bfloat16", "float16"]


@dataclasses.dataclass
class ExportConfig:
    run_dir: Optional[str] = None  # a jvarlen run directory (holds checkpoints/ and config.json)
    out_dir: Optional[str] = None  # the Hugging Face directory to write (created; must be empty unless overwrite)
    dtype: ExportDtype = "bfloat16"  # of the written weights (cast from the checkpoint's)
    step: Optional[int] = None  # checkpoint step; default the newest
    tokenizer: Optional[str] = None  # tokenizer.json to copy; default the run's data.tokenizer or init_from's
    max_shard_gb: float = 5.0  # larger weights are split into several safetensors files plus an index
    overwrite: bool = False  # replace an earlier export in out_dir (its weights, index, config and tokenizer)

    def __post_init__(self):
        if not self.run_dir or not self.out_dir:
            raise ValueError("give --run_dir (a jvarlen run directory) and --out_dir (where to write)")
        if self.max_shard_gb <= 0:
            raise ValueError(f"max_shard_gb must be > 0, got {self.max_shard_gb}")


@dataclasses.dataclass
class SavedRun:
    """A run's checkpoint as export reads it: the model as trained (``init_from`` cleared: the
    checkpoint holds the model itself), the directory it started from, its parameters as numpy
    arrays in an nnx State, and the step."""

    model: ModelConfig
    init_from: Optional[str]
    params: object
    step: int
    data: Optional[dict] = None  # the checkpoint's data state (the pipeline's position and fingerprint)


def restore_params(run_dir: str, step: Optional[int] = None) -> SavedRun:
    """The parameters of a run's checkpoint (the newest, or ``step``), without its optimizer state."""
    directory = os.path.join(os.path.abspath(run_dir), "checkpoints")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{run_dir!r} has no checkpoints/ directory: not a jvarlen run directory")
    manager = ocp.CheckpointManager(directory)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {directory}")
        saved = _read(manager, step, directory, model=ocp.args.JsonRestore())["model"]
        # not re-read from init_from: that directory may have changed or gone since the run started
        model = ModelConfig(**{**saved, "init_from": None})
        _, abstract = nnx.split(abstract_model(model), nnx.Param)
        target = {"params": jax.tree.map(lambda x: np.empty(x.shape, x.dtype), abstract)}
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
        args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
        restored = _read(manager, step, directory, state=args, data=ocp.args.JsonRestore())
    finally:
        manager.close()
    params = restored["state"]["params"]
    differs = verify_checksums(state_checksums({"params": params}), (restored["data"] or {}).get(CHECKSUMS))
    if differs is not None:
        raise ValueError(
            f"checkpoint {step} in {directory}: {differs} does not hold the bits that were written (checksum); "
            "export an older checkpoint with --step"
        )
    return SavedRun(model, saved.get("init_from"), params, step, restored["data"])


def _read(manager: ocp.CheckpointManager, step: int, directory: str, **items) -> dict:
    """``manager.restore`` of ``items``; damage found while reading (a corrupt compressed frame, a
    truncated or missing file) is reported like a failed checksum, naming the step."""
    try:
        return manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as error:  # noqa: BLE001 (orbax and tensorstore raise their own types for damage)
        if is_storage_error(error):
            raise
        raise ValueError(
            f"checkpoint {step} in {directory} cannot be read ({read_error_summary(error)}); "
            "export an older checkpoint with --step"
        ) from error


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
    token_ids: Optional[dict[str, int]] = None,
    trained_length: Optional[int] = None,
) -> list[str]:
    """Writes ``params`` (jvarlen's parameter tree, numpy or JAX arrays) of ``model`` as a Hugging
    Face directory; returns the files written. ``out_dir`` must not hold a model already: weight
    files left from an earlier export would be read instead of, or mixed with, the new ones.
    ``token_ids`` and ``trained_length`` go to :func:`~jvarlen.hf.hf_config.hf_config_dict`
    (:func:`special_token_ids` gives a tokenizer's)."""
    os.makedirs(out_dir, exist_ok=True)
    earlier = _model_files(out_dir)
    if earlier:
        raise FileExistsError(
            f"{out_dir!r} already holds a model ({', '.join(earlier)}); write into an empty directory"
        )
    arrays = _parameter_arrays(params)
    np_dtype = np.dtype(DTYPES[dtype])

    def tensors():
        for m in tensor_maps(model):
            full = arrays[m.path]
            for layer in range(model.num_layers) if m.stacked else [None]:
                jv = full if layer is None else full[layer]
                name = m.hf_name(layer)
                yield name, m.hf_shape, np_dtype, (lambda m=m, jv=jv, name=name: _cast(name, m.to_hf(jv), np_dtype))

    files = write_sharded(out_dir, tensors(), max_shard_bytes)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        config = hf_config_dict(model, dtype, base_config, token_ids=token_ids, trained_length=trained_length)
        json.dump(config, f, indent=2)
    files.append("config.json")
    if tokenizer is not None:
        shutil.copyfile(tokenizer, os.path.join(out_dir, "tokenizer.json"))
        files.append("tokenizer.json")
        for name in TOKENIZER_SIDECARS:  # its special tokens (jvarlen read them from there too), its chat template
            sidecar = os.path.join(os.path.dirname(tokenizer), name)
            if os.path.isfile(sidecar):
                shutil.copyfile(sidecar, os.path.join(out_dir, name))
                files.append(name)
    return files


def _cast(name: str, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x`` in the export dtype; a value beyond its range (float16: 65,504) is refused, not
    written as inf."""
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name}: {int(np.sum(~np.isfinite(x)))} value(s) are NaN or Inf; nothing to export")
    with np.errstate(over="ignore"):
        y = x.astype(dtype)
    if not np.all(np.isfinite(y)):
        over = int(np.sum(~np.isfinite(y)))
        raise ValueError(
            f"{name}: {over} value(s) beyond {dtype.name}'s range (largest |x| {float(np.max(np.abs(x))):.4g}); "
            "export as bfloat16 or float32"
        )
    return y


def _run_data(run_dir: str) -> Optional[dict]:
    """The ``data`` settings of the run (its ``config.json``); None for a research API run without one."""
    try:
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            return dict(json.load(f)["data"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def _tokenizer_for(data: Optional[dict], init_from: Optional[str]) -> Optional[str]:
    """The tokenizer (``"byte"`` or a tokenizer.json) the run's data went through: its
    ``data.tokenizer``; beside ``init_from`` only when the run directory has no ``config.json`` (a
    research API run); None when unknown."""
    spec = (data or {}).get("tokenizer")
    if spec is None:
        if init_from and os.path.isfile(os.path.join(init_from, "tokenizer.json")):
            return os.path.join(init_from, "tokenizer.json")
        return None
    if spec != "byte" and not os.path.isfile(spec):  # another tokenizer would claim ids it did not make
        raise FileNotFoundError(
            f"the run's data.tokenizer {spec!r} is not a file (from {os.getcwd()}); pass --tokenizer=<that file>"
        )
    return spec


def special_token_ids(tokenizer: str, vocab_size: int) -> dict[str, int]:
    """The ids of ``tokenizer``'s (``"byte"`` or a tokenizer.json) BOS, EOS and PAD that a model of
    ``vocab_size`` can emit; PAD only when the file has it (one jvarlen appended would name an id no
    Hugging Face tokenizer of this file makes)."""
    from jvarlen.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    ids = {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}
    appended = getattr(tok, "appended", [])
    return {kind: int(i) for kind, i in ids.items() if i < vocab_size and not (kind == "pad" and kind in appended)}


def _model_files(directory: str) -> list[str]:
    """The files of a Hugging Face model directory that an export writes (and so replaces)."""
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    written = (INDEX, "config.json", "tokenizer.json", *TOKENIZER_SIDECARS)
    return [n for n in names if n.endswith(".safetensors") or n in written]


def _check_out_dir(cfg: ExportConfig, init_from: Optional[str]) -> str:
    """``cfg.out_dir`` resolved (links followed: the export is staged beside where its files land, so
    they are moved in, never copied across file systems), after refusing what would destroy data:
    the run directory itself, the model the run started from, a file, or an earlier export without
    ``--overwrite``."""
    out = os.path.realpath(cfg.out_dir)
    for other, what in ((cfg.run_dir, "the run directory"), (init_from, "the run's model.init_from")):
        if other and out == os.path.realpath(other):
            raise ValueError(f"--out_dir {cfg.out_dir!r} is {what}; export into a directory of its own")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out_dir {cfg.out_dir!r} exists and is not a directory")
    earlier = _model_files(out)
    if earlier and not cfg.overwrite:
        raise ValueError(
            f"--out_dir {cfg.out_dir!r} already holds a model ({', '.join(earlier)}); pass --overwrite=true to "
            "replace it"
        )
    return out


def _default_modes(directory: str) -> None:
    """The directory and its files as the process' umask would make them (``mkdtemp`` makes the
    staging directory 0700 and safetensors writes 0600: an export others, e.g. a serving container,
    could not read)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o666 & ~umask)


def _install(staging: str, out: str) -> None:
    """Moves a finished export from ``staging`` into ``out``, removing the earlier export's files
    first (every file is either the new export's or absent: no stale shard is left to be read)."""
    if not os.path.exists(out):
        os.replace(staging, out)
        return
    for name in _model_files(out):
        os.remove(os.path.join(out, name))
    for name in os.listdir(staging):
        os.replace(os.path.join(staging, name), os.path.join(out, name))
    os.rmdir(staging)


def export_run(cfg: ExportConfig, say=print) -> list[str]:
    """The CLI's work: restore the parameters of ``cfg.run_dir`` and write ``cfg.out_dir``. The
    export is written next to ``out_dir`` first and moved in when complete, so an interrupted
    export leaves ``out_dir`` as it was."""
    run = restore_params(cfg.run_dir, cfg.step)
    out = _check_out_dir(cfg, run.init_from)
    if cfg.tokenizer is not None and not os.path.isfile(cfg.tokenizer):
        raise FileNotFoundError(f"--tokenizer {cfg.tokenizer!r} is not a file")
    base = None
    if run.init_from:
        try:
            base = read_hf_config(run.init_from)
        except HFCheckpointError:
            say(f"[jvarlen] {run.init_from} (model.init_from) is gone; config.json gets default token ids")
    data = _run_data(cfg.run_dir)
    spec = cfg.tokenizer or _tokenizer_for(data, run.init_from)
    token_ids = special_token_ids(spec, run.model.vocab_size) if spec else None
    tokenizer = None if spec == "byte" else spec
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    try:
        files = write_hf(
            run.params,
            run.model,
            staging,
            cfg.dtype,
            base_config=base,
            tokenizer=tokenizer,
            max_shard_bytes=int(cfg.max_shard_gb * 2**30),
            token_ids=token_ids,
            trained_length=(data or {}).get("max_doc_tokens") or (data or {}).get("seq_len"),
        )
        _default_modes(staging)
        _install(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"[jvarlen] step {run.step} of {cfg.run_dir} -> {cfg.out_dir} ({cfg.dtype}): {', '.join(files)}")
    if spec == "byte":
        say("[jvarlen] no tokenizer.json copied (the run used the byte tokenizer); pass --tokenizer to add one")
    elif spec is None:
        say(
            f"[jvarlen] {cfg.run_dir} names no tokenizer (no config.json) and {run.init_from or 'the run'} has no "
            "tokenizer.json: config.json's token ids are the base's or none; pass --tokenizer to set them"
        )
    return files
