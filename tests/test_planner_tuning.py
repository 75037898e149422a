"""N search refinement, the InfiniPipe-testbed cost options (ZeRO-3 sync inside the SP group,
small-GEMM half-performance length)."""

import dataclasses
import math

import pytest
from conftest import SMALL, small_cost

from jvarlen.layout import Layout
from jvarlen.plan.api import PlannerOptions, make_cost, plan_iteration
from jvarlen.plan.checkpointing import SolverOptions
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.epp import refine_candidate
from jvarlen.plan.hardware import A800, analytic_coefficients
from jvarlen.plan.workloads import sample_batch

K = 1024


# ---------------------------------------------------------------- refine_candidate (hand-computed)


def test_refine_goes_towards_an_untried_neighbour_first():
    # coarse search tried 32 and 16 (32 best); 64 was never simulated -> midpoint above: round(32·√2) = 45
    assert refine_candidate(32, {32: 1.0, 16: 2.0}, 2.0, 4, 48) == 45


def test_refine_goes_towards_the_faster_neighbour():
    # 16 best, 32 slower than 8 -> midpoint below: round(16/√2) = 11
    assert refine_candidate(16, {32: 3.0, 16: 1.0, 8: 2.0}, 2.0, 4, 64) == 11
    # 8 slower than 32 -> above: round(16·√2) = 23
    assert refine_candidate(16, {32: 2.0, 16: 1.0, 8: 3.0}, 2.0, 4, 64) == 23


def test_refine_respects_bounds_and_tried_values():
    assert refine_candidate(32, {32: 1.0, 16: 2.0}, 2.0, 4, 40) == 23  # 45 > n_hi: only the lower side is left
    assert refine_candidate(32, {32: 1.0, 16: 2.0, 45: 0.5, 23: 3.0}, 2.0, 4, 64) is None
    assert refine_candidate(1, {1: 1.0}, 2.0, 1, 1) is None
    assert refine_candidate(8, {8: 1.0}, 1.0, 1, 64) is None  # ratio 1: additive search, nothing to refine


def test_epp_keeps_the_fastest_simulated_slice_number():
    """Brute force over what the search simulated: the plan's N is the argmin of its tuned times,
    and re-planning with that N fixed reproduces the plan's time."""
    cost = small_cost(pp=4, sp=2)
    batch = sample_batch("github", 64, 48 * K, seed=5)
    opts = PlannerOptions(n_candidates=3, solver=SolverOptions(time_limit_s=0.0), min_slice_tokens=2048)
    plan = plan_iteration(batch, cost=cost, policy="epp-fast", options=opts)  # no tuning: one N
    assert len(plan.stats["tuned_iteration_times"]) == 1
    plan = plan_iteration(batch, cost=cost, policy="epp", options=opts)
    tried = {int(k): v for k, v in plan.stats["tuned_iteration_times"].items()}
    assert len(tried) >= 2
    n = plan.stats["n_slices"]
    assert tried[n] == min(tried.values())
    fixed = plan_iteration(batch, cost=cost, policy="epp", options=dataclasses.replace(opts, n_slices=n))
    assert fixed.stats["n_slices"] == n
    assert fixed.stats["iteration_time_s"] == pytest.approx(plan.stats["iteration_time_s"], rel=1e-9)


# ---------------------------------------------------------------- testbed options


def test_zero3_sp_keeps_the_step_sync_inside_the_node():
    layout = Layout(1, 4, 8)
    plain = make_cost(SMALL, "a800", layout)
    zero3 = make_cost(SMALL, "a800", layout, zero3_sp=True)
    c = zero3.coeffs
    assert c.sync_link == c.p2p_intra  # NVLink, not the per-GPU share of the node's InfiniBand
    assert plain.coeffs.sync_link == plain.coeffs.p2p_inter
    params = max(SMALL.stage_params(p, 4) for p in range(4))
    assert zero3.step_overhead() == pytest.approx(c.step_overhead + c.sync_link.time(c.sync_bytes_per_param * params))
    assert zero3.step_overhead() < plain.step_overhead()
    # an SP group spanning nodes (sp = 16 > 8 GPUs per node) still syncs over the network
    wide_model = dataclasses.replace(SMALL, num_heads=16, head_dim=64)
    wide = make_cost(wide_model, "a800", Layout(1, 2, 16), zero3_sp=True)
    assert wide.coeffs.sync_link == wide.coeffs.p2p_inter


def test_gemm_half_rows_is_hockneys_half_performance_length():
    """With m_half = 256, a chunk of m rows per device runs its layer matmuls at m/(m+256) of
    the large-chunk rate: half rate at m = 256."""
    m_half = 256.0
    base = analytic_coefficients(SMALL, A800)
    slow = analytic_coefficients(SMALL, dataclasses.replace(A800, gemm_half_rows=m_half))
    assert slow.fwd.alpha2 == base.fwd.alpha2 and slow.fwd.alpha1 == base.fwd.alpha1
    assert slow.fwd.beta1 - base.fwd.beta1 == pytest.approx(m_half * base.fwd.alpha2)
    assert slow.bwd.beta1 - base.bwd.beta1 == pytest.approx(2 * m_half * base.fwd.alpha2)
    assert slow.head_fwd.beta1 - base.head_fwd.beta1 == pytest.approx(m_half * base.head_fwd.alpha2)
    sp = 2
    for m in (64, 256, 1024, 8192):
        tokens = m * sp
        linear_base = base.fwd(0, tokens, sp) - base.fwd.beta1  # matmul time at full rate
        linear_slow = slow.fwd(0, tokens, sp) - base.fwd.beta1  # launch overhead unchanged
        assert linear_base / linear_slow == pytest.approx(m / (m + m_half))
    half = slow.fwd(0, 256 * sp, sp) - base.fwd.beta1
    assert half == pytest.approx(2 * (base.fwd(0, 256 * sp, sp) - base.fwd.beta1))


def test_gemm_half_rows_makes_fixed_small_chunks_slower_per_token():
    spec = dataclasses.replace(A800, gemm_half_rows=128.0)
    cost = make_cost(SMALL, spec, Layout(1, 4, 2))
    flat = make_cost(SMALL, "a800", Layout(1, 4, 2))
    per_token = lambda c, t: c.fwd_time(ChunkShape(0, (t,))) / t  # noqa: E731
    # the penalty relative to the flat model shrinks as the chunk grows
    ratios = [per_token(cost, t) / per_token(flat, t) for t in (512, 2048, 8192)]
    assert ratios[0] > ratios[1] > ratios[2] > 1.0
    assert math.isclose(per_token(cost, 10**7) / per_token(flat, 10**7), 1.0, rel_tol=1e-3)
