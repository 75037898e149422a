"""Per-Ulysses-degree cost coefficients: the profiler's fit recovers known sp = 2 coefficients from
synthetic program timings (InfiniPipe Eq. 1 with N = sp, Eq. 11), and the cost model uses them."""

import dataclasses

import numpy as np
import pytest

from jvarlen.config import ModelConfig
from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, CostModel, LayerTime, ModelShape
from jvarlen.plan.online_refit import scale_coefficients
from jvarlen.profile.fit import _attention_block, fit_profile
from jvarlen.profile.measure import SP_GRID, ProfileGrid

SHAPE = ModelShape.from_config(ModelConfig())
BASE = CostCoefficients(fwd=LayerTime(), bytes_per_element=4, gpus_per_node=8)


def whole_model_step(cost, chunk, pairs_scale=1.0, token_scale=1.0):
    """Forward + backward of a pp = 1 stage with its attention (α1) part scaled by ``pairs_scale`` and
    its token (α2) part by ``token_scale``: how the whole model runs relative to isolated layers."""
    c = cost.coeffs
    parts = []
    for keep in ("alpha1", "alpha2"):

        def only(x, keep=keep):
            return LayerTime(**{n: (getattr(x, n) if n == keep else 0.0) for n in ("alpha1", "alpha2", "beta1")})

        part = c.replace(
            per_sp={d: (only(f), only(b)) for d, (f, b) in c.per_sp.items()},
            head_per_sp={d: (only(f), only(b)) for d, (f, b) in c.head_per_sp.items()},
            fwd=only(c.fwd),
            bwd=only(c.bwd if c.bwd is not None else c.fwd.scaled(c.bwd_factor)),
            head_fwd=only(c.head_fwd),
            head_bwd=only(c.head_bwd if c.head_bwd is not None else c.head_fwd.scaled(c.bwd_factor)),
        )
        m = CostModel(cost.model, cost.layout, part)
        parts.append(m.fwd_time(chunk, 0) + m.bwd_time(chunk, 0))
    total = cost.fwd_time(chunk, 0) + cost.bwd_time(chunk, 0)
    return total + (pairs_scale - 1.0) * parts[0] + (token_scale - 1.0) * parts[1]


def synthetic_report(sp, div, grid, fwd, bwd, rec, head, opt_s, chunk_s, rng, noise=0.01, in_situ=(1.0, {})):
    """A :func:`measure_profile`-shaped report whose raw clock readings are ``div`` x the per-device
    times of known per-layer coefficients, a per-call cost ``c1·T + c0`` and relative noise. Whole-model
    calibration steps run ``in_situ = (pairs factor, {bucket: token factor})`` slower than the layers
    alone, plus ``chunk_s`` per chunk."""
    c0 = BASE.replace(token_buckets=grid.token_buckets, attention_block=_attention_block())
    cm = CostModel(SHAPE, Layout(1, 1, 1), c0)
    jitter = lambda: 1.0 + noise * rng.standard_normal()  # noqa: E731
    raw = {}
    for tb in grid.token_buckets:
        for cb in grid.context_buckets:
            for chunk in grid.chunks(tb, cb):
                p, t = cm.pairs(chunk), cm.linear_tokens(chunk)
                per_call = 2e-7 * t + 1e-3
                layer = {"fwd": fwd(p, t, sp), "fb": fwd(p, t, sp) + bwd(p, t, sp)}
                layer["fbr"] = layer["fb"] + rec(p, t, sp)
                modes = ("fwd", "fb", "fbr") if (tb, cb) in grid.remat_pairs else ("fwd", "fb")
                raw[str(chunk)] = {f"{m}{n}": div * (n * layer[m] + per_call) * jitter() for m in modes for n in (2, 3)}
    hf, hb = head
    head_rows = [
        [t, div * hf(0, t, sp) * jitter(), div * (hf(0, t, sp) + hb(0, t, sp)) * jitter()] for t in grid.token_buckets
    ]
    truth = (
        c0.replace(per_sp={sp: (fwd, bwd)}, head_per_sp={sp: head})
        if sp > 1
        else c0.replace(fwd=fwd, bwd=bwd, head_fwd=hf, head_bwd=hb)
    )
    cost = CostModel(SHAPE, Layout(1, 1, sp), truth)
    pairs_scale, token_scale = in_situ
    calibration = [
        [
            [c.context, list(c.slices), c.tail],
            div * (whole_model_step(cost, c, pairs_scale, token_scale.get(cm.linear_tokens(c), 1.0)) + chunk_s),
        ]
        for c in grid.calibration
    ]
    return {
        "raw": raw,
        "dual_layers": [2, 3],
        "head": head_rows,
        "memory": [],
        "optimizer_s": div * opt_s,
        "calibration": calibration,
        "repeats": 5,
        "token_buckets": list(grid.token_buckets),
        "context_buckets": list(grid.context_buckets),
        "sp": sp,
        "clock_divisor": div,
    }


def close(got: LayerTime, want: LayerTime, rel: float) -> None:
    for name in ("alpha1", "alpha2", "beta1"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), rel=rel), name


F2, B2, R2 = LayerTime(9e-9, 4e-6, 2e-4), LayerTime(2e-8, 3e-5, 3e-4), LayerTime(8e-9, 2e-6, 1e-4)
H2 = (LayerTime(0, 6e-7, 5e-4), LayerTime(0, 5e-6, 4e-4))


IN_SITU = (1.2, {512: 0.9, 1024: 1.1, 2048: 1.3})


def test_fit_profile_recovers_exact_per_sp_coefficients_without_noise():
    sub = synthetic_report(
        2, 2, SP_GRID, F2, B2, R2, H2, 1.5e-3, 3e-3, np.random.default_rng(0), noise=0.0, in_situ=IN_SITU
    )
    base = synthetic_report(1, 1, ProfileGrid(), F2, B2, R2, H2, 1e-3, 0.0, np.random.default_rng(0), noise=0.0)
    got = fit_profile(dict(base, sp_reports={"2": sub}), SHAPE, BASE)
    # isolated-layer coefficients, attention terms corrected by the in-situ pairs factor
    close(got.per_sp[2][0], dataclasses.replace(F2, alpha1=F2.alpha1 * 1.2), 1e-3)
    close(got.per_sp[2][1], dataclasses.replace(B2, alpha1=B2.alpha1 * 1.2), 1e-3)
    close(got.recompute_per_sp[2], dataclasses.replace(R2, alpha1=R2.alpha1 * 1.2), 1e-3)
    close(got.head_per_sp[2][0], H2[0], 1e-3)
    close(got.head_per_sp[2][1], H2[1], 1e-3)
    # sp = 1 steps run as the layers alone: factors 1, no per-chunk constant
    assert got.bucket_token_scale[1] == pytest.approx({512: 1.0, 1024: 1.0, 2048: 1.0}, rel=1e-4)
    close(got.head_bwd, H2[1], 1e-3)
    # the whole-model step of chunks that were not calibrated is predicted exactly: a per-chunk
    # constant is one more token factor per bucket (every chunk of a bucket has the same token part)
    truth = CostModel(
        SHAPE, Layout(1, 1, 2), got.replace(per_sp={2: (F2, B2)}, head_per_sp={2: H2}, bucket_token_scale={})
    )
    fitted = CostModel(SHAPE, Layout(1, 1, 2), got)
    for chunk in (
        ChunkShape(0, (300, 100)),
        ChunkShape(700, (600,), tail=False),
        ChunkShape(1900, (1000, 500)),
        ChunkShape(0, (2000,)),
    ):
        want = whole_model_step(truth, chunk, IN_SITU[0], IN_SITU[1][truth.linear_tokens(chunk)]) + 3e-3
        assert fitted.fwd_time(chunk, 0) + fitted.bwd_time(chunk, 0) == pytest.approx(want, rel=1e-4), chunk


def test_bucket_token_scale_lookup_and_json(tmp_path):
    c = BASE.replace(
        fwd=LayerTime(0, 1e-3, 0),
        bwd=LayerTime(),
        token_buckets=(512, 1024, 2048),
        bucket_token_scale={1: {1024: 2.0, 2048: 3.0}},
    )
    cm = CostModel(SHAPE, Layout(1, 1, 1), c)
    # smallest calibrated bucket >= the padded tokens; the largest factor beyond the buckets
    assert [cm.time_tokens(ChunkShape(0, (t,))) for t in (100, 600, 1500, 3000)] == [1024.0, 2048.0, 6144.0, 9000.0]
    assert cm.fwd_time(ChunkShape(0, (600,))) == pytest.approx(4 * 1e-3 * 2048)
    assert CostModel(SHAPE, Layout(1, 1, 2), c).time_tokens(ChunkShape(0, (600,))) == 1024  # no factors at sp = 2
    c.save(tmp_path / "p.json")
    assert CostCoefficients.load(tmp_path / "p.json") == c


def test_a_multi_stage_executors_padded_chunks_drop_the_bucket_factors_where_the_executor_fit_says_so(tmp_path):
    c = BASE.replace(
        fwd=LayerTime(0, 1e-3, 0), bwd=LayerTime(), token_buckets=(512, 1024), bucket_token_scale={1: {1024: 2.0}}
    )
    flat = c.replace(executor_bucket_scale=False)
    chunk = ChunkShape(0, (600,))
    for coeffs in (c, flat):  # unpadded chunks (the data-parallel step, InfiniPipe's async model) keep them
        assert CostModel(SHAPE, Layout(1, 1, 1), coeffs).time_tokens(chunk) == 2048.0
    assert CostModel(SHAPE, Layout(1, 2, 1), c).padded(1024).time_tokens(chunk) == 2048.0
    assert CostModel(SHAPE, Layout(1, 2, 1), flat).padded(1024).time_tokens(chunk) == 1024.0
    # one stage runs a chunk's forward and backward as one op, as the whole-model steps did
    assert CostModel(SHAPE, Layout(1, 1, 1), flat).padded(1024).time_tokens(chunk) == 2048.0
    flat.save(tmp_path / "p.json")
    assert CostCoefficients.load(tmp_path / "p.json").executor_bucket_scale is False
    data = flat.to_json()
    del data["executor_bucket_scale"]  # profiles saved before the field: the factors apply
    assert CostCoefficients.from_json(data).executor_bucket_scale is True


def test_fit_profile_recovers_per_sp_coefficients_and_leaves_sp1_alone():
    """With 1 % timing noise the per-chunk constants β1 are weakly identified (they trade off
    against the per-call constant of the 2- and 3-layer programs); the slopes and the predicted
    chunk times are what must come back."""
    rng = np.random.default_rng(0)
    grid1 = ProfileGrid()
    f1, b1, r1 = LayerTime(7e-9, 2.5e-6, 7e-5), LayerTime(1.6e-8, 2.4e-5, 1e-4), LayerTime(6e-9, 1e-6, 5e-5)
    report = synthetic_report(
        1, 1, grid1, f1, b1, r1, (LayerTime(0, 4e-7, 4e-4), LayerTime(0, 3e-6, 2e-4)), 1.2e-3, 0.0, rng
    )
    # sp = 2: per-device coefficients that differ from the sp = 1 ones (not an ideal 1/sp split)
    f2, b2, r2, h2 = F2, B2, R2, H2
    sub = synthetic_report(2, 2, SP_GRID, f2, b2, r2, h2, 1.5e-3, 3e-3, rng)
    alone = fit_profile(dict(report), SHAPE, BASE)
    both = fit_profile(dict(report, sp_reports={"2": sub}), SHAPE, BASE)

    sp1_scales = {1: both.bucket_token_scale[1]}
    assert (
        both.replace(
            per_sp={}, recompute_per_sp={}, head_per_sp={}, step_overhead_per_sp={}, bucket_token_scale=sp1_scales
        )
        == alone
    )
    fwd, bwd = both.per_sp[2]
    for got, want in ((fwd, f2), (bwd, b2)):
        assert got.alpha1 == pytest.approx(want.alpha1, rel=0.1)
        assert got.alpha2 == pytest.approx(want.alpha2, rel=0.1)
    assert both.step_overhead_per_sp[2] == pytest.approx(1.5e-3)  # raw clock / divisor
    # whole-plan prediction with the fitted coefficients is within 3 % of the truth
    truth = both.replace(
        per_sp={2: (f2, b2)},
        recompute_per_sp={2: r2},
        head_per_sp={2: (h2[0], dataclasses.replace(h2[1], beta1=h2[1].beta1 + 3e-3))},
    )
    for chunk, l in [
        (ChunkShape(1536, (768,), tail=False), 2),
        (ChunkShape(0, (600, 300, 100)), 4),
        (ChunkShape(512, (400, 200)), 0),
    ]:
        pred = [CostModel(SHAPE, Layout(1, 1, 2), c) for c in (both, truth)]
        t = [m.fwd_time(chunk, 0) + m.bwd_time(chunk, 0) + m.recompute_time(chunk, l) for m in pred]
        assert t[0] == pytest.approx(t[1], rel=0.03)


def test_cost_model_uses_per_sp_head_recompute_and_overhead(tmp_path):
    c = BASE.replace(
        fwd=LayerTime(1e-6, 1e-3, 0.1),
        bwd=LayerTime(2e-6, 2e-3, 0.2),
        recompute=LayerTime(0, 5e-4, 0.05),
        head_fwd=LayerTime(0, 1e-3, 0.01),
        head_bwd=LayerTime(0, 2e-3, 0.02),
        step_overhead=0.5,
        per_sp={2: (LayerTime(3e-6, 4e-3, 0.3), LayerTime(5e-6, 6e-3, 0.4))},
        recompute_per_sp={2: LayerTime(0, 7e-3, 0.03)},
        head_per_sp={2: (LayerTime(0, 8e-3, 0.04), LayerTime(0, 9e-3, 0.05))},
        step_overhead_per_sp={2: 0.7},
    )
    chunk = ChunkShape(0, (100,))  # attention_pairs = 100² = 10 000, T = 100
    cm = CostModel(SHAPE, Layout(1, 1, 2), c)
    assert cm.fwd_time(chunk, 0) == pytest.approx(4 * ((3e-6 * 1e4 + 4e-3 * 100) / 2 + 0.3) + (8e-3 * 100 / 2 + 0.04))
    assert cm.bwd_time(chunk, 0) == pytest.approx(4 * ((5e-6 * 1e4 + 6e-3 * 100) / 2 + 0.4) + (9e-3 * 100 / 2 + 0.05))
    assert cm.recompute_time(chunk, 2) == pytest.approx(2 * (7e-3 * 100 / 2 + 0.03))
    assert cm.step_overhead() == pytest.approx(0.7)
    # sp = 1 and an unprofiled degree keep the base coefficients
    one, four = CostModel(SHAPE, Layout(1, 1, 1), c), CostModel(SHAPE, Layout(1, 1, 4), c)
    assert one.fwd_time(chunk, 0) == pytest.approx(4 * (1e-6 * 1e4 + 1e-3 * 100 + 0.1) + (1e-3 * 100 + 0.01))
    assert one.recompute_time(chunk, 1) == pytest.approx(5e-4 * 100 + 0.05)
    assert (one.step_overhead(), four.step_overhead()) == (0.5, 0.5)
    assert four.recompute_time(chunk, 1) == pytest.approx(5e-4 * 100 / 4 + 0.05)
    # JSON keeps the new fields; profiles saved before them still load (no per-sp overrides);
    # an online rescale scales them with their groups
    c.save(tmp_path / "p.json")
    assert CostCoefficients.load(tmp_path / "p.json") == c
    old = {k: v for k, v in c.to_json().items() if k not in ("recompute_per_sp", "head_per_sp", "step_overhead_per_sp")}
    assert CostCoefficients.from_json(old) == c.replace(recompute_per_sp={}, head_per_sp={}, step_overhead_per_sp={})
    s = scale_coefficients(c, {"head": 2.0, "overhead": 3.0, "alpha2": 0.5})
    assert s.head_per_sp[2][1].alpha2 == pytest.approx(2 * 9e-3)
    assert s.step_overhead_per_sp[2] == pytest.approx(2.1)
    assert s.recompute_per_sp[2].alpha2 == pytest.approx(3.5e-3)
