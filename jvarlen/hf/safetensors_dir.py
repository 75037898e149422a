"""The safetensors files of a Hugging Face model directory: read tensor blocks from the
memory-mapped files, write tensors shard by shard (the ``safetensors`` package, numpy API).

Reading opens the file for each block and closes it after (``safe_open`` maps the file; closing
unmaps it), so the pages a block touched are not kept mapped into the process while the rest of
the model streams in: the import's resident memory beyond the placed arrays is one block.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Callable, Iterable, Optional

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jvarlen.hf.hf_config import HFCheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsDir:
    """Tensor name -> file of a model directory, found as transformers finds it: ``model.safetensors``
    when there is one, else the index's weight map, else every ``*.safetensors`` file's own table (a
    tensor in two of them is refused). Unreadable files raise :class:`HFCheckpointError` naming them."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        single, index = os.path.join(self.directory, SINGLE), os.path.join(self.directory, INDEX)
        if os.path.isfile(single):
            self.files = {name: single for name in _keys(single)}
        elif os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                self.files = {name: os.path.join(self.directory, file) for name, file in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                raise HFCheckpointError(f"{index}: not a safetensors index with a weight_map ({error!r})") from None
        else:
            paths = sorted(glob.glob(os.path.join(self.directory, "*.safetensors")))
            if not paths:
                raise HFCheckpointError(f"{self.directory!r} holds no *.safetensors file (and no {INDEX})")
            self.files = {}
            for path in paths:
                for name in _keys(path):
                    if name in self.files:
                        raise HFCheckpointError(
                            f"{self.directory!r}: tensor {name!r} is in both {os.path.basename(self.files[name])} "
                            f"and {os.path.basename(path)}, and no {INDEX} says which to read"
                        )
                    self.files[name] = path
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for path in sorted(set(self.files.values())):
            if not os.path.isfile(path):
                raise HFCheckpointError(f"{INDEX} names {os.path.basename(path)!r}, which is not in {self.directory!r}")
            try:
                with safe_open(path, framework="np") as f:
                    for name in f.keys():
                        if self.files.get(name) == path:
                            piece = f.get_slice(name)
                            self._shapes[name] = tuple(piece.get_shape())
                            self._dtypes[name] = piece.get_dtype()
            except (OSError, SafetensorError) as error:
                raise HFCheckpointError(f"{path}: not a readable safetensors file ({error})") from None
        absent = sorted(set(self.files) - set(self._shapes))
        if absent:  # an index out of step with its shards (a re-shard half copied)
            raise HFCheckpointError(
                f"{INDEX} in {self.directory!r} puts {len(absent)} tensor(s) in files that do not hold them, e.g. "
                f"{absent[0]!r} in {os.path.basename(self.files[absent[0]])}"
            )

    def names(self) -> list[str]:
        return sorted(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        """The safetensors dtype tag (``BF16``, ``F32``, ...)."""
        return self._dtypes[name]

    def nbytes(self) -> int:
        sizes = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
        return sum(int(np.prod(s)) * sizes.get(self._dtypes[n], 4) for n, s in self._shapes.items())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The block ``index`` of tensor ``name``: only those bytes are copied out of the mapping."""
        with safe_open(self.files[name], framework="np") as f:
            return f.get_slice(name)[index]


def _keys(path: str) -> list[str]:
    try:
        with safe_open(path, framework="np") as f:
            return list(f.keys())
    except (OSError, SafetensorError) as error:
        raise HFCheckpointError(f"{path}: not a readable safetensors file ({error})") from None


def write_sharded(
    directory: str | os.PathLike,
    tensors: Iterable[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]],
    max_shard_bytes: int = 2 << 30,
    metadata: Optional[dict] = None,
) -> list[str]:
    """Writes ``(name, shape, dtype, make)`` tensors into ``model.safetensors`` or, past
    ``max_shard_bytes``, ``model-0000i-of-0000n.safetensors`` plus the index. A tensor is made only
    when its shard is written, so at most one shard's tensors are in memory. Returns the files."""
    directory = os.fspath(directory)
    shards: list[list] = [[]]
    size = 0
    total = 0
    for item in tensors:
        nbytes = int(np.prod(item[1])) * np.dtype(item[2]).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
        total += nbytes
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for file, shard in zip(names, shards):
        arrays = {}
        for name, shape, dtype, make in shard:
            array = np.ascontiguousarray(make(), dtype=dtype)
            if array.shape != tuple(shape):
                raise ValueError(f"tensor {name}: made {array.shape}, expected {tuple(shape)}")
            arrays[name] = array
            weight_map[name] = file
        save_file(arrays, os.path.join(directory, file), metadata={"format": "pt", **(metadata or {})})
        del arrays
    if len(shards) > 1:
        with open(os.path.join(directory, INDEX), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names
