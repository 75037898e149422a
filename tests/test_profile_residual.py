"""The profiler times and measures the layers the runtime runs: what a layer that is not
recomputed keeps follows ``parallel.residual_policy``, and a profile says which policy it measured."""

import dataclasses

import pytest

from jvarlen.config import ModelConfig
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, ModelShape
from jvarlen.profile.fit import _fit_and_save, check_report, report_residual_policy
from jvarlen.profile.harness import ChunkHarness
from jvarlen.profile.measure import ProfileGrid, fit_memory, measure_memory, measure_profile

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
def policy_report():
    """A whole profile of a model that keeps only what ``dots_and_attention`` saves (the profile of
    the default policy is what every other profile test fits)."""
    harness = ChunkHarness(TINY, token_buckets=(256,), context_buckets=(0,), residual="dots_and_attention")
    return measure_profile(harness, GRID)


def test_profile_measures_and_records_the_residual_policy(policy_report, tmp_path):
    assert policy_report["residual_policy"] == "dots_and_attention"
    # the measured stored bytes per token and layer: the policy keeps fewer than the layers that keep
    # every residual (the norms' and the MLP activation's intermediates are recomputed), so the
    # profile's memory grid saw the policy's layers
    keep_all = ChunkHarness(TINY, token_buckets=(256,), context_buckets=(0,), residual="all")
    assert 0 < policy_report["m_token"] < fit_memory(measure_memory(keep_all, GRID.token_buckets))["m_token"]
    shape = ModelShape.from_config(TINY)
    report = dict(policy_report, model_key=shape.key(), backend="cpu")
    coeffs = _fit_and_save(report, TINY, str(tmp_path / "policy.json"))
    assert coeffs.meta.residual_policy == "dots_and_attention"
    assert CostCoefficients.load(tmp_path / "policy.json").meta.residual_policy == "dots_and_attention"


def test_a_report_is_not_extended_with_layers_of_another_policy(policy_report):
    shape = ModelShape.from_config(TINY)
    report = dict(policy_report, model_key=shape.key(), backend="cpu")
    check_report(report, shape, "r.json", "dots_and_attention")
    with pytest.raises(ValueError, match="residual_policy 'dots_and_attention'.*'all'"):
        check_report(report, shape, "r.json", "all")
    old = {k: v for k, v in report.items() if k != "residual_policy"}  # written before the key: plain autodiff
    assert report_residual_policy(old) == "all"
    with pytest.raises(ValueError, match="residual_policy"):
        check_report(old, shape, "old.json", "dots_and_attention")


def test_harness_refuses_an_unknown_policy():
    with pytest.raises(ValueError, match="unknown residual policy 'keep_some'"):
        ChunkHarness(TINY, token_buckets=(256,), context_buckets=(0,), residual="keep_some")
