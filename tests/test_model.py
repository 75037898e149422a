"""The decoder on packed documents equals the decoder on each document alone."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import values_compile
from flax import nnx

from jvarlen.config import CONFIG_DIR, ModelConfig, load_config
from jvarlen.model import AttentionInputs, abstract_model, build_model, parameter_count
from jvarlen.runtime.step import loss_sums

TINY = dict(
    vocab_size=64,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_dim=64,
    compute_dtype="float32",
    attention="reference",
)


def pack_rows(docs, rows, seq_len):
    """Independent test packer: fills rows left to right, documents in order; returns batch dict."""
    batch = {k: np.zeros((rows, seq_len), np.int32) for k in ("tokens", "segment_ids", "positions", "targets")}
    batch["loss_mask"] = np.zeros((rows, seq_len), np.float32)
    row, col, seg = 0, 0, 0
    for doc in docs:
        if col + len(doc) > seq_len:
            row, col, seg = row + 1, 0, 0
        seg += 1
        sl = slice(col, col + len(doc))
        batch["tokens"][row, sl] = doc
        batch["segment_ids"][row, sl] = seg
        batch["positions"][row, sl] = np.arange(len(doc))
        batch["targets"][row, col : col + len(doc) - 1] = doc[1:]
        batch["loss_mask"][row, col : col + len(doc) - 1] = 1.0
        col += len(doc)
    return {k: jnp.asarray(v) for k, v in batch.items()}


def assert_close_to_scale(got, want, rtol):
    """max |got - want| <= rtol * max |want|: fp32 summation order differs between a packed
    row and a document alone, so near-zero elements carry absolute, not relative, noise."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err, scale = np.max(np.abs(got - want)), np.max(np.abs(want))
    assert err <= rtol * scale, f"max error {err:.3e} > {rtol} x scale {scale:.3e}"


def _model(**overrides):
    model = build_model(ModelConfig(**{**TINY, **overrides}), seed=1)
    return nnx.split(model, nnx.Param)


@pytest.mark.parametrize(
    "lengths,attention",
    [([5, 11, 16], "xla"), ([16, 16], "reference"), ([3, 7, 1, 9, 4], "reference"), ([2], "reference")],
)
def test_packed_loss_and_grads_equal_documents_alone(lengths, attention):
    """Documents ending exactly at a row boundary, one-token documents, padding."""
    rng = np.random.default_rng(sum(lengths))
    docs = [rng.integers(0, 64, n).astype(np.int32) for n in lengths]
    graphdef, params = _model(attention=attention)
    packed = pack_rows(docs, rows=2, seq_len=16)

    @functools.partial(jax.jit, compiler_options=values_compile())
    def loss_and_grads(p, batch):
        def mean_loss(p):
            sums = loss_sums(graphdef, p, batch)
            return sums["loss_sum"] / sums["target_tokens"], sums["target_tokens"]

        return jax.value_and_grad(mean_loss, has_aux=True)(p)

    (packed_loss, _), packed_grads = loss_and_grads(params, packed)

    weighted_loss, weighted_grads, total = 0.0, None, 0.0
    for doc in docs:
        if len(doc) < 2:
            continue  # no target inside a one-token document
        # Alone in a row of its own (padding after it): one compiled shape for every document.
        alone = pack_rows([doc], rows=1, seq_len=16)
        (loss, n), grads = loss_and_grads(params, alone)
        weighted_loss += loss * n
        scaled = jax.tree.map(lambda g, n=n: g * n, grads)
        weighted_grads = scaled if weighted_grads is None else jax.tree.map(jnp.add, weighted_grads, scaled)
        total += n
    np.testing.assert_allclose(packed_loss, weighted_loss / total, rtol=1e-5)
    wants = [np.asarray(w, np.float64) / total for w in jax.tree.leaves(weighted_grads)]
    # A leaf whose gradient is 0 (here: wq, wk of one document with one target, which attends to
    # itself alone) is fp32 rounding noise on both sides: it must stay at the resolution of the
    # gradient's scale, not match the other side's noise.
    resolution = 1e-6 * max(np.max(np.abs(w)) for w in wants)
    for got, want in zip(jax.tree.leaves(packed_grads), wants):
        if np.max(np.abs(want)) <= resolution:
            assert np.max(np.abs(np.asarray(got))) <= resolution
        else:
            assert_close_to_scale(got, want, rtol=1e-5)


def test_no_attention_across_documents():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 64, n).astype(np.int32) for n in (6, 5, 5)]
    graphdef, params = _model()
    model = nnx.merge(graphdef, params)
    batch = pack_rows(docs, rows=1, seq_len=16)
    inputs = AttentionInputs(batch["segment_ids"], batch["positions"])
    logits = nnx.jit(lambda m, t: m(t, inputs))(model, batch["tokens"])
    perturbed = batch["tokens"].at[0, 6:11].set((batch["tokens"][0, 6:11] + 7) % 64)  # document 2
    logits2 = nnx.jit(lambda m, t: m(t, inputs))(model, perturbed)
    np.testing.assert_array_equal(logits[0, :6], logits2[0, :6])
    np.testing.assert_array_equal(logits[0, 11:], logits2[0, 11:])
    assert not np.allclose(logits[0, 6:11], logits2[0, 6:11])


def test_positions_restart_per_document():
    """A document placed mid-row gives the same logits as at the start of a row."""
    rng = np.random.default_rng(1)
    doc = rng.integers(0, 64, 7).astype(np.int32)
    filler = rng.integers(0, 64, 9).astype(np.int32)
    graphdef, params = _model()
    model = nnx.merge(graphdef, params)
    first = pack_rows([doc, filler], rows=1, seq_len=16)
    second = pack_rows([filler, doc], rows=1, seq_len=16)
    out1 = model(first["tokens"], AttentionInputs(first["segment_ids"], first["positions"]))
    out2 = model(second["tokens"], AttentionInputs(second["segment_ids"], second["positions"]))
    assert_close_to_scale(out1[0, :7], out2[0, 9:], rtol=1e-5)


def test_untied_head_and_remat_do_not_change_the_loss():
    rng = np.random.default_rng(2)
    batch = pack_rows([rng.integers(0, 64, 10).astype(np.int32)], rows=1, seq_len=16)
    for overrides in ({"tie_embeddings": False}, {}):
        graphdef, params = _model(**overrides)
        plain = loss_sums(graphdef, params, batch)["loss_sum"]
        graphdef_r, params_r = _model(**overrides, remat=True)
        np.testing.assert_allclose(loss_sums(graphdef_r, params_r, batch)["loss_sum"], plain, rtol=1e-6)


def test_residual_policy_keeps_less_and_changes_no_gradient():
    """A layer that is not rematerialised keeps what ``parallel.residual_policy`` names (default:
    matmul and attention outputs; the elementwise rest is recomputed in the backward): the same
    loss and gradients as plain autodiff, and fewer bytes live in the compiled step."""
    from jvarlen.runtime.step import loss_and_grads

    cfg = dict(TINY, d_model=64, mlp_dim=256, attention="xla")
    graphdef, params = _model(**cfg)
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 64, n).astype(np.int32) for n in (70, 50, 100)]
    batch = pack_rows(docs, rows=2, seq_len=128)
    runs = {}
    for residual in (None, "dots_and_attention"):
        step = jax.jit(functools.partial(loss_and_grads, graphdef, residual=residual))
        compiled = step.lower(params, batch).compile()
        runs[residual] = (compiled.memory_analysis().temp_size_in_bytes, *compiled(params, batch))
    (plain_temp, plain_sums, plain_grads), (temp, sums, grads) = runs[None], runs["dots_and_attention"]
    np.testing.assert_allclose(sums["loss_sum"], plain_sums["loss_sum"], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, plain_grads)
    assert temp < plain_temp, (temp, plain_temp)


@pytest.mark.parametrize("name,expected", [("llama-7b", 6_738_415_616), ("llama-13b", 13_015_864_320)])
def test_llama_parameter_counts_by_eval_shape(name, expected):
    config = load_config(CONFIG_DIR / f"{name}.yaml")
    model = abstract_model(config.model)
    assert parameter_count(model) == expected
    leaf = jax.tree.leaves(nnx.state(model, nnx.Param))[0]
    assert isinstance(leaf, jax.ShapeDtypeStruct)  # nothing was allocated
