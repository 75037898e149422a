"""The bar of issue #19 through the real entry points: ``python -m jvarlen.train --model.init_from
<tiny transformers model>`` on a corpus holding exactly the fixture's documents starts at the loss
transformers computed for them (first step, 1e-4 relative), on the data-parallel path and (slow) on
the elastic pipeline; then ``python -m jvarlen.export`` writes the trained run as a Hugging Face
directory whose import is bitwise the run's checkpoint; resuming that run ignores init_from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import cli_env
from hf_helpers import fixture, reference

from jvarlen import export
from jvarlen.config import ModelConfig, parse_config
from jvarlen.hf import load as hf_load
from jvarlen.hf.export import restore_params
from jvarlen.parallel.layouts import state_mesh
from jvarlen.parallel.sharding import param_shardings
from jvarlen.runtime.run import open_run


def _corpus(path, ref) -> None:
    """The fixture's documents as token ids without <s> and </s>: the corpus adds them back."""
    with open(path, "w") as f:
        for a, b in zip(ref["offsets"][:-1], ref["offsets"][1:]):
            f.write(json.dumps({"ids": ref["tokens"][a + 1 : b - 1].tolist()}) + "\n")


def _run(tmp_path, name, steps, *extra) -> str:
    """``python -m jvarlen.train --model.init_from=<fixture>`` on the fixture's documents; its stdout."""
    command = [
        sys.executable, "-m", "jvarlen.train",
        f"--model.init_from={fixture(name)}",
        f"--data.tokenizer={fixture(name)}/tokenizer.json",
        "--data.source=jsonl", f"--data.path={tmp_path / 'docs.jsonl'}", "--data.tokens_field=ids",
        "--data.seq_len=40", "--data.tokens_per_batch=80",  # one batch holds all three documents
        f"--data.cache_dir={tmp_path / 'cache'}", f"--logging.run_dir={tmp_path / 'run'}",
        f"--train.steps={steps}", "--logging.tensorboard=false", "--logging.progress_bar=false",
        "--model.compute_dtype=float32", *extra,
    ]  # fmt: skip
    env = cli_env(2, values_only=True)
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _train(tmp_path, name, steps, *extra) -> list[dict]:
    """A fresh run from the fixture: what came from the checkpoint is printed, step 1's loss is
    transformers'."""
    ref = reference(name)
    _corpus(tmp_path / "docs.jsonl", ref)
    stdout = _run(tmp_path, name, steps, *extra)
    assert f"model from {fixture(name)}: vocab_size=" in stdout  # what came from the checkpoint
    assert "initial weights:" in stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["target_tokens"] == ref["target_count"].sum()
    assert records[0]["loss"] == pytest.approx(float(ref["loss"]), rel=1e-4)
    return records


def test_first_step_loss_is_transformers_then_export_imports_bitwise(tmp_path, monkeypatch):
    _train(tmp_path, "tiny-qwen2", 2, "--parallel.pp=1", "--model.attention=reference")
    out = tmp_path / "hf"
    assert export.main([f"--run_dir={tmp_path / 'run'}", f"--out_dir={out}", "--dtype=float32"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    restored = restore_params(str(tmp_path / "run"))
    saved = restored.params
    assert restored.step == 2 and restored.init_from == fixture("tiny-qwen2")
    again = ModelConfig(init_from=str(out))
    shardings = param_shardings(saved, state_mesh())
    back = hf_load.load_params(str(out), again, saved, shardings)
    initial = hf_load.load_params(fixture("tiny-qwen2"), again, saved, shardings)
    moved = 0
    for a, b, c in zip(jax.tree.leaves(saved), jax.tree.leaves(back), jax.tree.leaves(initial)):
        np.testing.assert_array_equal(a, np.asarray(b))
        moved += int(not np.array_equal(a, np.asarray(c)))
    assert moved == len(jax.tree.leaves(saved))  # step 2 trained every parameter
    assert export.main([f"--run_dir={tmp_path / 'nowhere'}", f"--out_dir={out}"]) == 2
    assert (
        export.main([f"--run_dir={tmp_path / 'run'}", f"--out_dir={out}2", "--dtype=fp16"]) == 2
    )  # one line, no traceback
    # the run's own checkpoint takes precedence over init_from, which is then not read at all
    config = parse_config(
        [
            f"--model.init_from={fixture('tiny-qwen2')}", f"--data.tokenizer={fixture('tiny-qwen2')}/tokenizer.json",
            "--data.source=jsonl", f"--data.path={tmp_path / 'docs.jsonl'}", "--data.tokens_field=ids",
            "--data.seq_len=40", "--data.tokens_per_batch=80", f"--data.cache_dir={tmp_path / 'cache'}",
            f"--logging.run_dir={tmp_path / 'run'}", "--train.steps=3", "--checkpoint.resume=true",
            "--logging.tensorboard=false", "--logging.progress_bar=false",
        ]
    )  # fmt: skip
    monkeypatch.setattr(hf_load, "timed_load_params", lambda *a: pytest.fail("init_from read despite a checkpoint"))
    run = open_run(config, quiet=True, stop_after=None)
    try:
        assert run.start == 2
        for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(run.state.params)):
            np.testing.assert_array_equal(a, np.asarray(b))
    finally:
        run.close()


@pytest.mark.slow
def test_first_step_loss_is_transformers_on_the_elastic_pipeline(tmp_path):
    records = _train(tmp_path, "tiny-llama", 1)
    assert records[0]["pp"] == 2
