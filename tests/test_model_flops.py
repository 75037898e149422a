"""Model FLOPs of a step (jvarlen.runtime.model_flops) against a count by hand, and the peak a
device kind gives its MFU."""

from __future__ import annotations

import pytest

from jvarlen.config import ConfigError, ModelConfig, parse_config
from jvarlen.runtime.model_flops import StepFlops, peak_tflops

TINY = ModelConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64, vocab_size=320)


def test_model_flops_of_a_batch_are_counted_by_hand():
    # per token and layer: q, o 32x32 each, k, v 32x16 each, SwiGLU 3 x 32x64 = 9,216 multiply-adds;
    # the head 32x320 = 10,240; x 2 FLOPs, x 3 for forward + backward
    per_token = 3 * 2 * (2 * 9_216 + 10_240)
    # attention: QK^T and PV over the causal half of l^2 pairs, 32 query dims: 2 * 2 * 32 * l^2 / 2 per layer
    per_square = 3 * 2 * (2 * 2 * 32 / 2)
    flops = StepFlops(TINY, num_devices=2, peak=None)
    assert flops.model_flops([256, 256, 100, 412]) == per_token * 1024 + per_square * (2 * 256**2 + 100**2 + 412**2)
    # the same tokens in one sequence attend over more pairs: more FLOPs
    assert flops.model_flops([1024]) > flops.model_flops([256] * 4)


def test_a_record_divides_by_seconds_and_devices_and_gives_mfu_where_a_peak_is_known():
    flops = StepFlops(TINY, num_devices=4, peak=200.0)
    first = flops.record([512] * 8, step_seconds=0.5)
    total = flops.model_flops([512] * 8)
    assert first["model_tflops"] == pytest.approx(total / 1e12)
    assert first["tflops_per_device"] == pytest.approx(total / 0.5 / 4 / 1e12)
    assert first["mfu"] == pytest.approx(first["tflops_per_device"] / 200.0)
    flops.record([512] * 8, step_seconds=1.5)  # the summary is over all steps: twice the FLOPs in 2 s
    assert flops.summary() == f"{2 * total / 2.0 / 4 / 1e12:.3g} model TFLOP/s per device, MFU " + (
        f"{100 * 2 * total / 2.0 / 4 / 1e12 / 200.0:.1f} %"
    )
    assert "mfu" not in StepFlops(TINY, 4, None).record([512], 0.1)
    assert StepFlops(TINY, 4, None).summary() == ""  # no steps


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A800-SXM4-80GB", 312.0),
        ("cpu", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_the_peak_comes_from_the_device_kind_unless_configured(kind, peak):
    assert peak_tflops(kind) == peak
    assert peak_tflops(kind, configured=123.0) == 123.0


def test_a_negative_peak_is_refused():
    assert parse_config(["--logging.peak_tflops=400"]).logging.peak_tflops == 400.0
    with pytest.raises(ConfigError, match="logging.peak_tflops must be >= 0 and finite, got -1"):
        parse_config(["--logging.peak_tflops=-1"])
