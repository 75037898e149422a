"""``python -m jvarlen.plan --policy <strategy policy>``: strategy plans from the planner CLI, every
registered policy reporting the same summary."""

import json

import pytest

from jvarlen.plan.__main__ import main
from jvarlen.plan.strategy import StrategyPlan, load_any, strategy_policies

CONFIG = """
model:
  vocab_size: 4096
  d_model: 1024
  num_layers: 8
  num_heads: 8
  num_kv_heads: 8
  mlp_dim: 2816
parallel:
  pp: 2
  sp: 4
"""


@pytest.mark.parametrize("policy", sorted(strategy_policies()))
def test_cli_plans_strategies(tmp_path, capsys, policy):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(x) for x in [30_000, 9_000, 4_000, 1_500, 800, 300, 120, 64] * 8) + "\n")
    config = tmp_path / "tiny.yaml"
    config.write_text(CONFIG)
    out, plan_path, gantt = tmp_path / "out.json", tmp_path / "plan.json", tmp_path / "g.png"
    args = ["--lengths", str(lengths), "--config", str(config), "--policy", policy, "--devices", "16"]
    args += ["--json", str(out), "--plan", str(plan_path), "--gantt", str(gantt), "--batch-size", "24"]
    assert main(args + ["--iterations", "2", "--cluster", "h100"]) == 0
    printed = capsys.readouterr().out
    assert f"policy {policy}" in printed and "median solve" in printed
    data = json.loads(out.read_text())
    assert data["policy"] == policy and data["iterations_planned"] == 2
    for key in ("solve_seconds", "iteration_time_s", "propagation_s", "strategy", "fits_memory", "imbalance"):
        assert data["iterations"][0][key] is not None, key
    assert data["bubble_ratio"] >= 0 and 0 < data["peak_memory_fraction"] and data["tokens_in"] > 0
    plan = load_any(plan_path)
    assert isinstance(plan, StrategyPlan) and plan.num_devices == 16
    plan.validate(list(plan.lengths))
    assert gantt.read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_unknown_policies():
    from jvarlen.plan.cli import PlanCli

    with pytest.raises(ValueError, match="epp.*homogeneous, hydraulis"):
        PlanCli(lengths="x", config="y", policy="nope")
    with pytest.raises(ValueError, match="--devices"):
        PlanCli(lengths="x", config="y", policy="hydraulis", devices=-1)


@pytest.mark.parametrize("stage_weights", ["replicated", "sharded", "auto"])
def test_cli_plans_with_the_configs_stage_weights(tmp_path, capsys, stage_weights):
    """FlexSP plans a 13B model on 16 A800s only with the groups' layers sharded (replicated, a
    one-stage group needs 115 GB per device): the CLI plans with the config's
    ``parallel.stage_weights`` as the run does, and with ``auto`` chooses as the run does."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = tmp_path / "llama-13b.yaml"
    extra = f"parallel:\n  stage_weights: {stage_weights}\nplan:\n  policy: flexsp\n"  # auto needs a strategy policy
    config.write_text(open(os.path.join(root, "configs", "llama-13b.yaml")).read() + extra)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(x) for x in [9_000, 4_000, 1_500, 800, 300] * 4) + "\n")
    args = ["--lengths", str(lengths), "--config", str(config), "--policy", "flexsp", "--devices", "16"]
    code = main(args + ["--cluster", "a800", "--batch-size", "10", "--iterations", "2"])
    printed = capsys.readouterr().out
    if stage_weights == "replicated":
        assert code == 1 and "no SP group holds a single token" in printed and "which fits" in printed
    else:
        assert code == 0 and "median solve" in printed
    assert ("parallel.stage_weights=auto: sharded" in printed) == (stage_weights == "auto")
