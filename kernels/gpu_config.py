"""Which GPU the Pallas kernels compile for, and their launch configuration on it.

The tile *schedule* (``BlockInfo``, ``BlockSizes``: 128 x 128 by default) is shared by the
model, the cost model and every implementation. How a kernel walks it is a separate,
per-GPU choice: a program may own a fraction of a schedule block and loop over fractions
of the listed tiles (``KernelTiles``), with its own ``num_warps`` / ``num_stages``. A sub-tile
of a fully visible tile is fully visible and a sub-tile of a partial one is masked, so any
fraction is exact; smaller tiles only trade speed for shared memory and registers.

``kernel_config(dtype, head_dim, target)`` picks from ``_TABLE``, keyed by the target's
shared memory per block and compute capability. The rows were chosen with deviceless
compiles (``scripts/gpu_compile_check.py``): the largest tiles whose Triton kernels fit the
shared memory without register spills. Only the Hopper bf16 row of head dims 65-128 has been
timed on a GPU (at D = 128 on an H200, ``scripts/tune_kernel_tiles.py``, docs/benchmarks.md):
its forward and dq tiles were the fastest candidates; the others are compile-checked only.

The target is, in order: the one set by ``with compile_for(target):`` (deviceless
compilation, or forcing a config), else the first device when JAX's default backend is a
GPU, else none (CPU: the XLA path, or Pallas in interpret mode with the schedule's blocks).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from typing import Iterator, Optional

import jax
import numpy as np

from jvarlen.kernels.common import UnsupportedError

# Head dims the Pallas kernels accept (after padding to a power of two, see api.py).
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """What the kernel configuration depends on: compute capability and shared memory."""

    name: str
    compute_capability: tuple[int, int]
    shared_memory_per_block: int  # bytes a block may opt in to
    memory_bytes: Optional[int] = None  # device memory, when known

    @classmethod
    def from_spec(cls, text: str, name: Optional[str] = None) -> "GpuTarget":
        """From an XLA GPU target spec (``gpu_target_config`` text proto)."""

        def field(key, default=None):
            m = re.search(rf"\b{key}:\s*\"?([^\"\n]+)\"?", text)
            return m.group(1).strip() if m else default

        cc = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", text)
        major = int(re.search(r"major:\s*(\d+)", cc.group(1)).group(1)) if cc else 0
        minor_m = re.search(r"minor:\s*(\d+)", cc.group(1)) if cc else None
        minor = int(minor_m.group(1)) if minor_m else 0
        mem = field("device_memory_size")
        return cls(
            name=name or field("device_description_str", "gpu"),
            compute_capability=(major, minor),
            shared_memory_per_block=int(field("shared_memory_per_block_optin", "0")),
            memory_bytes=int(mem) if mem else None,
        )

    @classmethod
    def from_device(cls, device) -> "GpuTarget":
        """From a (real or abstract) CUDA device: ``compute_capability`` + the table below."""
        cc = tuple(int(x) for x in str(device.compute_capability).split(".")[:2])
        smem = _SHARED_MEMORY_BY_CC.get(cc) or _SHARED_MEMORY_BY_CC.get((cc[0], 0)) or 101_376
        memory = None
        try:
            stats = device.memory_stats() or {}
            memory = stats.get("bytes_limit")
        except Exception:  # abstract devices have no allocator
            memory = None
        return cls(name=device.device_kind, compute_capability=cc, shared_memory_per_block=smem, memory_bytes=memory)


# Opt-in shared memory per block by compute capability (CUDA programming guide, table 21).
_SHARED_MEMORY_BY_CC = {
    (7, 0): 98_304,
    (7, 5): 65_536,
    (8, 0): 166_912,  # A100
    (8, 6): 101_376,
    (8, 7): 166_912,
    (8, 9): 101_376,  # L4, L40
    (9, 0): 232_448,  # H100, H200
    (10, 0): 232_448,  # B200
    (12, 0): 101_376,
}


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """One Pallas kernel's launch: rows of its q and kv tiles, warps, software pipeline depth.

    For the forward and dq kernels a program owns ``block_q`` query rows and loops over kv
    tiles of ``block_kv`` rows; for dk/dv a program owns ``block_kv`` key rows and loops over
    ``block_q`` query rows. Each is capped at the schedule's block (it must divide it).
    """

    block_q: int = 128
    block_kv: int = 128
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"KernelTiles.{name} must be a power of two >= 16, got {val}")

    def fit(self, block_q: int, block_kv: int) -> "KernelTiles":
        """These tiles capped at the schedule's blocks."""
        return dataclasses.replace(self, block_q=min(self.block_q, block_q), block_kv=min(self.block_kv, block_kv))


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch configuration of the three kernels (forward, dq, dk/dv)."""

    fwd: KernelTiles = KernelTiles()
    dq: KernelTiles = KernelTiles()
    dkv: KernelTiles = KernelTiles()

    @classmethod
    def uniform(cls, block_q: int, block_kv: int, num_warps: int = 4, num_stages: int = 2) -> "KernelConfig":
        t = KernelTiles(block_q, block_kv, num_warps, num_stages)
        return cls(t, t, t)


def _t(bq, bk, warps, stages=2):
    return KernelTiles(bq, bk, warps, stages)


# (minimum shared memory per block, bytes per element, largest padded head dim) -> config.
# First matching row wins; rows are ordered from the largest GPUs down. The H100 and A100
# rows are the output of ``python scripts/gpu_compile_check.py --search`` (deviceless
# compiles, 8 q / 2 kv heads; per kernel the largest tiles that fit the shared memory with
# no register spills; the one exception, H100 f32 d=256 dk/dv, spills 808 B at the
# smallest tile). Four H100 tiles were re-chosen on 2026-11-26: compiled at XLA's default
# backend optimization level they spilled 20-72 B (see the comments on those rows). The rows below 163 KB are NOT compile-checked (no target spec here): the
# A100 4-byte rows reused for 2-byte inputs (same bytes per tile at half the rows) and the
# smallest tiles for 4-byte inputs.
_TABLE: list[tuple[int, int, int, KernelConfig]] = [
    # Hopper / Blackwell (227 KB)
    (232_448, 2, 64, KernelConfig(_t(128, 128, 8), _t(64, 128, 4), _t(64, 64, 4))),  # fwd, 4 warps: 32 B spill
    (232_448, 2, 128, KernelConfig(_t(128, 128, 8), _t(128, 128, 8), _t(128, 64, 8))),
    (232_448, 2, 256, KernelConfig(_t(64, 64, 8), _t(64, 32, 8), _t(32, 32, 8))),  # dq (64, 64): 72 B spill
    (232_448, 4, 64, KernelConfig(_t(64, 64, 4), _t(64, 32, 4), _t(32, 32, 4))),  # dk/dv (64, 32): 20 B at D=32
    (232_448, 4, 128, KernelConfig(_t(64, 32, 8), _t(32, 64, 8), _t(16, 16, 8))),  # dq (64, 32): 36 B spill
    (232_448, 4, 256, KernelConfig(_t(32, 32, 8), _t(32, 32, 8), _t(16, 16, 8))),
    # A100 (163 KB)
    (166_912, 2, 64, KernelConfig(_t(128, 64, 4), _t(64, 64, 4), _t(64, 32, 4))),
    (166_912, 2, 128, KernelConfig(_t(128, 64, 8), _t(64, 128, 8), _t(64, 32, 8))),
    (166_912, 2, 256, KernelConfig(_t(64, 64, 8), _t(64, 64, 8), _t(32, 32, 8))),
    (166_912, 4, 64, A100_F32_64 := KernelConfig(_t(64, 128, 4), _t(64, 32, 4), _t(32, 32, 4))),
    (166_912, 4, 128, A100_F32_128 := KernelConfig(_t(64, 64, 8), _t(64, 64, 8), _t(16, 16, 8))),
    (166_912, 4, 256, A100_F32_256 := KernelConfig(_t(32, 16, 8), _t(32, 16, 8), _t(16, 16, 8))),
    # consumer Ampere / Ada and smaller (99 KB): not compile-checked, see above
    (0, 2, 64, A100_F32_64),
    (0, 2, 128, A100_F32_128),
    (0, 2, 256, A100_F32_256),
    (0, 4, 64, KernelConfig(_t(32, 32, 4), _t(32, 32, 4), _t(16, 16, 4))),
    (0, 4, 128, KernelConfig(_t(32, 16, 8), _t(32, 16, 8), _t(16, 16, 8))),
    (0, 4, 256, KernelConfig(_t(16, 16, 8), _t(16, 16, 8), _t(16, 16, 8))),
]


def kernel_config(dtype, head_dim: int, target: Optional[GpuTarget]) -> KernelConfig:
    """The launch configuration for ``dtype`` inputs of (padded) ``head_dim`` on ``target``.

    ``target=None`` (interpret mode, no GPU): tiles equal to the schedule's blocks.
    """
    if target is None:
        return KernelConfig()
    itemsize = np.dtype(dtype).itemsize
    for smem, size, max_d, cfg in _TABLE:
        if target.shared_memory_per_block >= smem and itemsize == size and head_dim <= max_d:
            return cfg
    raise UnsupportedError(
        f"no Pallas kernel configuration for {np.dtype(dtype).name} head dim {head_dim} on {target.name}: "
        f"head dims up to {MAX_HEAD_DIM} in 2- or 4-byte floats are supported; use implementation='xla'"
    )


_TARGET: contextvars.ContextVar[Optional[GpuTarget]] = contextvars.ContextVar("jvarlen_gpu_target", default=None)


@contextlib.contextmanager
def compile_for(target) -> Iterator[GpuTarget]:
    """Traces inside this block compile the attention for ``target`` (a :class:`GpuTarget`,
    a CUDA device or an XLA target spec's text): ``implementation="auto"`` selects the
    compiled Pallas kernels with this target's configuration, and ``compute_dtype="auto"``
    means bfloat16, as on a GPU. For deviceless compilation (``jax.experimental.topologies``)."""
    if isinstance(target, str):
        target = GpuTarget.from_spec(target)
    elif not isinstance(target, GpuTarget):
        target = GpuTarget.from_device(target)
    token = _TARGET.set(target)
    try:
        yield target
    finally:
        _TARGET.reset(token)


def current_target() -> Optional[GpuTarget]:
    """The GPU traced code compiles for: ``compile_for``'s, else the default GPU, else None."""
    target = _TARGET.get()
    if target is not None:
        return target
    if jax.default_backend() == "gpu":
        device = jax.devices()[0]
        if getattr(device, "compute_capability", None):  # CUDA (ROCm devices have none)
            return GpuTarget.from_device(device)
    return None


def compiles_for_gpu() -> bool:
    """Whether traced code targets a GPU (a real default GPU, or inside ``compile_for``)."""
    return _TARGET.get() is not None or jax.default_backend() == "gpu"
