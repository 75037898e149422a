"""Does a compiled step fit the device's memory? Checked before the first run.

XLA knows what a compiled program needs per device (``compiled.memory_analysis()``:
arguments + outputs + temporaries − donated buffers). JAX's GPU allocator may use only a
fraction of the device: by default it preallocates 75 % (``XLA_PYTHON_CLIENT_MEM_FRACTION``),
and ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` lets it use everything. A step that needs more
than the allocator may use dies in the allocator at its first run, with a message about a
failed allocation; :func:`check_fit` says it up front, with the figure and the setting to
change. The fraction is read at backend start, so it cannot be changed from inside a
running process: the message says what to set before starting.

    fit = check_fit(compiled, jax.devices()[0])
    if not fit.fits:
        raise DeviceMemoryError(fit.message)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

GiB = 2**30
DEFAULT_FRACTION = 0.75  # JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION on GPU
# Above this fraction the CUDA context, cuDNN/cuBLAS workspaces and NCCL buffers (outside
# XLA's allocator) may no longer fit next to the preallocated pool.
SAFE_FRACTION = 0.95


class DeviceMemoryError(MemoryError):
    """A compiled step needs more device memory than the allocator may use."""


@dataclasses.dataclass(frozen=True)
class MemoryFit:
    fits: bool
    need_bytes: int  # per device, from memory_analysis()
    limit_bytes: Optional[int]  # what the allocator may use (None: unknown, e.g. CPU)
    device_bytes: Optional[int]  # the device's memory, when known
    message: str


def need_bytes(memory) -> int:
    """Per-device bytes of a compiled program: arguments + outputs + temporaries + code −
    donated (aliased) bytes. ``memory``: ``compiled.memory_analysis()`` or a dict of its fields."""

    def get(name):
        value = memory.get(name, 0) if isinstance(memory, Mapping) else getattr(memory, name, 0)
        return int(value or 0)

    total = sum(
        get(n)
        for n in (
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "temp_size_in_bytes",
            "generated_code_size_in_bytes",
        )
    )
    return total - get("alias_size_in_bytes")


def allocator_fraction(env: Optional[Mapping[str, str]] = None) -> tuple[float, str]:
    """(fraction of device memory JAX's allocator may use, the setting that says so)."""
    env = os.environ if env is None else env
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return 1.0, "XLA_PYTHON_CLIENT_ALLOCATOR=platform"
    raw = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if raw:
        return float(raw), f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw}"
    return DEFAULT_FRACTION, f"XLA_PYTHON_CLIENT_MEM_FRACTION unset (default {DEFAULT_FRACTION})"


def check_fit(
    memory,
    device=None,
    *,
    device_bytes: Optional[int] = None,
    env: Optional[Mapping[str, str]] = None,
    resident_bytes: int = 0,
) -> MemoryFit:
    """Whether a program needing ``memory`` (``compiled.memory_analysis()``, or a compiled
    executable) fits ``device`` under the current allocator settings, next to ``resident_bytes``
    per device that other programs keep there meanwhile (the canonical state beside a group's step).

    The limit is the allocator's own ``bytes_limit`` when the device reports one (a real GPU),
    else ``device_bytes`` x the fraction from the environment. Without either (CPU), it fits.
    """
    if hasattr(memory, "memory_analysis"):
        memory = memory.memory_analysis()
    need = need_bytes(memory) + int(resident_bytes)
    fraction, setting = allocator_fraction(env)
    limit = None
    stats = _memory_stats(device)
    if stats.get("bytes_limit"):
        limit = int(stats["bytes_limit"])
        if device_bytes is None and fraction > 0:
            device_bytes = int(limit / fraction)
    elif device_bytes:
        limit = int(device_bytes * fraction)
    if limit is None:
        return MemoryFit(True, need, None, device_bytes, f"step needs {need / GiB:.2f} GiB per device (no limit known)")
    if need <= limit:
        msg = f"step needs {need / GiB:.2f} GiB per device of {limit / GiB:.2f} GiB the allocator may use ({setting})"
        return MemoryFit(True, need, limit, device_bytes, msg)
    head = (
        f"the compiled step needs {need / GiB:.2f} GiB per device but JAX's allocator may use "
        f"{limit / GiB:.2f} GiB ({setting})"
    )
    if device_bytes and need <= SAFE_FRACTION * device_bytes:
        wanted = min(SAFE_FRACTION, -(-100 * need // device_bytes) / 100 + 0.01)
        tail = f"; start with XLA_PYTHON_CLIENT_MEM_FRACTION={wanted:.2f} (of {device_bytes / GiB:.1f} GiB)"
    else:
        total = f" ({device_bytes / GiB:.1f} GiB)" if device_bytes else ""
        tail = (
            f"; that is more than this device holds{total}: lower data.tokens_per_batch, raise "
            "parallel.sp or use more devices, or set model.remat=true"
        )
    return MemoryFit(False, need, limit, device_bytes, head + tail)


def ensure_fits(compiled, device=None, *, say=None, resident_bytes: int = 0, what: str = "") -> MemoryFit:
    """:func:`check_fit` for ``compiled`` on ``device`` (default: the first local device);
    raises :class:`DeviceMemoryError` with the message (after ``what``, naming the program) when
    it does not fit."""
    if device is None:
        import jax

        device = jax.local_devices()[0]
    fit = check_fit(compiled, device, resident_bytes=resident_bytes)
    if not fit.fits:
        raise DeviceMemoryError(f"[jvarlen] {what}{fit.message}")
    if say is not None and fit.limit_bytes is not None:
        say(f"[jvarlen] {fit.message}")
    return fit


def _memory_stats(device) -> dict:
    if device is None:
        return {}
    try:
        return device.memory_stats() or {}
    except Exception:  # CPU and abstract devices: no allocator statistics
        return {}
