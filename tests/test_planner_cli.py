"""The planner CLI end to end: lengths file + config -> summary table and JSON."""

import json

import pytest

from jvarlen.plan.__main__ import main
from jvarlen.plan.plan import Plan

CONFIG = """
model:
  vocab_size: 4096
  d_model: 1024
  num_layers: 8
  num_heads: 8
  num_kv_heads: 8
  mlp_dim: 2816
parallel:
  pp: 4
  sp: 2
"""


@pytest.mark.parametrize("policy", ["epp", "seq1f1b", "dapple"])
def test_cli_writes_the_issue_fields(tmp_path, capsys, policy):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(x) for x in [30_000, 9_000, 4_000, 1_500, 800, 300, 120, 64] * 4) + "\n")
    config = tmp_path / "tiny.yaml"
    config.write_text(CONFIG)
    out, plan_path = tmp_path / "out.json", tmp_path / "plan.json"
    rc = main(
        [
            "--lengths",
            str(lengths),
            "--config",
            str(config),
            "--policy",
            policy,
            "--json",
            str(out),
            "--plan",
            str(plan_path),
            "--batch-size",
            "16",
            "--iterations",
            "2",
            "--cluster",
            "a800",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"policy {policy}" in printed and "median solve" in printed
    data = json.loads(out.read_text())
    for key in (
        "policy",
        "solve_seconds",
        "iteration_time_s",
        "bubble_ratio",
        "peak_memory_bytes",
        "memory_budget_bytes",
        "tokens_in",
        "tokens_planned",
    ):
        assert key in data, key
        assert key in data["iterations"][0], key
    assert data["policy"] == policy and data["tokens_in"] == data["tokens_planned"]
    assert len(data["peak_memory_bytes"]) == 4 and len(data["iterations"]) == 2
    plan = Plan.load(plan_path)
    plan.validate(list(plan.lengths))


def test_planner_never_imports_jax():
    import subprocess
    import sys

    code = "import sys, jvarlen.plan, jvarlen.plan.service; assert 'jax' not in sys.modules, 'planner imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_plans_an_auto_pp_config_for_the_executor(tmp_path, capsys):
    """configs/default.yaml leaves parallel.pp to the run (auto): the CLI plans the 2 stages a
    training run of it gets; --simulation ticks reports the lock-step executor's time, which is
    never shorter than the async time of the same plan."""
    from jvarlen.config import CONFIG_DIR
    from jvarlen.plan.assemble import simulate
    from jvarlen.plan.cli import cost_from_config

    config = str(CONFIG_DIR / "default.yaml")
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("3000\n500\n700\n9000\n200\n")
    cost = cost_from_config(config, "a800", True)
    for mode in ("async", "ticks"):
        out, plan_path = tmp_path / f"{mode}.json", tmp_path / f"{mode}.plan.json"
        rc = main(
            [
                "--lengths",
                str(lengths),
                "--config",
                config,
                "--n_slices",
                "3",
                "--simulation",
                mode,
                "--json",
                str(out),
                "--plan",
                str(plan_path),
            ]
        )
        assert rc == 0
        plan = Plan.load(plan_path)
        assert plan.layout.pp == 2 and plan.stats["simulation"] == mode
        reported = json.loads(out.read_text())["iteration_time_s"]
        assert reported == pytest.approx(simulate(plan, cost, mode).iteration_time)
        assert simulate(plan, cost, "ticks").iteration_time >= simulate(plan, cost, "async").iteration_time > 0
    capsys.readouterr()


def test_the_gantt_chart_is_of_the_first_iteration_planned(tmp_path, capsys, monkeypatch):
    """An iteration that fails leaves the chart to the next one planned (before: iteration 0 or
    nothing, without a word); when none is planned, stderr says that no chart was written."""
    import jvarlen.plan.cli as cli
    from jvarlen.plan.api import PlanningError

    lengths, config = tmp_path / "lengths.txt", tmp_path / "tiny.yaml"
    lengths.write_text("\n".join(str(x) for x in [9_000, 4_000, 1_500, 800, 300, 120] * 2) + "\n")
    config.write_text(CONFIG)
    plan, calls, titles = cli.plan_iteration, [], []
    refuse = {0}

    def first_refused(batch, **kwargs):
        calls.append(len(calls))
        if calls[-1] in refuse:
            raise PlanningError("refused for the test")
        return plan(batch, **kwargs)

    monkeypatch.setattr(cli, "plan_iteration", first_refused)
    monkeypatch.setattr("jvarlen.plan.gantt.draw_gantt", lambda *a, title, **k: titles.append(title))
    args = ["--lengths", str(lengths), "--config", str(config), "--batch-size", "4", "--gantt", str(tmp_path / "g.png")]
    assert main(args + ["--iterations", "3"]) == 1
    assert titles == ["epp: iteration 1"]
    calls.clear()
    refuse.add(1)
    assert main(args + ["--iterations", "2"]) == 1
    assert titles == ["epp: iteration 1"] and "no iteration was planned, no chart written" in capsys.readouterr().err
