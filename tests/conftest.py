"""Test setup: eight fake CPU devices, set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def require_devices(n: int) -> None:
    """Skips the calling test when fewer than ``n`` devices are visible."""
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, have {jax.device_count()}")
