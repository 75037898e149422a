"""Test setup: eight fake CPU devices, set before JAX starts; shared helpers (device check, small planner cost models)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Lets an installed CUDA plugin register without cuDNN or a driver, for the deviceless
# compile tests (marker gpu_aot); without the plugin it does nothing.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def require_devices(n: int) -> None:
    """Skips the calling test when fewer than ``n`` devices are visible."""
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, have {jax.device_count()}")


# ---------------------------------------------------------------- small analytic cost models for the planner tests
from jvarlen.layout import Layout  # noqa: E402
from jvarlen.plan.cost import CostModel, ModelShape  # noqa: E402
from jvarlen.plan.hardware import A800, analytic_coefficients  # noqa: E402

SMALL = ModelShape(
    num_layers=8, d_model=1024, num_heads=8, num_kv_heads=8, head_dim=128, mlp_dim=2816, vocab_size=32000
)


def small_cost(pp: int = 4, sp: int = 2, budget: float | None = None, model: ModelShape = SMALL) -> CostModel:
    """A800-analytic cost of a ~0.1B model; ``budget`` (bytes) overrides the memory budget."""
    layout = Layout(1, pp, sp)
    coeffs = analytic_coefficients(model, A800, num_nodes=1)
    if budget is not None:
        coeffs = coeffs.replace(memory_budget=budget)
    return CostModel(model, layout, coeffs)


def tight_budget(cost: CostModel, tokens: int) -> float:
    """A budget that holds the model states plus ``tokens`` non-tail tokens with no recomputation."""
    from jvarlen.plan.chunk import ChunkShape

    state = max(cost.model_state_memory(p) for p in range(cost.layout.pp))
    return state + cost.activation_memory(ChunkShape(0, (tokens,), tail=False), 0, cost.layout.pp - 1)
