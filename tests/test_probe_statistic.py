"""The reference probe beside a validated plan is read as the profile's calibration reads it: each
probe chunk's minimum over as many calls as the calibration had rounds (the plan's own calls, then
its neighbours'), not over the plan's own 5 calls. A minimum over fewer draws is larger, so the
old reading converted every plan ~1-2 % too fast and the predictions looked that much too slow
(docs/benchmarks.md, "The shipped profile: one core, reference units")."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from jvarlen.plan.coefficients import CostCoefficients, LayerTime, ProfileMeta
from jvarlen.profile.clock import calibration_rounds, calls_per_round, nearest_probe_reading, to_profile_clock
from jvarlen.profile.fit import profile_meta

ROOT = pathlib.Path(__file__).resolve().parent.parent


def validate_script():
    spec = importlib.util.spec_from_file_location("validate_cost_model", ROOT / "scripts" / "validate_cost_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reading_takes_the_nearest_calls_and_each_chunks_minimum():
    # 4 plans, 2 calls each, 2 chunks per call; plan j's calls read (10 + j, 20 - j) and (11 + j, 30)
    plans = [[[10 + j, 20 - j], [11 + j, 30]] for j in range(4)]
    assert nearest_probe_reading(plans, 0, 2) == 10 + 20  # its own two calls
    assert nearest_probe_reading(plans, 2, 4) == 11 + 18  # its own, then plan 1 (before plan 3)
    assert nearest_probe_reading(plans, 2, 6) == 11 + 17  # then plan 3
    assert nearest_probe_reading(plans, 2, 3) == 11 + 18  # plan 1's first call only
    assert nearest_probe_reading(plans, 3, 100) == 10 + 17  # all there are
    with pytest.raises(IndexError):
        nearest_probe_reading(plans, 4, 2)
    with pytest.raises(ValueError):
        nearest_probe_reading(plans, 0, 0)


def test_matching_the_calibrations_statistic_takes_out_the_bias():
    """A machine of constant speed, probe chunk times noisy (9 % spread, as a 512-token step between
    calibration rounds): the profile's reading is each chunk's minimum over 20 rounds. Plans timed
    exactly are converted back to themselves on average only when the reading beside them is the
    minimum over 20 calls too; with each plan's own 5 calls they come out over 1 % fast."""
    rng = np.random.default_rng(0)
    base = np.array([0.11, 0.55, 0.95])  # the three probe chunks' undisturbed seconds

    def calls(n):
        return base * (1 + np.abs(rng.normal(0.0, 0.09, size=(n, 3))))

    profile = float(np.mean([calls(20).min(0).sum() for _ in range(2000)]))  # E[the calibration's reading]
    plans = [calls(5).tolist() for _ in range(400)]
    own = [to_profile_clock(1.0, nearest_probe_reading(plans, i, 5), profile) for i in range(len(plans))]
    pooled = [to_profile_clock(1.0, nearest_probe_reading(plans, i, 20), profile) for i in range(len(plans))]
    assert np.mean(own) < 0.99  # the bias of the old reading (1.3 % here)
    assert abs(np.mean(pooled) - 1.0) < 0.003


def test_the_validation_pools_within_each_measurement_run_in_plan_order():
    module = validate_script()
    probe = "the probe"
    rows = [
        {"plan": 1, "reference_runs": [[2.0, 5.0]], "reference_probe": probe},
        {"plan": 0, "reference_runs": [[3.0, 4.0]], "reference_probe": probe},
        {"plan": 2, "reference_runs": [[1.0, 9.0]], "reference_probe": probe},
        {"plan": 0, "reference_runs": [[0.5, 0.5]], "reference_probe": probe, "source": "old.json"},
        {"plan": 0, "reference_runs": [[0.1, 0.1]], "reference_probe": probe, "sp": 2},
        {"plan": 3, "reference_runs": [[0.1, 0.1]], "reference_probe": "another probe"},
    ]
    module.pool_probe_readings(rows, probe, calls=2)
    # plan 0: its own call and plan 1's; plan 1: its own and plan 0's; plan 2: its own and plan 1's
    assert [r.get("reference_pooled_s") for r in rows] == [2.0 + 4.0, 2.0 + 4.0, 1.0 + 5.0, 1.0, 0.2, None]


def test_a_profile_says_how_many_calls_its_reading_is_the_minimum_over(tmp_path):
    meta = ProfileMeta(backend="cpu", reference_s=1.6, reference_probe="p", reference_calls=20)
    CostCoefficients(fwd=LayerTime(1e-9, 1e-6, 0.0), meta=meta).save(tmp_path / "p.json")
    assert CostCoefficients.load(tmp_path / "p.json").meta == meta
    assert calibration_rounds(str(tmp_path / "p.json")) == 20
    # written before the field: the report beside it says, else nobody does
    old = ProfileMeta(backend="cpu", reference_s=1.6, reference_probe="p")
    CostCoefficients(fwd=LayerTime(1e-9, 1e-6, 0.0), meta=old).save(tmp_path / "old.json")
    assert calibration_rounds(str(tmp_path / "old.json")) is None
    (tmp_path / "old.report.json").write_text('{"calibration_rounds": 12}')
    assert calibration_rounds(str(tmp_path / "old.json")) == 12


def test_the_fit_records_the_calibrations_rounds():
    from jvarlen.config import ModelConfig
    from jvarlen.plan.cost import ModelShape
    from jvarlen.profile.harness import REFERENCE_CHUNKS

    calibration = [[[c.context, list(c.slices), c.tail], 0.1] for c in REFERENCE_CHUNKS]
    report = {"dual_layers": [2, 3], "raw": [], "repeats": 5, "calibration": calibration, "calibration_rounds": 17}
    meta = profile_meta(ModelShape.from_config(ModelConfig()), report)
    assert meta.reference_s == pytest.approx(0.1 * len(REFERENCE_CHUNKS)) and meta.reference_calls == 17
    assert profile_meta(ModelShape.from_config(ModelConfig()), {**report, "calibration": []}).reference_calls == 0


@pytest.mark.parametrize("calls,rounds", [(20, 5), (20, 3), (20, 20), (5, 5), (3, 7), (0, 4), (23, 6)])
def test_the_benchmarks_probe_calls_spread_over_its_rounds(calls, rounds):
    per = calls_per_round(calls, rounds)
    assert len(per) == rounds and sum(per) == calls
    assert max(per) - min(per) <= 1  # as even as they go: the reading follows the machine over the run


def test_calls_per_round_refuses_nonsense():
    with pytest.raises(ValueError):
        calls_per_round(5, 0)
    with pytest.raises(ValueError):
        calls_per_round(-1, 3)
