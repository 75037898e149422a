"""logging.trace_steps: a profiler trace of the chosen steps, where TensorBoard's profile tab looks."""

import glob
import gzip
import json

import pytest
from conftest import values_compile
from tiny_flags import REFERENCE_ATTENTION, TINY_MODEL_ARGS

from jvarlen.config import ConfigError, parse_config
from jvarlen.runtime.loop import train


def _config(tmp_path, *extra):
    return parse_config(
        [
            *TINY_MODEL_ARGS,
            REFERENCE_ATTENTION,
            "--data.seq_len=128",
            "--data.tokens_per_batch=1024",
            "--data.max_documents=40",
            f"--data.cache_dir={tmp_path / 'corpus'}",
            f"--logging.run_dir={tmp_path / 'run'}",
            "--logging.progress_bar=false",
            "--parallel.pp=1",
            "--train.cost_profile=none",
            *extra,
        ]
    )


def test_the_traced_steps_are_the_ones_asked_for(tmp_path, capsys):
    train(_config(tmp_path, "--train.steps=4", "--logging.trace_steps=[2,3]"), compiler_options=values_compile())
    assert "profiler trace of steps 2-3 written under" in capsys.readouterr().out
    traces = glob.glob(str(tmp_path / "run" / "tensorboard" / "plugins" / "profile" / "*" / "*.trace.json.gz"))
    assert len(traces) == 1 and glob.glob(traces[0].replace(".trace.json.gz", ".xplane.pb"))
    with gzip.open(traces[0]) as f:
        names = [e.get("name", "") for e in json.load(f)["traceEvents"]]
    # two executions of the step program (on each of the 8 devices): steps 2 and 3, not 1 (it compiled) or 4
    assert sum(n == "CommonPjRtLoadedExecutable::Execute (jit_train_step)" for n in names) == 2
    assert sum(n == "[7] CommonPjRtLoadedExecutable::Execute (jit_train_step)" for n in names) == 2


def test_trace_steps_outside_the_run_are_said_and_bad_ones_refused(tmp_path, capsys):
    train(_config(tmp_path, "--train.steps=2", "--logging.trace_steps=[5,6]"), compiler_options=values_compile())
    out = capsys.readouterr().out
    assert "logging.trace_steps=[5, 6] lies outside the steps this run takes (1-2): no trace" in out
    assert not (tmp_path / "run" / "tensorboard" / "plugins").exists()
    for bad in ("[3,2]", "[0,2]", "[4]"):
        with pytest.raises(ConfigError, match="logging.trace_steps must be \\[first, last\\]"):
            _config(tmp_path, f"--logging.trace_steps={bad}")
