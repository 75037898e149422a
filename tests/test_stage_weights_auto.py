"""``parallel.stage_weights=auto``: a strategy-policy run chooses replicated or sharded stage
weights once, by planning its first sample batches both ways."""

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
from jvarlen.plan.strategy import Scheme, SchemeCosts
from jvarlen.runtime.strategies.groups import choose_stage_weights
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
    with pytest.raises(ConfigError, match="stage_weights=auto .* plan.policy=epp"):
        load_config(os.path.join(ROOT, "configs", "epp-cpu.yaml"), **{"parallel.stage_weights": "auto"})


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
