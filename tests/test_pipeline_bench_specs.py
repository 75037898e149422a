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

from pipeline_policies import add_recompute_variants, policy_cost  # noqa: E402

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
