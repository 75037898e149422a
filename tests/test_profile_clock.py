"""The cost model's CPU clock in reference units: the reference probe's chunks are profiler
calibration chunks, its reading travels with the profile, and a plan timed beside the probe is
converted to the profile's speed."""

import dataclasses
import json

import pytest

from jvarlen.config import ModelConfig
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, LayerTime, ProfileMeta
from jvarlen.profile.clock import to_profile_clock
from jvarlen.profile.fit import reference_reading
from jvarlen.profile.harness import (
    REFERENCE_CHUNKS,
    REFERENCE_PROBE,
    ChunkHarness,
    reference_probe,
    reference_seconds,
    run_plan,
)
from jvarlen.profile.measure import ProfileGrid


def test_to_profile_clock_takes_out_the_speed_change():
    # the machine now runs the probe in 0.2 s, the profile saw 0.1 s: twice as slow, so 3 s now are 1.5 s then
    assert to_profile_clock(3.0, 0.2, 0.1) == pytest.approx(1.5)
    assert to_profile_clock(3.0, 0.1, 0.1) == pytest.approx(3.0)
    for now, then in ((0.0, 0.1), (0.1, 0.0), (-1.0, 0.1)):
        with pytest.raises(ValueError, match="reference readings"):
            to_profile_clock(1.0, now, then)


def test_reference_reading_is_the_calibration_of_the_reference_chunks():
    assert set(REFERENCE_CHUNKS) <= set(ProfileGrid().calibration)  # every profile times the probe's programs
    rows = [[[c.context, list(c.slices), c.tail], 0.1 * (i + 1)] for i, c in enumerate(REFERENCE_CHUNKS)]
    other = [[[0, [200, 150, 90], True], 0.5]]
    assert reference_reading({"calibration": other + rows}) == pytest.approx(0.1 + 0.2 + 0.3)
    assert reference_reading({"calibration": other + rows[:-1]}) == 0.0  # a probe chunk missing: no reading
    assert reference_reading({}) == 0.0


def test_reference_seconds_sums_each_chunks_minimum():
    # the profile's statistic (per-chunk minimum over rounds, summed), not the minimum of the sums
    assert reference_seconds([[1.0, 5.0, 9.0], [2.0, 4.0, 9.5], [1.5, 4.5, 8.0]]) == pytest.approx(1.0 + 4.0 + 8.0)
    with pytest.raises(ValueError, match="no probe readings"):
        reference_seconds([])


def test_reference_reading_survives_the_profile_json(tmp_path):
    meta = ProfileMeta(backend="cpu", reference_s=1.6, reference_probe=REFERENCE_PROBE)
    CostCoefficients(fwd=LayerTime(1e-9, 1e-6, 0.0), meta=meta).save(tmp_path / "p.json")
    assert CostCoefficients.load(tmp_path / "p.json").meta == meta
    data = json.loads((tmp_path / "p.json").read_text())
    del data["meta"]["reference_s"], data["meta"]["reference_probe"]  # written before the fields: plain seconds
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = CostCoefficients.load(tmp_path / "old.json").meta
    assert old.reference_s == 0.0 and old.reference_probe == ""


def test_run_plan_times_the_probe_before_every_repeat():
    # when the probe runs, not how fast: the smallest decoder (one layer, one head, the plain reference
    # attention) compiles and runs the probe's 2,048-token chunks in a fraction of the time
    cfg = dataclasses.replace(
        ModelConfig(), d_model=32, num_heads=1, num_kv_heads=1, mlp_dim=64, num_layers=1, attention="reference"
    )
    harness = ChunkHarness(cfg, token_buckets=(512, 1024, 2048), context_buckets=(0, 2048))
    probe = reference_probe(harness)
    calls = []

    def counted():
        calls.append(probe())
        return calls[-1]

    out = run_plan(harness, [ChunkShape(0, (100, 50)), ChunkShape(200, (60,))], [0, 1], repeats=3, probe=counted)
    assert out["reference_runs"] == calls and len(calls) == 3
    assert all(len(c) == len(REFERENCE_CHUNKS) and min(c) > 0 for c in calls)
    assert out["reference"] == reference_seconds(calls)
    assert out["cpu"] > 0 and out["wall"] > 0
    assert "reference" not in run_plan(harness, [ChunkShape(0, (100,))], [0], repeats=1)


def test_reference_probe_refuses_an_ulysses_harness():
    import jax

    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    cfg = dataclasses.replace(ModelConfig(), d_model=32, num_heads=2, num_kv_heads=2, mlp_dim=64, num_layers=2)
    with pytest.raises(ValueError, match="sp = 1 harness"):
        reference_probe(ChunkHarness(cfg, token_buckets=(512,), context_buckets=(0,), sp=2))
