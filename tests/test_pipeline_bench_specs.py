"""The pipeline benchmark's recomputation variants (``bench_pipeline.py --parts retime
--recompute-variants``): each plan that recomputes nothing, again with every layer recomputed and
nothing else changed, so that a fit of the executor's terms sees recomputation apart from the
ticks and buffers that grow with it elsewhere."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from pipeline_policies import (  # noqa: E402
    add_recompute_variants,
    adopt_profile,
    check_units,
    load_runs,
    policy_cost,
    shipped_profile,
)

from jvarlen.config import ModelConfig  # noqa: E402
from jvarlen.plan.assemble import simulate  # noqa: E402
from jvarlen.plan.plan import Plan  # noqa: E402

SPEC = ROOT / "docs" / "data" / "pipeline" / "bucket" / "retimed-probe20" / "cal2k_s102-103.spec.json"
PROFILE = ROOT / "docs" / "data" / "cost-model" / "reference" / "profile_tick_pool.json"  # prices recomputation


def test_every_plan_that_stores_all_layers_gets_its_fully_recomputed_twin():
    spec = json.loads(SPEC.read_text())
    spec["profile"] = str(PROFILE)
    before = {b["seed"]: dict(b["plans"]) for b in spec["batches"]}
    add_recompute_variants(spec)
    ns = argparse.Namespace(profile=str(PROFILE), budget_mb=0.0, pp=spec["pp"])
    cost, _ = policy_cost(ns, ModelConfig(**spec["model"]))
    for batch in spec["batches"]:
        plans = {k: Plan.from_json(v) for k, v in batch["plans"].items()}
        originals = {k: Plan.from_json(v) for k, v in before[batch["seed"]].items()}
        stored = [k for k, p in originals.items() if not np.asarray(p.ckpt_layers).any()]
        assert stored and set(plans) == set(originals) | {f"{k}+remat" for k in stored}
        for k in stored:
            plan, twin = originals[k], plans[f"{k}+remat"]
            assert twin.chunks == plan.chunks and twin.schedule == plan.schedule and twin.policy == f"{k}+remat"
            assert np.all(np.asarray(twin.ckpt_layers) == plan.num_layers // plan.layout.pp)
            # predicted anew with the spec's profile (the original's stats are not the twin's)
            assert twin.stats["iteration_time_s"] == pytest.approx(simulate(twin, cost, "paired").iteration_time)
            assert twin.stats["iteration_time_s"] > simulate(plan, cost, "paired").iteration_time


def test_a_run_aimed_at_another_profile_keeps_its_plans_and_takes_that_profiles_clock():
    ((spec, times),) = load_runs(str(SPEC))
    model = ModelConfig(**spec["model"])
    shipped = shipped_profile(model)
    ns = argparse.Namespace(profile=shipped, budget_mb=0.0, pp=spec["pp"])
    cost, _ = policy_cost(ns, model)
    assert spec["reference_s"] != cost.coeffs.meta.reference_s  # planned and timed on the profile before
    with pytest.raises(SystemExit, match="another clock"):
        check_units([(spec, times)], cost, shipped)
    before = {b["seed"]: {k: Plan.from_json(v) for k, v in b["plans"].items()} for b in spec["batches"]}
    adopt_profile(spec, shipped)
    assert spec["profile"] == shipped and spec["reference_s"] == cost.coeffs.meta.reference_s
    assert spec["probe_residual_policy"] == cost.coeffs.meta.profiled_residual_policy == "dots_and_attention"
    check_units([(spec, times)], cost, shipped)
    for batch in spec["batches"]:
        for policy, plan_json in batch["plans"].items():
            plan, old = Plan.from_json(plan_json), before[batch["seed"]][policy]
            assert plan.chunks == old.chunks and plan.schedule == old.schedule
            assert np.array_equal(plan.ckpt_layers, old.ckpt_layers)
            budget = argparse.Namespace(profile=shipped, budget_mb=plan.memory_budget_bytes / 1e6, pp=spec["pp"])
            now = simulate(plan, policy_cost(budget, model)[0], "paired").iteration_time
            assert plan.stats["iteration_time_s"] == pytest.approx(now)
            assert plan.stats["iteration_time_s"] != pytest.approx(old.stats["iteration_time_s"], rel=0.05)


def test_runs_on_the_profile_they_were_timed_against_pass_the_units_check():
    runs = load_runs(str(SPEC))
    ns = argparse.Namespace(profile=str(PROFILE), budget_mb=0.0, pp=runs[0][0]["pp"])
    check_units(runs, policy_cost(ns, ModelConfig(**runs[0][0]["model"]))[0], str(PROFILE))
