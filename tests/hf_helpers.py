"""Shared by the tests of jvarlen.hf: the transformers fixtures (scripts/make_hf_fixtures.py) and
jvarlen's forward pass over their documents packed into one row."""

from __future__ import annotations

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvarlen.config import ModelConfig
from jvarlen.hf.load import load_params
from jvarlen.model import AttentionInputs, abstract_model, cross_entropy_sums
from jvarlen.parallel.layouts import state_mesh
from jvarlen.parallel.sharding import param_shardings

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
MODELS = ("tiny-llama", "tiny-qwen2")


def fixture(name: str) -> str:
    return os.fspath(FIXTURES / name)


def reference(name: str) -> dict:
    with np.load(FIXTURES / name / "reference.npz") as f:
        return {k: f[k] for k in f.files}


def model_config(directory: str, **overrides) -> ModelConfig:
    return ModelConfig(init_from=directory, compute_dtype="float32", **overrides)


def imported_params(directory: str, cfg: ModelConfig):
    """(graphdef, params) of ``directory``, streamed into the canonical sharding over all devices."""
    graphdef, abstract = nnx.split(abstract_model(cfg), nnx.Param)
    return graphdef, load_params(directory, cfg, abstract, param_shardings(abstract, state_mesh()))


def packed_row(ref: dict) -> dict:
    """The reference's documents back to back in one row: segment ids 1, 2, 3, positions restarting."""
    offsets = ref["offsets"]
    lengths = np.diff(offsets)
    segment_ids = np.repeat(np.arange(1, len(lengths) + 1), lengths).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    tokens = ref["tokens"].astype(np.int32)
    targets = np.concatenate([tokens[1:], [0]]).astype(np.int32)
    loss_mask = np.ones_like(tokens, dtype=np.float32)
    loss_mask[offsets[1:] - 1] = 0.0  # a document's last token has no target in it
    return {
        k: v[None]
        for k, v in dict(
            tokens=tokens, segment_ids=segment_ids, positions=positions, targets=targets, loss_mask=loss_mask
        ).items()
    }


def forward(graphdef, params, row: dict) -> tuple[np.ndarray, dict]:
    """(logits [T, V], loss sums) of jvarlen's model on one packed row (f32, highest precision)."""

    @jax.jit
    def run(params, row):
        model = nnx.merge(graphdef, params)
        logits = model(row["tokens"], AttentionInputs(row["segment_ids"], row["positions"]))
        return logits, cross_entropy_sums(logits, row["targets"], row["loss_mask"])

    with jax.default_matmul_precision("highest"):
        logits, sums = run(params, {k: jnp.asarray(v) for k, v in row.items()})
    return np.asarray(logits)[0], jax.tree.map(float, sums)
