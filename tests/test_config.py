"""Configuration: YAML + dotted overrides, and errors that name the field."""

import dataclasses

import pytest

from jvarlen.config import CONFIG_DIR, Config, ConfigError, load_config, parse_config
from jvarlen.layout import Layout, resolve_layout


def test_defaults_equal_configs_default_yaml():
    assert load_config(CONFIG_DIR / "default.yaml") == Config()


def test_dotted_override_on_top_of_yaml():
    config = parse_config(["--config", str(CONFIG_DIR / "default.yaml"), "--model.num_layers=2", "--data.seq_len=512"])
    assert config.model.num_layers == 2 and config.data.seq_len == 512
    assert config.model.d_model == 128  # from the YAML


def test_unknown_key_is_rejected():
    with pytest.raises(ConfigError, match="model.bogus"):
        parse_config(["--model.bogus=3"])


def test_unknown_key_in_yaml_is_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  num_layerz: 3\n")
    with pytest.raises(Exception, match="num_layerz"):
        parse_config(["--config", str(path)])


def test_wrong_type_names_the_field():
    with pytest.raises(Exception, match="model.num_layers"):
        parse_config(["--model.num_layers=four"])


def test_a_boolean_is_not_a_number(tmp_path):
    """YAML's ``true`` is not read as 1 (``int(True)``): ``steps: true`` would have trained one step."""
    path = tmp_path / "bools.yaml"
    path.write_text("train:\n  steps: true\n")
    with pytest.raises(ConfigError, match="train.steps.*boolean true"):
        parse_config(["--config", str(path)])
    with pytest.raises(ConfigError, match="optimizer.learning_rate.*boolean false"):
        parse_config(["--optimizer.learning_rate=false"])
    with pytest.raises(ConfigError, match="data.seq_len.*float 64.5"):
        parse_config(["--data.seq_len=64.5"])
    config = parse_config(["--train.steps=7", "--optimizer.learning_rate=2", "--checkpoint.every_steps=3"])
    assert (config.train.steps, config.optimizer.learning_rate) == (7, 2.0) and type(
        config.optimizer.learning_rate
    ) is float


def test_heads_not_divisible_by_kv_heads():
    with pytest.raises(ConfigError, match=r"num_heads \(6\) must be divisible by model.num_kv_heads \(4\)"):
        parse_config(["--model.num_heads=6", "--model.num_kv_heads=4", "--model.head_dim=32"])


def test_batch_must_be_whole_rows():
    with pytest.raises(ConfigError, match="tokens_per_batch"):
        parse_config(["--data.seq_len=1000", "--data.tokens_per_batch=1500"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data.path=/my/docs.jsonl"], "data.source is 'stdlib'"),  # without data.source: not the stdlib
        (["--data.tokens_field=ids"], "tokens_field applies to jsonl and parquet"),
        (["--data.source=text_dir", "--data.path=/d", "--data.tokens_field=ids"], "not data.source='text_dir'"),
        (["--data.source=jsonl", "--data.path=/d", "--data.tokens_field=ids", "--data.text_field=body"], "both set"),
        (["--data.seed=-1"], "data.seed must be >= 0"),
        (["--optimizer.b2=-1"], r"optimizer.b2 must be in \[0, 1\)"),
        (["--optimizer.b1=1.0"], r"optimizer.b1 must be in \[0, 1\)"),
        (["--optimizer.eps=0"], "optimizer.eps must be > 0"),
        (["--optimizer.weight_decay=-5"], "optimizer.weight_decay must be >= 0"),
        (["--data.text_field=body"], "text_field applies to jsonl and parquet sources, not data.source='stdlib'"),
        (["--optimizer.learning_rate=inf"], "optimizer.learning_rate must be > 0 and finite, got inf"),
        (["--optimizer.eps=inf"], "optimizer.eps must be > 0 and finite"),
        (["--optimizer.weight_decay=inf"], "optimizer.weight_decay must be >= 0 and finite"),
        (["--model.rope_theta=0"], "model.rope_theta must be > 0 and finite, got 0"),
        (["--model.norm_eps=-1"], "model.norm_eps must be > 0"),
        (["--model.norm_eps=nan"], "model.norm_eps must be > 0"),
        # alone, as process 0, into the run directory every host would share
        (["--parallel.num_processes=2", "--parallel.process_id=1"], "process_id set without parallel.distributed"),
        (["--checkpoint.resume=true", "--logging.overwrite=true"], "set one of them"),
        (["--plan.policy=auto", "--plan.min_slice_tokens=256"], "plan.min_slice_tokens set the elastic pipeline"),
        (["--plan.policy=dcp", "--plan.gpipe_units=false", "--plan.solver_seed=3"], "gpipe_units, plan.solver_seed"),
    ],
)
def test_fields_that_would_be_ignored_or_break_training_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(flags)


def test_planning_workers_need_iterations_ahead():
    with pytest.raises(ConfigError, match=r"plan.workers=4 needs plan.ahead >= 3"):
        parse_config(["--plan.workers=4", "--plan.ahead=2"])
    with pytest.raises(ConfigError, match="plan.workers"):
        parse_config(["--plan.workers=0"])
    assert parse_config(["--plan.workers=3", "--plan.ahead=2"]).plan.workers == 3


def test_stage_weights_are_replicated_or_sharded():
    assert parse_config([]).parallel.stage_weights == "replicated"
    assert parse_config(["--parallel.stage_weights=sharded"]).parallel.stage_weights == "sharded"
    with pytest.raises(ConfigError, match="parallel.stage_weights"):
        parse_config(["--parallel.stage_weights=zero3"])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(["--config", "/nonexistent/x.yaml"])


def test_a_config_file_is_a_mapping_of_sections_and_an_empty_one_sets_nothing(tmp_path):
    with pytest.raises(ConfigError, match="--config needs the path of a YAML config file"):
        parse_config(["--model.d_model=64", "--config"])
    with pytest.raises(ConfigError, match="is a directory"):
        parse_config(["--config", str(tmp_path)])
    with pytest.raises(ConfigError, match="--config and --config_path: give one config file"):
        parse_config(["--config=a.yaml", "--config_path=b.yaml"])
    (tmp_path / "list.yaml").write_text("- model\n- data\n")
    with pytest.raises(ConfigError, match="holds a list, not a mapping of sections"):
        parse_config(["--config", str(tmp_path / "list.yaml")])
    (tmp_path / "empty.yaml").write_text("# nothing set yet\n")
    assert parse_config(["--config", str(tmp_path / "empty.yaml"), "--model.d_model=64"]).model.d_model == 64


def test_auto_pipeline_stages_pick_the_elastic_pipeline_when_two_stages_fit():
    auto = Config()
    assert auto.parallel.pp is None
    assert resolve_layout(auto, 2).pp == 2
    assert resolve_layout(auto, 8).pp == 2  # dp = 4 pipelines of 2 stages
    assert resolve_layout(auto, 1).pp == 1  # one device: data parallel
    assert resolve_layout(auto, 3).pp == 1
    odd = parse_config(["--model.num_layers=3"])
    assert resolve_layout(odd, 8).pp == 1
    policy = parse_config(["--parallel.tokens_per_device=512"])
    assert resolve_layout(policy, 8).pp == 1  # a data-parallel layout policy
    fixed = parse_config(["--parallel.dp=2", "--parallel.sp=2"])
    assert resolve_layout(fixed, 8).pp == 2 and resolve_layout(fixed, 4).pp == 1
    assert resolve_layout(parse_config(["--parallel.pp=4"]), 8).pp == 4  # set: kept


def test_a_strategy_policy_runs_on_the_devices_its_config_names():
    """The groups are planned over parallel.dp*pp*sp devices: a host with another count is refused
    (before: the run planned and trained on all the host's devices); dp unset takes them all."""
    groups = load_config(CONFIG_DIR / "auto-cpu.yaml")
    assert resolve_layout(groups) == resolve_layout(groups, 8) == Layout(dp=8)
    with pytest.raises(ConfigError, match="plans parallel.dp\\*pp\\*sp = 8 devices, but there are 16"):
        resolve_layout(groups, 16)
    everything = parse_config(["--config", str(CONFIG_DIR / "auto-cpu.yaml"), "--parallel.dp=null"])
    assert resolve_layout(everything, 16) == Layout(dp=16)


def _readme_train_commands() -> list[list[str]]:
    """The arguments of every ``python -m jvarlen.train`` command in the README's shell blocks."""
    import re
    import shlex

    readme = (CONFIG_DIR.parent / "README.md").read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", readme, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "jvarlen.train" in line:
                words = shlex.split(line, comments=True)
                commands.append(words[len(words) - words[::-1].index("jvarlen.train") :])
    return commands


def test_the_readme_training_commands_parse_and_fit_their_layouts():
    """Every command the README shows is accepted as written (placeholders filled in): a flag
    renamed or a layout its model cannot take fails here, not on a user's cluster."""
    commands = _readme_train_commands()
    assert len(commands) >= 8 and [] in commands  # the quick start's bare command is among them
    fill = {"PATH": str(CONFIG_DIR.parent / "tests" / "fixtures" / "hf" / "tiny-llama"), "$RANK": "1"}
    for args in commands:
        for placeholder, value in fill.items():
            args = [a.replace(placeholder, value) for a in args]
        resolve_layout(parse_config(args))


def test_every_flag_of_the_training_command_has_its_own_help():
    """``python -m jvarlen.train --help`` (and the export, planner and profiler commands') describes each flag with the comment beside its field:
    none is blank, and a choice field's comment is its own (a ``Literal[...]`` written in place
    hid the field from draccus, which gave its comment to the next field: ``--model.remat`` read
    as the attention implementation)."""
    from draccus import argparsing

    from jvarlen.hf.export import ExportConfig
    from jvarlen.plan.cli import PlanCli
    from jvarlen.profile.cli import ProfileConfig

    def helps(config_class):
        parser = argparsing.ArgumentParser(config_class=config_class).parser
        return {a.option_strings[-1]: (a.help or "").strip() for a in parser._actions if a.option_strings}

    for tool in (ExportConfig, PlanCli, ProfileConfig):
        got = helps(tool)  # its fields, --help and --config_path
        assert len(got) == len(dataclasses.fields(tool)) + 2 and not [f for f, text in got.items() if not text], tool
    helps = helps(Config)
    assert len(helps) > 60 and not [flag for flag, text in helps.items() if not text]
    assert helps["--model.remat"].startswith("Layers whose forward is recomputed")
    assert helps["--model.attention"].startswith("Attention implementation")
    assert helps["--plan.min_slice_tokens"].startswith("The finest average slice")
    assert helps["--plan.solver_seed"] == "CP-SAT's random seed"
