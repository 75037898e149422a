"""The elastic pipeline training path (parallel.pp > 1): the real entry point with
configs/epp-cpu.yaml, per-iteration plan metrics, exact resume, layout checks."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import cli_env, require_devices, values_compile

from jvarlen.config import ConfigError, load_config
from jvarlen.layout import resolve_layout
from jvarlen.runtime.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "epp-cpu.yaml")
PLAN_FIELDS = (
    "pieces",
    "documents",
    "chunks",
    "split_documents",
    "bucket",
    "cache_hit",
    "step_seconds",
    "predicted_iteration_time_s",
    "predicted_bubble_ratio",
    "predicted_peak_memory_bytes",
)


def test_cli_trains_an_iteration_with_an_epp_plan_that_splits_documents(tmp_path):
    # the loop over iterations (plans and compiles ahead, checkpoints, resume) is the full_run
    # fixture's, in this process; this is the entry point's path to it
    run_dir = tmp_path / "run"
    env = cli_env(values_only=True)  # no device count: the entry point sets 8 host devices itself
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jvarlen.train",
            "--config",
            CONFIG,
            f"--logging.run_dir={run_dir}",
            "--train.steps=1",
            "--logging.tensorboard=false",
            # pieces of 2,048 tokens: one per pipeline, which its plan splits to fill the pipeline whatever the
            # profile's tick overhead (with one, the config's 1,024-token pieces mostly stay whole)
            "--data.seq_len=2048",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "elastic pipeline: Layout(dp=2, pp=2, sp=2)" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    for r in records:
        assert all(field in r for field in PLAN_FIELDS), sorted(r)
        assert np.isfinite(r["loss"]) and r["real_tokens"] > 0 and (r["dp"], r["pp"], r["sp"]) == (2, 2, 2)
        assert r["chunks"] >= 2 * r["pp"] and r["step_seconds"] > 0 and r["step_time_s"] >= r["step_seconds"]
        assert 1 <= r["documents"] <= r["pieces"]  # pieces of one corpus document count once
        assert 0 < r["predicted_bubble_ratio"] < 1 and r["predicted_iteration_time_s"] > 0
        assert r["predicted_peak_memory_bytes"] > 0
        # every stage ran at least one forward of each of its 2 layers per chunk of both pipelines
        assert all(f >= 2 * r["chunks"] for f in r["layer_forwards"])
    assert records[0]["split_documents"] > 0  # the plan cut long documents into slices
    assert records[0]["compiled"] and records[0]["cache_hit"] is False
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1"]  # the last step's


def test_default_cli_run_on_a_cpu_host_takes_the_elastic_pipeline_path(tmp_path):
    # no parallel settings and no device count in XLA_FLAGS: auto stages give pp = 2 and the entry
    # point gives the host platform the two devices (the default `python -m jvarlen.train`; the
    # suite's other XLA flags stay, as in every CLI test, and the values-only emitters of conftest)
    env = cli_env(values_only=True)
    tiny = [
        "--model.d_model=32",
        "--model.num_layers=2",
        "--model.mlp_dim=64",
        "--model.compute_dtype=float32",
        "--data.seq_len=256",
        "--data.tokens_per_batch=1024",
        "--data.max_documents=40",
        "--train.steps=1",
        "--logging.tensorboard=false",
        f"--logging.run_dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "jvarlen.train", *tiny], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "elastic pipeline: Layout(dp=1, pp=2, sp=1)" in proc.stdout
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert (record["dp"], record["pp"], record["sp"]) == (1, 2, 1) and np.isfinite(record["loss"])


def _config(run_dir, *extra):
    # the session's persistent compilation cache (conftest): the runs of this module share their
    # programs (test_layouts_loop checks parallel.compilation_cache_dir)
    return load_config(
        CONFIG,
        **{
            "logging.run_dir": str(run_dir),
            "logging.tensorboard": "false",
            "logging.progress_bar": "false",
            "train.steps": "4",
            "checkpoint.every_steps": "2",
            "plan.wait": "true",
            # the online cost check (test_steps_log_predicted_vs_measured_time): the planner's cost model
            # is this shipped profile with or without it (the stand-in for the config's shape), so the
            # plans and the training are the same, and the resume test covers a run that refits
            "train.cost_profile": _cost_profile(),
            "train.cost_refit_every": "1",
            **dict(extra),
        },
    )


def _cost_profile() -> str:
    from jvarlen.runtime.cost_check import PACKAGE_PROFILES

    profile = sorted(p for p in os.listdir(PACKAGE_PROFILES) if p.endswith("__cpu__cpu.json"))[0]
    return os.path.join(PACKAGE_PROFILES, profile)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One uninterrupted 4-step run of the config, shared by the tests below: (its result, the
    ``(step, known signatures, key)`` of every ``PipelineStrategy.prepare`` call it made)."""
    require_devices(8)
    from jvarlen.runtime.strategies.pipeline import PipelineStrategy

    calls = []
    prepare = PipelineStrategy.prepare

    def recording(self, iteration, known=()):
        prepared = prepare(self, iteration, known)
        calls.append((iteration.step, list(known), prepared.key))
        return prepared

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PipelineStrategy, "prepare", recording)
        result = train(
            _config(tmp_path_factory.mktemp("pipeline-loop") / "full"), quiet=True, compiler_options=values_compile()
        )
    return result, calls


def test_resume_reproduces_the_uninterrupted_loss_sequence_bitwise(tmp_path, full_run):
    full, _ = full_run
    fast = {"quiet": True, "compiler_options": values_compile()}
    part = train(_config(tmp_path / "part"), stop_after=2, **fast)
    resumed = train(_config(tmp_path / "part", ("checkpoint.resume", "true")), **fast)
    assert len(full.losses) == 4 and resumed.first_step == 2
    assert part.losses + resumed.losses == full.losses  # bitwise on CPU
    for a, b in zip(jax.tree.leaves(full.final_state.params), jax.tree.leaves(resumed.final_state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the resumed run logged the plans of steps 3-4 exactly as the uninterrupted one
    plan = lambda run: [
        (r["step"], r["chunks"], r["split_documents"], r["predicted_iteration_time_s"])
        for r in map(json.loads, open(os.path.join(run, "metrics.jsonl")))
    ]
    assert plan(full.run_dir) == plan(resumed.run_dir)


def test_pipeline_layout_is_checked_with_clear_messages(tmp_path):
    cfg = load_config(CONFIG)
    assert resolve_layout(cfg, 8) == resolve_layout(load_config(CONFIG, **{"parallel.dp": "2"}), 8)
    with pytest.raises(ConfigError, match="uses 8 devices, but there are 16"):
        resolve_layout(cfg, 16)
    with pytest.raises(ConfigError, match="must divide the 6 devices"):
        resolve_layout(cfg, 6)
    with pytest.raises(ConfigError, match="rows must be divisible by dp = 2"):
        resolve_layout(load_config(CONFIG, **{"data.tokens_per_batch": "3072"}), 8)
    require_devices(8)
    with pytest.raises(ConfigError, match="unknown residual policy 'bogus'"):
        train(
            load_config(CONFIG, **{"parallel.residual_policy": "bogus", "logging.run_dir": str(tmp_path / "run")}),
            quiet=True,
        )
    with pytest.raises(ConfigError, match="num_layers \\(4\\) must be divisible by parallel.pp \\(3\\)"):
        resolve_layout(load_config(CONFIG, **{"parallel.pp": "3", "parallel.dp": "1", "parallel.sp": "1"}), 3)
    with pytest.raises(ConfigError, match="fixed \\(dp, pp, sp\\)"):
        resolve_layout(load_config(CONFIG, **{"parallel.sp_cycle": "[1,2]"}), 8)


def test_steps_log_predicted_vs_measured_time(full_run):
    """The online cost check of the pipeline path: every step that did not compile logs the slowest
    plan's lock-step prediction next to the measured pipeline time (refitting after every step
    must not break the loop; the refit itself is tested in test_cost_check)."""
    full, _ = full_run
    records = [json.loads(line) for line in open(os.path.join(full.run_dir, "metrics.jsonl"))]
    observed = [r for r in records if not r["compiled"] and not r["beside_compile"]]
    assert observed, [(r["compiled"], r["beside_compile"]) for r in records]
    # a step that compiled, or ran beside the next signature's compile, is not the step's own time
    assert all("predicted_step_s" not in r for r in records if r["compiled"] or r["beside_compile"])
    for r in observed:
        assert r["predicted_step_s"] > 0 and r["pipeline_s"] > 0
        assert r["cost_error"] == pytest.approx(abs(r["predicted_step_s"] - r["pipeline_s"]) / r["pipeline_s"])


def test_a_step_may_reuse_only_the_signatures_of_the_steps_before_it(full_run):
    """Which compiled step an iteration runs must not depend on timing, or two processes of one run
    would run different programs in one collective: a step may reuse the signatures of the steps
    run before it, and the background compile of the next iteration sees those and the current
    step's, never what another compile has reached (the cache's keys did)."""
    _, calls = full_run
    steps = sorted({step for step, _, _ in calls})
    assert steps == list(range(4))
    main = {step: (known, key) for step, known, key in calls}  # a step's last prepare is its own
    ahead = [
        (step, known) for n, (step, known, _) in enumerate(calls) if n + 1 < len(calls) and calls[n + 1][0] == step
    ]
    for step in steps:
        assert main[step][0] == list(dict.fromkeys(main[s][1] for s in range(step))), step
    for step, known in ahead:  # the background compile of the next iteration, prepared during step - 1
        assert known == [*dict.fromkeys(main[s][1] for s in range(step - 1)), main[step - 1][1]], step
