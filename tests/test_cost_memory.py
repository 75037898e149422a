"""Cost-model memory (Eq. 5/9/10 + working memory) against XLA's memory_analysis of the real decoder.

The compiled checks use the shipped CPU profile of the default model and chunk shapes that its
memory grid (T in {512, 1024, 2048}, no context, 2-4 layers, no or full recomputation) did not
contain. Tolerances are fixed in advance: the per-layer stored bytes (Eq. 5 + context term)
within 5 % of XLA's per-layer slope; the whole 4-layer program's peak within 10 %.
"""

import types

import pytest
from conftest import SHIPPED_CPU_PROFILE

from jvarlen.config import ModelConfig
from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, CostModel, LayerTime, ModelShape

GQA = ModelShape(num_layers=4, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, vocab_size=100)


def _coeffs(**kw):
    base = dict(fwd=LayerTime(), m_token=100.0, bytes_per_element=2, dkv_bytes_per_element=4)
    base.update(kw)
    return CostCoefficients(**base)


def test_context_term_and_peak_memory_hand_computed():
    c = _coeffs(m_context_token=64.0, m_work_token=30.0, m_work_remat_token=50.0, m_work_context_token=128.0)
    cm = CostModel(GQA, Layout(1, 2, 2), c)  # L_s = 2, sp = 2
    chunk = ChunkShape(1000, (400,), tail=True)  # T = 400, C = 1000
    t, ctx = 400 / 2, 1000 / 2
    # two stored layers: Eq. 5 Act + the concatenated context K/V kept per layer
    assert cm.activation_memory(chunk) == pytest.approx(2 * (100 * t + 64 * ctx))
    # one recomputed layer: its Act and context term go, its input (e·D) stays (Eq. 9, tail)
    assert cm.activation_memory(chunk, 1) == pytest.approx(100 * t + 64 * ctx + 2 * 64 * t)
    assert cm.working_memory(chunk, 0) == pytest.approx(30 * t + 128 * ctx)
    assert cm.working_memory(chunk, 1) == pytest.approx(50 * t + 128 * ctx)
    assert cm.peak_memory(chunk, 1) == pytest.approx(cm.activation_memory(chunk, 1) + 50 * t + 128 * ctx)
    # Eq. 19 (checkpointing MILP) needs linearity in the recomputed layers
    a0, a1, a2 = (cm.activation_memory(chunk, k) for k in range(3))
    assert a2 - a1 == pytest.approx(a1 - a0)


def test_old_profiles_without_memory_fields_still_load(tmp_path):
    c = _coeffs()
    data = c.to_json()
    for name in ("m_context_token", "m_work_token", "m_work_remat_token", "m_work_context_token"):
        del data[name]
    assert CostCoefficients.from_json(data) == c


def test_fit_memory_recovers_known_coefficients():
    from jvarlen.profile.measure import fit_memory

    rows = []
    for t in (512, 1024, 2048):
        for n in (2, 3, 4):
            rows.append(dict(tokens=t, context=0, layers=n, remat=0, temp=n * 13000 * t + 15000 * t + 4096))
            rows.append(dict(tokens=t, context=0, layers=n, remat=n, temp=n * 512 * t + 20000 * t + 4096))
    fit = fit_memory(rows)
    assert fit["m_token"] == pytest.approx(13000)
    assert fit["m_work_token"] == pytest.approx(15000)
    assert fit["m_ckpt_token"] == pytest.approx(512)
    assert fit["m_work_remat_token"] == pytest.approx(20000)
    assert "m_context_token" not in fit  # no rows with context: the profile keeps its default
    # a chunk of 512 tokens after 2,048 context tokens: each layer keeps 384 B per context token more
    context_rows = [
        dict(tokens=512, context=2048, layers=n, remat=0, temp=n * (13000 * 512 + 384 * 2048) + 15000 * 512 + 9999)
        for n in (2, 3, 4)
    ]
    assert fit_memory(rows + context_rows)["m_context_token"] == pytest.approx(384)
    assert fit_memory(rows + context_rows)["m_token"] == pytest.approx(13000)  # fitted on context 0 alone
    less = [dict(r, temp=r["temp"] - r["layers"] * 900 * 2048) for r in context_rows]  # keeps less than without
    assert fit_memory(rows + less)["m_context_token"] == 0.0


@pytest.fixture(scope="module")
def shipped():
    from jvarlen.profile.harness import ChunkHarness

    cfg = ModelConfig()
    coeffs = CostCoefficients.load(SHIPPED_CPU_PROFILE)
    if not coeffs.m_work_token:
        pytest.fail(
            "the shipped CPU profile has no measured working memory; run scripts/validate_cost_memory.py --refit_profile"
        )
    # the profile's layers (what they keep for the backward: its residual policy)
    harness = ChunkHarness(
        cfg, token_buckets=(768,), context_buckets=(0, 1024), residual=coeffs.meta.profiled_residual_policy
    )
    return harness, coeffs


def test_memory_of_a_held_out_split_chunk_matches_xla(shipped):
    """Per extra stored layer XLA keeps (temp(4 layers) − temp(2 layers)) / 2 bytes: Eq. 5 plus the
    context term must match it within 5 %; the 4-layer program's peak temp must match
    ``CostModel.peak_memory`` within 10 %."""
    from jvarlen.profile.measure import program_memory
    from jvarlen.profile.memory import MemoryCase, predict_memory

    harness, coeffs = shipped
    chunk = ChunkShape(1024, (768,), tail=False)
    batch = harness.layer_inputs(chunk)
    temp = {n: program_memory(harness.layers_program(n, "fwdbwd", 0), harness.params, batch)["temp"] for n in (2, 4)}
    shape = ModelShape.from_config(harness.cfg)
    per_layer = predict_memory(shape, coeffs, MemoryCase(chunk, 1, 0))["eq10"]
    assert per_layer == pytest.approx((temp[4] - temp[2]) / 2, rel=0.05)
    assert predict_memory(shape, coeffs, MemoryCase(chunk, 4, 0))["peak"] == pytest.approx(temp[4], rel=0.10)


@pytest.mark.parametrize("compute, param, stage_bytes", [("float32", "float32", 8), ("bfloat16", "float32", 6)])
def test_the_profiler_charges_the_stage_copy_in_the_compute_dtype(compute, param, stage_bytes):
    """A stage holds its layers' copy in the compute dtype and their gradient accumulator in the
    parameters' (fp32 at least): 8 bytes per parameter for the fp32 CPU model, 6 for bf16. The
    profiler wrote 6 for every model, and the CPU account was 0.8 MB short on its 60 MB steps
    (docs/design/executor-memory.md, "What a tick holds")."""
    from jvarlen.profile.fit import _default_base

    config = ModelConfig(compute_dtype=compute, param_dtype=param)  # the default (CPU) model's shape
    assert _default_base(config).stage_bytes_per_param == stage_bytes


@pytest.mark.parametrize("profile", ["analytic", "fitted"])
def test_a_split_documents_kv_rows_cost_what_the_executor_holds(profile):
    """A non-tail slice's tokens, every layer recomputed: Eq. 9's K/V kept for later slices plus
    Eq. 5's M_dkv equal, per token, the executor's four context pools per row (K, V, dK, dV in the
    compute dtype: ``4 · L/pp · K' · D · e``, :mod:`jvarlen.plan.executor_memory`), for a bf16 model
    on the analytic GPU profile and on a profile fitted to the model config. The profiles priced
    dK/dV in fp32 before (the paper's runtime): 1.5× the executor's rows."""
    from jvarlen.plan.executor_memory import _Account
    from jvarlen.plan.hardware import analytic_coefficients
    from jvarlen.profile.fit import _default_base

    config = ModelConfig(
        vocab_size=320, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, mlp_dim=384, compute_dtype="bfloat16"
    )
    shape = ModelShape.from_config(config)
    coeffs = analytic_coefficients(shape, "a800") if profile == "analytic" else _default_base(config)
    assert coeffs.bytes_per_element == 2
    layout = Layout(1, 2, 1)
    cost = CostModel(shape, layout, coeffs)
    ls, t = cost.layers_per_stage, 512
    kv_rows = cost.activation_memory(ChunkShape(0, (t,), tail=False), ls) - cost.activation_memory(
        ChunkShape(0, (t,), tail=True), ls
    )

    plan = types.SimpleNamespace(  # what the executor's account reads of a plan: its one chunk
        chunk_shapes=lambda: [ChunkShape(0, (t,), tail=False)], schedule=types.SimpleNamespace(fusable=[False])
    )
    pools = 4 * ls * _Account(plan, cost, None, False).kv_row  # the four pools' bytes per row
    assert kv_rows / t == pytest.approx(pools)
