"""``parallel.stage_weights=auto``: a strategy-policy run chooses replicated or sharded stage
weights once, by planning its first sample batches both ways; ``per_iteration``: every batch is
planned both ways and runs as the better plan."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
from conftest import SHIPPED_CPU_PROFILE

from jvarlen.config import ConfigError, load_config
from jvarlen.data.pipeline import DataPipeline
from jvarlen.layout import resolve_layout
from jvarlen.plan.coefficients import CostCoefficients
from jvarlen.plan.options import PlanningError
from jvarlen.plan.plan import PlanError
from jvarlen.plan.stage_weights import CHOICES, plan_each
from jvarlen.plan.strategy import Scheme, SchemeCosts, StrategyPlan
from jvarlen.runtime.strategies.groups import choose_stage_weights, stage_weight_variant
from jvarlen.runtime.strategies.pipeline import cost_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {"data.seq_len": "128", "data.tokens_per_batch": "1024", "data.max_documents": "200"}


def _config(tmp_path, cache, budget=None, **extra):
    coeffs = CostCoefficients.load(SHIPPED_CPU_PROFILE)
    profile = tmp_path / f"profile-{budget}.json"
    coeffs.replace(memory_budget=budget or coeffs.memory_budget).save(profile)
    overrides = {**SMALL, "data.cache_dir": cache, "train.cost_profile": str(profile), "plan.policy": "flexsp"}
    return load_config(os.path.join(ROOT, "configs", "hydraulis-cpu.yaml"), **{**overrides, **extra})


def _floor(config, layout, stage_weights) -> float:
    """Bytes a device of the widest one-stage group needs before any token."""
    variant = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, stage_weights=stage_weights))
    costs = SchemeCosts(cost_model(variant, layout, lambda _: None), layout.num_devices)
    return costs.cost(Scheme(1, 4)).memory_floor(0)


def test_auto_shards_the_stage_weights_where_replicated_states_do_not_fit(tmp_path, corpus_cache):
    """Under a budget just below what a one-stage group needs for its replicated states, FlexSP
    plans no batch replicated and every batch sharded: ``auto`` chooses sharded and says why."""
    loose = _config(tmp_path, corpus_cache)
    layout = resolve_layout(loose, 8)
    replicated, sharded = _floor(loose, layout, "replicated"), _floor(loose, layout, "sharded")
    assert sharded < 0.7 * replicated  # 1.53 against 2.42 MB: the decoder layers are most of the weights
    config = _config(tmp_path, corpus_cache, budget=0.98 * replicated)
    pipeline = DataPipeline(config.data, config.model.vocab_size)
    said = []
    assert choose_stage_weights(config, pipeline, layout, said.append) == "sharded"
    assert "stage_weights=auto: sharded" in said[-1] and "replicated: no plan" in said[-1]


def test_auto_keeps_replicated_stage_weights_where_memory_does_not_bind(tmp_path, corpus_cache):
    """With memory to spare both variants plan the same groups in the same predicted time (the
    cost model hides the sharded layers' gathers behind compute): the tie keeps the replicated
    weights, which gather nothing, and the line says both predictions."""
    config = _config(tmp_path, corpus_cache)
    pipeline = DataPipeline(config.data, config.model.vocab_size)
    said = []
    assert choose_stage_weights(config, pipeline, resolve_layout(config, 8), said.append) == "replicated"
    predicted = re.findall(r"(\d+\.\d+) s[;)]", said[-1])
    assert "stage_weights=auto: replicated" in said[-1] and len(predicted) == 2 and predicted[0] == predicted[1]


def test_auto_stage_weights_need_a_strategy_policy():
    for chosen in ("auto", "per_iteration"):
        with pytest.raises(ConfigError, match=f"stage_weights={chosen} .* plan.policy=epp"):
            load_config(os.path.join(ROOT, "configs", "epp-cpu.yaml"), **{"parallel.stage_weights": chosen})


def _variants(tmp_path, cache, budget, **extra):
    config = _config(tmp_path, cache, budget=budget, **extra)
    layout = resolve_layout(config, 8)
    pipeline = DataPipeline(config.data, config.model.vocab_size)
    return {c: stage_weight_variant(config, pipeline, layout, c) for c in CHOICES}


def test_per_iteration_runs_each_batch_as_the_better_of_both_plans(tmp_path, corpus_cache):
    """Under a budget 1.2x what a one-stage group's replicated states need: a batch of four
    128-token documents plans only sharded (no group holds one replicated), a batch of eight
    16-token ones plans both ways in the same predicted time and keeps the replicated weights.
    Under 1.5x both plan the long batch and the faster, sharded (more, smaller groups), wins;
    a 2,048-token document plans neither way and the error names both reasons."""
    floor = _floor(_config(tmp_path, corpus_cache), resolve_layout(_config(tmp_path, corpus_cache), 8), "replicated")
    tight = _variants(tmp_path, corpus_cache, 1.2 * floor)
    long = plan_each("flexsp", [128] * 4, tight)
    estimates = long.stats["stage_weights_estimates"]
    assert long.stage_weights == "sharded" and "error" in estimates["replicated"]
    assert long.stats["iteration_time_s"] == estimates["sharded"]["iteration_time_s"]
    short = plan_each("flexsp", [16] * 8, tight)
    estimates = short.stats["stage_weights_estimates"]
    assert short.stage_weights == "replicated"
    assert estimates["replicated"]["iteration_time_s"] == estimates["sharded"]["iteration_time_s"]
    loose = _variants(tmp_path, corpus_cache, 1.5 * floor)
    both = plan_each("flexsp", [128] * 4, loose)
    estimates = both.stats["stage_weights_estimates"]
    assert both.stage_weights == "sharded"
    assert estimates["sharded"]["iteration_time_s"] < 0.9 * estimates["replicated"]["iteration_time_s"]
    with pytest.raises(PlanningError, match="neither stage weights: replicated: .*; sharded: "):
        plan_each("flexsp", [2048], loose)


@pytest.mark.slow  # two runs' group programs to compile (~30 s on 2 cores)
def test_a_per_iteration_run_trains_as_the_stage_weights_it_plans(tmp_path, corpus_cache):
    """Through the training loop, under a budget that only sharded groups plan (1.2x a one-stage
    group's replicated floor: every batch of eight 128-token pieces plans sharded), a
    ``per_iteration`` run records ``stage_weights: sharded`` every step and trains bitwise as a
    ``sharded`` run of the same batches (the same plans, the same programs)."""
    import json

    import jax

    from jvarlen.runtime.loop import train

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    loose = _config(tmp_path, corpus_cache)
    floor = _floor(loose, resolve_layout(loose, 8), "replicated")
    args = {"train.steps": "2", "plan.ahead": "0", "plan.wait": "true", "logging.tensorboard": "false"}
    losses, records = {}, {}
    for choice in ("per_iteration", "sharded"):
        run_dir = tmp_path / choice
        extra = {**args, "parallel.stage_weights": choice, "logging.run_dir": str(run_dir)}
        losses[choice] = train(_config(tmp_path, corpus_cache, budget=1.2 * floor, **extra), quiet=True).losses
        records[choice] = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["stage_weights"] for r in records["per_iteration"]] == ["sharded", "sharded"]
    for r in records["per_iteration"]:  # both choices' estimates: replicated could not plan
        estimates = r["stage_weights_estimates_s"]
        assert "flexsp" in estimates["replicated"] and estimates["sharded"] == r["predicted_iteration_time_s"]
    assert [r["strategy"] for r in records["per_iteration"]] == [r["strategy"] for r in records["sharded"]]
    assert losses["per_iteration"] == losses["sharded"]


def test_per_iteration_bounds_the_second_variant_by_the_first_and_chooses_as_planning_both_in_full(
    tmp_path, corpus_cache
):
    """A policy that takes a ceiling (``epp-pipelines``, ``hydraulis``, and ``auto`` for those two)
    plans the sharded variant with the replicated plan's time as its ceiling: the choice and the
    plan's time are those of planning both variants in full, and a variant that could not beat the
    other says so (``not_faster_than_s``: here every ``epp-pipelines`` batch) or records its slower
    plan."""
    from jvarlen.plan.strategy import plan_strategy

    loose = _config(tmp_path, corpus_cache)
    floor = _floor(loose, resolve_layout(loose, 8), "replicated")
    bounded = {}
    for policy in ("auto", "epp-pipelines", "hydraulis"):
        for budget in (1.2 * floor, 1.5 * floor, None):
            variants = _variants(tmp_path, corpus_cache, budget, **{"plan.policy": policy})
            for lengths in ([128] * 4, [16] * 8, [128, 64, 16, 16, 9]):
                full = {}
                for choice, (costs, options) in variants.items():
                    try:
                        full[choice] = plan_strategy(policy, lengths, costs, options).stats["iteration_time_s"]
                    except PlanningError:
                        continue
                plan = plan_each(policy, lengths, variants)
                best = min(full.values())
                assert plan.stats["iteration_time_s"] == best, (policy, budget, lengths, full)
                assert plan.stage_weights == min(full, key=lambda c: (full[c], CHOICES.index(c)))
                other = plan.stats["stage_weights_estimates"]["sharded"]
                bounded[policy] = bounded.get(policy, 0) + ("not_faster_than_s" in other)
                assert "error" in other or other.get("not_faster_than_s") or other["iteration_time_s"] >= best
    # auto's other policies plan in full and give it a plan: it is bounded only where none of them plans
    assert bounded == {"auto": 0, "epp-pipelines": 9, "hydraulis": 7}


def test_a_strategy_plan_names_its_stage_weights_and_keeps_them_in_json(tmp_path, corpus_cache):
    variants = _variants(tmp_path, corpus_cache, None)
    from jvarlen.plan.strategy import plan_strategy

    for choice, (costs, options) in variants.items():
        plan = plan_strategy("flexsp", [100, 40, 20, 9], costs, options)
        assert plan.stage_weights == choice
        assert StrategyPlan.from_json(plan.to_json()).stage_weights == choice
    with pytest.raises(PlanError, match="stage_weights must be replicated, sharded or absent, got 'auto'"):
        StrategyPlan.from_json({**plan.to_json(), "stage_weights": "auto"})


def test_the_planner_cli_reads_stage_weights_auto_with_its_policy(tmp_path, capsys):
    """``python -m jvarlen.plan --policy flexsp`` on a config whose plan section names no strategy
    policy: the config is read as run with that policy (before: refused as an epp config)."""
    from jvarlen.plan.__main__ import main

    config, lengths = tmp_path / "auto.yaml", tmp_path / "lengths.txt"
    config.write_text("parallel:\n  dp: 8\n  stage_weights: auto\n")
    lengths.write_text("\n".join(["3000", "900", "400", "120"] * 2) + "\n")
    assert main(["--lengths", str(lengths), "--config", str(config), "--policy", "flexsp"]) == 0
    assert "parallel.stage_weights=auto: " in capsys.readouterr().out
    assert main(["--lengths", str(lengths), "--config", str(config), "--policy", "epp"]) == 2
    assert "stage_weights=auto" in capsys.readouterr().err


def test_the_planner_cli_plans_every_batch_both_ways_with_stage_weights_per_iteration(tmp_path, capsys):
    """``python -m jvarlen.plan`` with ``stage_weights: per_iteration`` (gpt-7b on 16 A800s, FlexSP)
    plans each batch as the run would: every batch's predicted iteration is the faster of the
    replicated and the sharded plan of it, and the table says which batches run sharded (here the
    two that hold a 60K-token document, the others replicated)."""
    from jvarlen.plan.__main__ import main

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(map(str, [60000, 2000, 900, 400, 120] * 3 + [3000, 2000, 1000] * 5)) + "\n")
    base = open(os.path.join(ROOT, "configs", "gpt-7b.yaml")).read()
    rows = {}
    for choice in ("replicated", "sharded", "per_iteration"):
        config = tmp_path / f"{choice}.yaml"
        config.write_text(base.replace("parallel:\n", f"parallel:\n  stage_weights: {choice}\n"))
        argv = ["--lengths", str(lengths), "--config", str(config), "--policy", "flexsp", "--devices", "16"]
        assert main([*argv, "--batch_size", "6", "--iterations", "6"]) == 0
        table = [line.split() for line in capsys.readouterr().out.splitlines() if re.match(r"\s+\d+ ", line)]
        rows[choice] = [(float(r[2]), "sharded" in r) for r in table]
    assert len(rows["per_iteration"]) == 6
    for each, replicated, sharded in zip(rows["per_iteration"], rows["replicated"], rows["sharded"]):
        assert each[0] == min(replicated[0], sharded[0])
        assert each[1] == (sharded[0] < replicated[0])
    # batches 3 and 5 hold a 60K-token document (seeds 3 and 5 of the CLI's sampler)
    assert [s for _, s in rows["per_iteration"]] == [False, False, False, True, False, True]


def test_a_per_iteration_strategy_plans_with_both_variants_and_runs_only_plans_that_say_theirs(tmp_path, corpus_cache):
    """A ``per_iteration`` groups strategy needs both choices' costs (and only it takes them), and
    refuses to run a plan that does not say its stage weights (a hand-built one): it could not
    know which programs the plan's memory account assumed."""
    from jvarlen.plan.strategy import plan_strategy
    from jvarlen.runtime.strategies.groups import GroupsStrategy

    with pytest.raises(ValueError, match="per_iteration plans with variants"):
        GroupsStrategy(None, None, "flexsp", stage_weights="per_iteration")
    with pytest.raises(ValueError, match="stage_weights must be"):
        GroupsStrategy(None, None, "flexsp", stage_weights="auto")  # the run resolves auto before
    strategy = object.__new__(GroupsStrategy)  # its plan reading alone: no devices needed
    strategy.stage_weights = "per_iteration"
    costs, options = _variants(tmp_path, corpus_cache, None)["sharded"]
    plan = plan_strategy("flexsp", [100, 40, 20, 9], costs, options)
    assert strategy.plan_stage_weights(plan) == "sharded"
    with pytest.raises(ValueError, match="plans that say their stage_weights"):
        strategy.plan_stage_weights(dataclasses.replace(plan, stage_weights=None))
