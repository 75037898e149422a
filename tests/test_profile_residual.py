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
def keep_all_report():
    """A whole profile of layers that keep every residual: not the default policy
    (``dots_and_attention``), so a profile that recorded the default whatever it measured fails."""
    harness = ChunkHarness(TINY, token_buckets=(256,), context_buckets=(0,), residual="all")
    return measure_profile(harness, GRID)


def test_profile_measures_and_records_the_residual_policy(keep_all_report, tmp_path):
    assert keep_all_report["residual_policy"] == "all"
    # the measured stored bytes per token and layer: the default policy's layers keep fewer (the
    # norms' and the MLP activation's intermediates are recomputed), so the profile's memory grid saw
    # the layers of the policy it names
    policy = ChunkHarness(TINY, token_buckets=(256,), context_buckets=(0,), residual="dots_and_attention")
    assert 0 < fit_memory(measure_memory(policy, GRID.token_buckets))["m_token"] < keep_all_report["m_token"]
    shape = ModelShape.from_config(TINY)
    report = dict(keep_all_report, model_key=shape.key(), backend="cpu")
    coeffs = _fit_and_save(report, TINY, str(tmp_path / "all.json"))
    assert coeffs.meta.residual_policy == "all"
    assert CostCoefficients.load(tmp_path / "all.json").meta.residual_policy == "all"


def test_a_report_is_not_extended_with_layers_of_another_policy(keep_all_report):
    shape = ModelShape.from_config(TINY)
    report = dict(keep_all_report, model_key=shape.key(), backend="cpu")
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
