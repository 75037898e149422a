"""Import: a Hugging Face model directory's weights, streamed tensor block by tensor block from the
memory-mapped safetensors files straight into given shardings (the run's canonical FSDP one).

Each parameter becomes a global array shard by shard: every addressable device's shard is read
from the mapped file (per layer, for the stacked ``[L, ...]`` parameters),
converted to the parameter's dtype and placed on its device before the next is read. Beyond the
placed arrays, host memory holds one shard of one parameter at a time (docs/design/hf-interop.md,
"Memory"). With several processes each fills only its own devices' shards.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import jax
import numpy as np

from jvarlen.hf.hf_config import HFCheckpointError
from jvarlen.hf.safetensors_dir import SafetensorsDir
from jvarlen.hf.weights import IGNORED_SUFFIXES, TensorMap, tensor_maps

FLOAT_DTYPES = ("F64", "F32", "BF16", "F16")


def check_tensors(files: SafetensorsDir, cfg) -> None:
    """Every tensor the model needs is there with its shape; nothing else is (raises
    :class:`HFCheckpointError` listing what differs)."""
    expected = {}
    for m in tensor_maps(cfg):
        for layer in range(cfg.num_layers) if m.stacked else [None]:
            expected[m.hf_name(layer)] = m.hf_shape
    present = set(files.names())
    missing = sorted(set(expected) - present)
    wrong = [
        f"{n}: {files.shape(n)} (expected {s})" for n, s in expected.items() if n in present and files.shape(n) != s
    ]
    # integer or quantized tensors would be cast to floats as if they held the weights themselves
    not_float = [f"{n}: {files.dtype(n)}" for n in expected if n in present and files.dtype(n) not in FLOAT_DTYPES]
    tolerated = {"lm_head.weight"} if cfg.tie_embeddings else set()  # a tied head saved anyway
    extra = sorted(n for n in present - set(expected) - tolerated if not n.endswith(IGNORED_SUFFIXES))
    problems = []
    if missing:
        problems.append(
            f"missing {len(missing)} tensors ({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})"
        )
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong[:4]))
    if not_float:
        problems.append(f"not floating point ({', '.join(FLOAT_DTYPES)}): " + "; ".join(not_float[:4]))
    if extra:
        problems.append(
            f"{len(extra)} tensors jvarlen's model has no parameter for ({', '.join(extra[:4])}"
            f"{' ...' if len(extra) > 4 else ''})"
        )
    if problems:
        raise HFCheckpointError(f"{files.directory}: the weights do not match its config.json: " + "; ".join(problems))


def _parameter_key(path) -> tuple[str, ...]:
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def _shard_filler(m: TensorMap, read: Callable, shape: tuple[int, ...], dtype) -> Callable:
    """The callback giving one device's block (``index``: slices over ``shape``) of parameter ``m``."""

    def fill(index: tuple[slice, ...]) -> np.ndarray:
        if not m.stacked:
            return np.asarray(m.read(read, None, index), dtype=dtype)
        layers = range(*index[0].indices(shape[0]))
        out = None
        for i, layer in enumerate(layers):
            block = m.read(read, layer, index[1:])
            if out is None:
                out = np.empty((len(layers), *block.shape), dtype)
            out[i] = block
        return out

    return fill


def load_params(directory: str | os.PathLike, cfg, abstract_params: Any, shardings: Any) -> Any:
    """The parameters of jvarlen ModelConfig ``cfg`` from the HF model ``directory``, as global
    arrays with ``shardings`` (same tree as ``abstract_params``, whose leaves give shape and dtype)."""
    files = SafetensorsDir(directory)
    check_tensors(files, cfg)
    maps = {m.path: m for m in tensor_maps(cfg)}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    out = []
    for (path, leaf), sharding in zip(leaves, jax.tree.leaves(shardings)):
        m = maps[_parameter_key(path)]
        expected = ((cfg.num_layers,) if m.stacked else ()) + m.shape
        if tuple(leaf.shape) != expected:  # the table and the model disagree: a bug, not bad input
            raise AssertionError(f"{_parameter_key(path)}: model shape {leaf.shape}, table shape {expected}")
        fill = _shard_filler(m, files.read, tuple(leaf.shape), np.dtype(leaf.dtype))
        out.append(_place_shard_by_shard(tuple(leaf.shape), sharding, fill))
    return jax.tree.unflatten(treedef, out)


def _place_shard_by_shard(shape: tuple[int, ...], sharding, fill: Callable) -> jax.Array:
    """Like ``jax.make_array_from_callback``, but each device's shard is placed as soon as it is read
    (that function first collects every shard of the array on the host: a whole parameter)."""
    shards = [
        jax.device_put(fill(index), device) for device, index in sharding.addressable_devices_indices_map(shape).items()
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def load_report(directory: str | os.PathLike, seconds: float) -> str:
    files = SafetensorsDir(directory)
    return f"{len(files.names())} tensors, {files.nbytes() / 1e9:.2f} GB read from {directory} in {seconds:.1f}s"


def timed_load_params(directory, cfg, abstract_params, shardings) -> tuple[Any, str]:
    """:func:`load_params` and a line for the log (tensors, bytes, seconds)."""
    start = time.perf_counter()
    params = load_params(directory, cfg, abstract_params, shardings)
    jax.block_until_ready(params)
    return params, load_report(directory, time.perf_counter() - start)


def initial_state(config, devices=None, *, load: bool = True, say=lambda _: None):
    """The run's initial train state with ``config.model.init_from``'s weights, created directly in
    the canonical sharding over ``devices`` (default all): ``(graphdef, optimizer, placement, state,
    target)``, where ``target`` is the state's ShapeDtypeStructs with shardings (a checkpoint restore
    target) and ``state`` is None when ``load`` is False."""
    from jvarlen.parallel.sharding import Placement
    from jvarlen.runtime.state import abstract_train_state, train_state_around

    graphdef, optimizer, abstract = abstract_train_state(config)
    placement = Placement.for_state(abstract, optimizer, devices)
    target = jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        abstract,
        placement.state_sharding,
    )
    if not load:
        return graphdef, optimizer, placement, None, target
    params, report = timed_load_params(
        config.model.init_from, config.model, abstract.params, placement.state_sharding.params
    )
    say(f"[jvarlen] initial weights: {report}")
    state = train_state_around(config, optimizer, params, placement.state_sharding)
    return graphdef, optimizer, placement, state, target
