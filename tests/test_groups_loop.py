"""Heterogeneous groups through the training loop: a strategy policy plans every iteration in the
background, the groups strategy runs it, checkpoints and resume are those of every strategy."""

from __future__ import annotations

import itertools
import json
import os

import jax
import numpy as np
import pytest
from conftest import FROZEN_CPU_PROFILE
from pipeline_helpers import FAST_COMPILE

from jvarlen.config import load_config
from jvarlen.runtime.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    "model.d_model": "32",
    "model.mlp_dim": "64",
    "model.num_layers": "2",
    "data.seq_len": "512",
    "data.tokens_per_batch": "2048",
    "data.max_documents": "200",
    "logging.tensorboard": "false",
    "logging.progress_bar": "false",
    "plan.wait": "true",
}


@pytest.fixture(autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")


def _config(name, run_dir, cache, **extra):
    overrides = {**TINY, "logging.run_dir": str(run_dir), "data.cache_dir": cache, **extra}
    return load_config(os.path.join(ROOT, "configs", name), **overrides)


def _records(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.mark.slow  # four group programs to compile (~2 min on 2 shared cores); tests/test_groups.py covers the step
def test_groups_train_through_the_loop_and_resume_bitwise(tmp_path, corpus_cache):
    # inline planning (plan.ahead=0) and two steps keep it short; the planning service is tested elsewhere
    args = {"plan.policy": "homogeneous", "train.steps": "2", "checkpoint.every_steps": "1", "plan.ahead": "0"}
    fast = {"quiet": True, "compiler_options": FAST_COMPILE}
    full = train(_config("hydraulis-cpu.yaml", tmp_path / "full", corpus_cache, **args), **fast)
    train(_config("hydraulis-cpu.yaml", tmp_path / "cut", corpus_cache, **args), stop_after=1, **fast)
    resumed = train(
        _config("hydraulis-cpu.yaml", tmp_path / "cut", corpus_cache, **args, **{"checkpoint.resume": "true"}), **fast
    )
    assert resumed.first_step == 1 and resumed.losses == full.losses[1:]  # bitwise
    records = _records(tmp_path / "full")
    assert all(r["strategy"] and r["groups"] >= 1 and np.isfinite(r["loss"]) for r in records)
    assert [r["step"] for r in _records(tmp_path / "cut")] == [1, 2]
    _assert_cache_counts_steps(records)
    _assert_cache_counts_steps(_records(tmp_path / "cut")[1:])  # the resumed process counts from its start


def _assert_cache_counts_steps(records):
    """``step_cache_hits/misses`` count this process' steps (a group step is several programs)."""
    hits = [r["step_cache_hits"] for r in records]
    misses = [r["step_cache_misses"] for r in records]
    assert [h + m for h, m in zip(hits, misses)] == list(range(1, len(records) + 1))
    assert misses == list(itertools.accumulate(int(r["compiled"]) for r in records))


@pytest.mark.slow  # the real configs: ~10 group programs to compile on 2 shared cores (several minutes)
@pytest.mark.parametrize("name", ["hydraulis-cpu.yaml", "auto-cpu.yaml"])
def test_cpu_configs_choose_several_strategies_and_stop_compiling(tmp_path, corpus_cache, name):
    # On hydraulis-cpu's stdlib batches one in ~50 calls for another scheme than 4×(pp=1, sp=2): with
    # data.seed 4 step 8 does (2×(pp=1, sp=4): plan_strategy on the pipeline's first 12 batches). The
    # sampler's permutation is jvarlen's own integer arithmetic; the corpus is the running Python's
    # standard library (Python 3.11's here: another version's sources give other batches).
    seed = {"hydraulis-cpu.yaml": "4"}.get(name, "0")
    # auto-cpu's model has no profile of its own and plans with a stand-in; which policy wins a
    # batch rests on that profile's numbers, so the test plans with the frozen one (with the shipped
    # one, whose executor terms price two-stage pipelines as the executor runs them, the homogeneous
    # 4×(pp=1, sp=2) ties or wins all 12 batches on this seed)
    profile = {"auto-cpu.yaml": {"train.cost_profile": FROZEN_CPU_PROFILE}}.get(name, {})
    config = load_config(
        os.path.join(ROOT, "configs", name),
        **{"logging.run_dir": str(tmp_path), "train.steps": "12", "plan.wait": "true", "data.cache_dir": corpus_cache},
        **{"data.seed": seed},
        **profile,
    )
    train(config, quiet=True)
    records = _records(tmp_path)
    strategies = {r["strategy"] for r in records}
    assert len(strategies) >= 2, strategies
    if name == "auto-cpu.yaml":
        assert all(len(r["policy_estimates_s"]) == 5 for r in records)
        assert len({r["policy_chosen"] for r in records}) >= 2
    hits = [r["step_cache_hits"] for r in records]
    assert hits[-1] > hits[0] and not records[-1]["compiled"]
    _assert_cache_counts_steps(records)
