"""The profiler times and measures the layers the runtime runs: what a layer that is not
recomputed keeps follows ``parallel.residual_policy``, and a profile says which policy it measured."""

import dataclasses

import pytest

from jvarlen.config import ModelConfig
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, ModelShape
from jvarlen.profile.fit import _fit_and_save, check_report, report_residual_policy
from jvarlen.profile.harness import ChunkHarness
from jvarlen.profile.measure import ProfileGrid, measure_profile

TINY = dataclasses.replace(
    ModelConfig(), d_model=32, num_heads=2, num_kv_heads=1, mlp_dim=64, num_layers=2, vocab_size=64
)
GRID = ProfileGrid(
    token_buckets=(256,),
    context_buckets=(0,),
    remat_pairs=((256, 0),),
    repeats=1,
    calibration_rounds=1,
    calibration=(ChunkShape(0, (256,)), ChunkShape(0, (100, 80))),
)


@pytest.fixture(scope="module")
def reports():
    return {
        name: measure_profile(ChunkHarness(TINY, token_buckets=(256,), context_buckets=(0,), residual=name), GRID)
        for name in ("all", "dots_and_attention")
    }


def test_profile_measures_and_records_the_residual_policy(reports, tmp_path):
    keep_all, policy = reports["all"], reports["dots_and_attention"]
    assert keep_all["residual_policy"] == "all" and policy["residual_policy"] == "dots_and_attention"
    # the measured stored bytes per token and layer: the policy keeps fewer (the norms' and the MLP
    # activation's intermediates are recomputed), so the memory grid saw the policy's layers
    assert 0 < policy["m_token"] < keep_all["m_token"]
    shape = ModelShape.from_config(TINY)
    for name, report in reports.items():
        report.update(model_key=shape.key(), backend="cpu")
        coeffs = _fit_and_save(report, TINY, str(tmp_path / f"{name}.json"))
        assert coeffs.meta.residual_policy == name
        assert CostCoefficients.load(tmp_path / f"{name}.json").meta.residual_policy == name


def test_a_report_is_not_extended_with_layers_of_another_policy(reports):
    shape = ModelShape.from_config(TINY)
    report = dict(reports["all"], model_key=shape.key(), backend="cpu")
    check_report(report, shape, "r.json", "all")
    with pytest.raises(ValueError, match="residual_policy 'all'.*'dots_and_attention'"):
        check_report(report, shape, "r.json", "dots_and_attention")
    old = {k: v for k, v in report.items() if k != "residual_policy"}  # written before the key: plain autodiff
    assert report_residual_policy(old) == "all"
    with pytest.raises(ValueError, match="residual_policy"):
        check_report(old, shape, "old.json", "dots_and_attention")


def test_harness_refuses_an_unknown_policy():
    with pytest.raises(ValueError, match="unknown residual policy 'keep_some'"):
        ChunkHarness(TINY, token_buckets=(256,), context_buckets=(0,), residual="keep_some")
