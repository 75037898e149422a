"""Export -> import is bitwise: jvarlen parameters written as a Hugging Face directory (one file,
or shards with their index) and read back by jvarlen.hf give the same arrays (float32), or the
arrays rounded once to the export dtype (bfloat16)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_helpers import fixture, imported_params, model_config

from jvarlen.config import ModelConfig
from jvarlen.hf.export import write_hf
from jvarlen.hf.safetensors_dir import INDEX
from jvarlen.hf.weights import hf_tensor_names


def _perturbed(params, seed: int):
    """The fixture's parameters plus noise (same shardings), so that nothing equals its initial value
    by chance."""
    rng = np.random.default_rng(seed)

    def move(x):
        noisy = np.asarray(x) + np.float32(0.01) * rng.standard_normal(x.shape, dtype=np.float32)
        return jax.device_put(noisy, x.sharding)

    return jax.tree.map(move, params)


def _plain(cfg: ModelConfig) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, init_from=None)


@pytest.mark.parametrize("name, shard_bytes", [("tiny-llama", 5 << 30), ("tiny-qwen2", 100_000)])
def test_export_then_import_is_bitwise(tmp_path, name, shard_bytes):
    cfg = model_config(fixture(name))
    _, params = imported_params(fixture(name), cfg)
    params = _perturbed(params, seed=3)
    out = tmp_path / "export"
    files = write_hf(
        params,
        _plain(cfg),
        str(out),
        "float32",
        tokenizer=f"{fixture(name)}/tokenizer.json",
        max_shard_bytes=shard_bytes,
    )
    if shard_bytes < 5 << 30:  # several files and the index naming every tensor
        assert len([f for f in files if f.endswith(".safetensors")]) > 1
        with open(out / INDEX) as f:
            assert sorted(json.load(f)["weight_map"]) == sorted(hf_tensor_names(cfg))
    else:
        assert "model.safetensors" in files and not os.path.exists(out / INDEX)
    again = model_config(str(out))
    assert {k: getattr(again, k) for k in again.from_checkpoint} == {k: getattr(cfg, k) for k in again.from_checkpoint}
    _, back = imported_params(str(out), again)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding


def test_bfloat16_export_rounds_once(tmp_path):
    cfg = model_config(fixture("tiny-llama"))
    _, params = imported_params(fixture("tiny-llama"), cfg)
    params = _perturbed(params, seed=4)
    write_hf(params, _plain(cfg), str(tmp_path), "bfloat16")
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    _, back = imported_params(str(tmp_path), model_config(str(tmp_path)))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert b.dtype == jnp.float32  # the run's parameter dtype, whatever the file's
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32)), np.asarray(b))
