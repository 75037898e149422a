"""The training loop with a layout per iteration: logged layouts, step cache, resume across layouts."""

import json

import jax
import numpy as np
import pytest
from conftest import values_compile
from tiny_flags import REFERENCE_ATTENTION, TINY_MODEL_ARGS

from jvarlen.config import parse_config
from jvarlen.runtime.loop import train

TINY_ARGS = [
    *TINY_MODEL_ARGS,
    REFERENCE_ATTENTION,
    "--data.seq_len=128",
    "--data.tokens_per_batch=1024",
    "--data.max_documents=60",
    "--logging.tensorboard=false",
    "--logging.progress_bar=false",
    "--parallel.pp=1",
    "--train.steps=4",
    "--checkpoint.every_steps=2",
]


@pytest.fixture(autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")


def test_resume_across_layout_change(tmp_path):
    cache = tmp_path / "corpus"
    xla_cache = tmp_path / "xla"

    def config(run, *extra):
        return parse_config(
            [
                *TINY_ARGS,
                f"--logging.run_dir={tmp_path / run}",
                f"--data.cache_dir={cache}",
                f"--parallel.compilation_cache_dir={xla_cache}",
                *extra,
            ]
        )

    fast = {"quiet": True, "compiler_options": values_compile()}
    full = train(config("full", "--parallel.sp_cycle=[1,2]"), **fast)
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["dp"], r["sp"]) for r in records] == [(8, 1), (4, 2), (8, 1), (4, 2)]  # layout logged per step
    assert [r["step_cache_misses"] for r in records] == [1, 2, 2, 2]
    assert [r["step_cache_hits"] for r in records] == [0, 0, 1, 2]
    assert records[0]["compile_s"] > 0 and records[2]["compile_s"] == 0
    assert any(xla_cache.iterdir())  # the persistent compilation cache was written

    part = train(config("part", "--parallel.sp_cycle=[1,2]"), stop_after=2, **fast)
    # the checkpoint of step 2 (written under sp=2) continues under a fixed sp=4 layout
    resumed = train(config("part", "--parallel.sp=4", "--checkpoint.resume=true"), **fast)
    assert resumed.first_step == 2
    np.testing.assert_array_equal(part.losses, full.losses[:2])
    np.testing.assert_allclose(resumed.losses, full.losses[2:], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(full.final_state.params), jax.tree.leaves(resumed.final_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    resumed_records = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["sp"]) for r in resumed_records] == [(1, 1), (2, 2), (3, 4), (4, 4)]


def test_budget_policy_in_the_loop(tmp_path):
    # two rows of 512 tokens on 8 devices: sp=1 holds a whole row (512 tokens) per device,
    # sp=2 256, sp=4 128 -> the policy picks (dp=2, sp=4) for a budget of 128 tokens.
    config = parse_config(
        [
            *TINY_ARGS,
            f"--logging.run_dir={tmp_path / 'b'}",
            f"--data.cache_dir={tmp_path / 'c'}",
            "--data.seq_len=512",
            "--train.steps=1",
            "--parallel.tokens_per_device=128",
        ]
    )
    result = train(config, quiet=True, compiler_options=values_compile())
    record = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])
    assert (record["dp"], record["sp"]) == (2, 4)
    assert np.isfinite(result.losses[0]) and record["real_tokens"] > 0
