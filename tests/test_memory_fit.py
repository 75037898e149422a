"""memory_fit: a compiled step's memory_analysis against the device and allocator settings."""

import types

import jax
import jax.numpy as jnp
import pytest

from jvarlen.runtime.memory_fit import DeviceMemoryError, allocator_fraction, check_fit, ensure_fits, need_bytes

GiB = 2**30
# configs/llama-7b.yaml, 8 x H100, 16 rows x 32K tokens as compiled before the head's logits were tiled
# (2026-11-30: 81.78 GiB, now 74.77; scripts/gpu_compile_check.py, docs/benchmarks.md): a step over the device
LLAMA = dict(
    argument_size_in_bytes=10_108_934_164,
    output_size_in_bytes=10_107_623_812,
    temp_size_in_bytes=77_697_158_344,
    alias_size_in_bytes=10_107_623_444,
)
H100 = 84_942_979_072


def test_need_is_arguments_outputs_temporaries_minus_donated():
    assert need_bytes(LLAMA) == 10_108_934_164 + 10_107_623_812 + 77_697_158_344 - 10_107_623_444
    stats = types.SimpleNamespace(**LLAMA, generated_code_size_in_bytes=5)
    assert need_bytes(stats) == need_bytes(LLAMA) + 5


def test_allocator_fraction_from_environment():
    assert allocator_fraction({}) == (0.75, "XLA_PYTHON_CLIENT_MEM_FRACTION unset (default 0.75)")
    assert allocator_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"})[0] == 0.9
    assert allocator_fraction({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})[0] == 1.0


def test_too_big_for_any_fraction_names_the_figure_and_what_to_change():
    fit = check_fit(LLAMA, device_bytes=H100, env={})
    assert not fit.fits and fit.limit_bytes == int(H100 * 0.75)
    assert "needs 81.78 GiB per device" in fit.message and "59.33 GiB" in fit.message
    assert "more than this device holds (79.1 GiB)" in fit.message and "data.tokens_per_batch" in fit.message


def test_fits_with_a_larger_fraction_says_which():
    stats = dict(LLAMA, temp_size_in_bytes=LLAMA["temp_size_in_bytes"] - 20 * GiB)  # 61.8 GiB
    fit = check_fit(stats, device_bytes=H100, env={})
    assert not fit.fits
    assert "start with XLA_PYTHON_CLIENT_MEM_FRACTION=0.80" in fit.message, fit.message
    assert check_fit(stats, device_bytes=H100, env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.80"}).fits


def test_real_allocator_limit_wins():
    device = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 70 * GiB})
    fit = check_fit(dict(LLAMA, temp_size_in_bytes=40 * GiB), device, env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"})
    assert fit.fits and fit.limit_bytes == 70 * GiB
    assert not check_fit(LLAMA, device, env={}).fits


def test_cpu_has_no_limit_and_a_compiled_step_passes():
    compiled = jax.jit(lambda x: x @ x).lower(jnp.ones((64, 64))).compile()
    fit = ensure_fits(compiled)
    assert fit.fits and fit.limit_bytes is None and fit.need_bytes > 0
    with pytest.raises(DeviceMemoryError, match="needs 81.78 GiB"):
        ensure_fits(
            types.SimpleNamespace(memory_analysis=lambda: types.SimpleNamespace(**LLAMA)),
            types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": int(H100 * 0.75)}),
        )
