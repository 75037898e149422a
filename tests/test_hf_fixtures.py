"""jvarlen against transformers' own numbers: tiny Llama (llama3 RoPE, untied) and Qwen2 (q/k/v
biases, linear RoPE, tied) saved by transformers (scripts/make_hf_fixtures.py), imported by
jvarlen.hf, and their documents run packed in one row must give transformers' logits and loss
computed one document at a time. Plus the config mapping, its refusals and the block reads."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
from hf_helpers import fixture, forward, imported_params, model_config, packed_row, reference

from jvarlen.config import ConfigError, ModelConfig, RopeScalingConfig
from jvarlen.hf import HFCheckpointError
from jvarlen.hf.hf_config import model_fields
from jvarlen.hf.weights import TensorMap, tensor_maps


@pytest.mark.parametrize("name, attention", [("tiny-llama", "auto"), ("tiny-qwen2", "reference")])
def test_logits_and_loss_match_transformers(name, attention):
    """Llama through the attention training uses on this backend, Qwen2 through the dense reference."""
    ref = reference(name)
    cfg = model_config(fixture(name), attention=attention)
    graphdef, params = imported_params(fixture(name), cfg)
    logits, sums = forward(graphdef, params, packed_row(ref))
    # f32 on both sides: relative 1e-4, with 1e-5 absolute for the logits that cross zero
    np.testing.assert_allclose(logits, ref["logits"], rtol=1e-4, atol=1e-5)
    assert sums["target_tokens"] == ref["target_count"].sum()
    assert sums["loss_sum"] / sums["target_tokens"] == pytest.approx(float(ref["loss"]), rel=1e-5)
    # per document: transformers' own mean loss (labels=input_ids), each document alone
    log_z = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    nll = log_z - np.take_along_axis(logits, packed_row(ref)["targets"][0][:, None], -1)[:, 0]
    for i, (a, b) in enumerate(zip(ref["offsets"][:-1], ref["offsets"][1:])):
        assert nll[a : b - 1].mean() == pytest.approx(ref["hf_loss"][i], rel=1e-5)


def test_model_fields_come_from_config_json():
    llama, qwen = model_config(fixture("tiny-llama")), model_config(fixture("tiny-qwen2"))
    assert (llama.vocab_size, llama.d_model, llama.num_layers, llama.num_heads, llama.num_kv_heads) == (
        384,
        64,
        2,
        4,
        2,
    )
    assert (llama.head_dim, llama.mlp_dim, llama.norm_eps, llama.tie_embeddings, llama.qkv_bias) == (
        16,
        128,
        1e-5,
        False,
        False,
    )
    assert llama.rope_scaling == RopeScalingConfig("llama3", 8.0, 1.0, 4.0, 64)
    assert (qwen.tie_embeddings, qwen.qkv_bias, qwen.rope_theta, qwen.mlp_dim) == (True, True, 1e6, 160)
    assert qwen.rope_scaling.rope_type == "linear" and qwen.rope_scaling.factor == 2.0
    assert set(llama.from_checkpoint) >= {"vocab_size", "d_model", "rope_scaling", "qkv_bias"}
    assert "rope_theta=10000.0" in llama.describe_checkpoint_fields()


def test_a_pretrained_model_with_the_byte_tokenizer_is_refused(tmp_path):
    """Byte ids (and BOS 256 / EOS 257) mean other tokens to a pretrained model: a training run from
    init_from needs the tokenizer it was trained with, and the message names the one beside it
    (before the run directory is touched)."""
    from jvarlen.config import parse_config
    from jvarlen.runtime.run import open_run

    run_dir = tmp_path / "run"
    args = [f"--model.init_from={fixture('tiny-llama')}", f"--logging.run_dir={run_dir}"]
    with pytest.raises(ConfigError, match=r"data.tokenizer=byte .*--data.tokenizer=.*tiny-llama/tokenizer.json"):
        open_run(parse_config(args), quiet=True, stop_after=None)
    assert not run_dir.exists()


def test_a_pretrained_model_needs_its_tokenizers_document_boundaries(tmp_path):
    """A tokenizer.json whose BOS/EOS jvarlen cannot find by name (DeepSeek-style names) would mark
    documents with ids past its vocabulary, untrained rows of the model's padded embedding: refused
    with init_from, before the run directory is touched. A tokenizer_config.json beside it naming
    them (as Hugging Face saves one) gives the model's own ids."""
    import shutil

    from jvarlen.config import parse_config
    from jvarlen.data import load_tokenizer
    from jvarlen.runtime.run import open_run

    model = tmp_path / "model"
    shutil.copytree(fixture("tiny-llama"), model)
    text = (model / "tokenizer.json").read_text().replace('"<s>"', '"<|b|>"').replace('"</s>"', '"<|e|>"')
    (model / "tokenizer.json").write_text(text)
    args = [f"--model.init_from={model}", f"--data.tokenizer={model / 'tokenizer.json'}"]
    with pytest.raises(ConfigError, match=r"names no BOS and no EOS token .*untrained rows"):
        open_run(parse_config([*args, f"--logging.run_dir={tmp_path / 'run'}"]), quiet=True, stop_after=None)
    assert not (tmp_path / "run").exists()
    before = load_tokenizer(str(model / "tokenizer.json"))
    assert (before.bos_id, before.eos_id) == (384, 385)  # past the 384-token vocabulary
    (model / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|b|>", "eos_token": {"content": "<|e|>"}}))
    declared = load_tokenizer(str(model / "tokenizer.json"))
    assert (declared.bos_id, declared.eos_id, declared.appended) == (1, 2, [])
    assert declared.identity != before.identity  # other ids: another corpus cache


def test_rope_overrides_and_conflicts(tmp_path):
    extended = model_config(fixture("tiny-llama"), rope_theta=500_000.0)
    assert extended.rope_theta == 500_000.0 and "rope_theta" not in extended.from_checkpoint
    assert "rope_theta=500000.0 overrides the checkpoint's 10000.0" in extended.describe_checkpoint_fields()
    scaled = model_config(fixture("tiny-qwen2"), rope_scaling=RopeScalingConfig("llama3", 4.0, 1.0, 4.0, 512))
    assert scaled.rope_scaling.rope_type == "llama3"
    with pytest.raises(ConfigError, match=r"model.d_model=32 \(the checkpoint has 64\)"):
        model_config(fixture("tiny-llama"), d_model=32)
    with pytest.raises(ConfigError, match="model.init_from: '/no/such/model' is not a directory"):
        ModelConfig(init_from="/no/such/model")
    (tmp_path / "config.json").write_text(json.dumps(_config(architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ConfigError, match="architecture 'GPT2LMHeadModel'"):
        ModelConfig(init_from=str(tmp_path))


def test_a_field_named_at_its_default_value_is_the_users(tmp_path):
    """A model field a command line (or config file) names counts as set even at its default value:
    against a checkpoint's other value it is a conflict, or for rope_theta an override (before: the
    checkpoint's value replaced it without a word, as for a field left unset)."""
    from jvarlen.config import parse_config

    llama = fixture("tiny-llama")  # 2 layers, untied: the defaults are 4 and tied
    assert parse_config([f"--model.init_from={llama}"]).model.num_layers == 2  # unset: the checkpoint's
    with pytest.raises(ConfigError, match=r"model.num_layers=4 \(the checkpoint has 2\)"):
        parse_config([f"--model.init_from={llama}", "--model.num_layers=4"])
    (tmp_path / "run.yaml").write_text(f"model:\n  init_from: {llama}\n  tie_embeddings: true\n")
    with pytest.raises(ConfigError, match=r"model.tie_embeddings=True \(the checkpoint has False\)"):
        parse_config(["--config", str(tmp_path / "run.yaml")])
    rope = {**_config()["rope_parameters"], "rope_theta": 500_000.0}
    (tmp_path / "config.json").write_text(json.dumps(_config(rope_parameters=rope)))
    assert parse_config([f"--model.init_from={tmp_path}"]).model.rope_theta == 500_000.0
    back = parse_config([f"--model.init_from={tmp_path}", "--model.rope_theta=10000"]).model
    assert back.rope_theta == 10_000.0 and "overrides the checkpoint's 500000.0" in back.describe_checkpoint_fields()
    # a field of the checkpoint's scaling named: its other fields stay the checkpoint's (before, the
    # defaults': tiny-qwen2's linear rule became llama3, tiny-llama's band its 8192-token default)
    qwen = parse_config([f"--model.init_from={fixture('tiny-qwen2')}", "--model.rope_scaling.factor=4"]).model
    assert (qwen.rope_scaling.rope_type, qwen.rope_scaling.factor) == ("linear", 4.0)
    (tmp_path / "long.yaml").write_text(f"model:\n  init_from: {llama}\n  rope_scaling:\n    factor: 16\n")
    scaling = parse_config(["--config", str(tmp_path / "long.yaml")]).model.rope_scaling
    assert (scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings) == ("llama3", 16.0, 64)


def test_a_new_llama3_scaling_is_placed_by_the_bases_own_length(tmp_path):
    """A llama3 scaling named over a base without one takes the base's max_position_embeddings as
    its original length unless that is named too (before: the default 8192, Llama 3's, whatever the
    base was trained on: the band of frequencies it rescales was placed for another model)."""
    from jvarlen.config import parse_config

    (tmp_path / "config.json").write_text(json.dumps(_config(rope_parameters={"rope_theta": 10_000.0})))
    flags = [f"--model.init_from={tmp_path}", "--model.rope_scaling.rope_type=llama3", "--model.rope_scaling.factor=4"]
    model = parse_config(flags).model
    assert (model.rope_scaling.factor, model.rope_scaling.original_max_position_embeddings) == (4.0, 512)
    assert "rope_scaling.original_max_position_embeddings=512" in model.describe_checkpoint_fields()
    named = parse_config([*flags, "--model.rope_scaling.original_max_position_embeddings=256"]).model
    assert named.rope_scaling.original_max_position_embeddings == 256
    linear = parse_config([*flags[:1], "--model.rope_scaling.rope_type=linear", "--model.rope_scaling.factor=4"])
    assert linear.model.rope_scaling.rope_type == "linear"  # the rule has no original length


def test_init_from_is_recorded_absolute(monkeypatch):
    """A relative model.init_from is made absolute when parsed: checkpoints record it, and an
    export run from another directory reads the model's config.json (token ids, context length)
    and refuses to write into it (before: "is gone", default ids, and the base could be replaced)."""
    from jvarlen.config import parse_config

    monkeypatch.chdir(os.path.dirname(fixture("tiny-llama")))
    assert parse_config(["--model.init_from=tiny-llama"]).model.init_from == fixture("tiny-llama")


def _config(**changes) -> dict:
    with open(f"{fixture('tiny-llama')}/config.json") as f:
        hf = json.load(f)
    hf.update(changes)
    return hf


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "architecture 'GPT2LMHeadModel'"),
        (dict(architectures=["MixtralForCausalLM"]), "architecture 'MixtralForCausalLM'"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rule 'yarn'"),
        (dict(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}), "rule 'dynamic'"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096), "sliding_window=4096"),
        (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True), "use_sliding_window"),
        (
            dict(architectures=["MistralForCausalLM"], model_type="mistral"),
            r"sliding_window=4096 \(the default of an absent key\)",
        ),
        # transformers builds the model by model_type: a Mistral (with its window) under a Llama's name
        (dict(model_type="mistral", sliding_window=8), "names LlamaForCausalLM but model_type is 'mistral'"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
        (dict(rope_parameters={"factor": 4.0, "rope_theta": 1e4}), "factor 4.0 names no rule"),
        (dict(num_attention_heads=None), "num_attention_heads|wrong type"),
    ],
)
def test_unsupported_checkpoints_are_refused_by_name(changes, message):
    with pytest.raises(HFCheckpointError, match=message):
        model_fields(_config(**changes))


def test_legacy_rope_spelling_and_mistral_without_window():
    legacy = _config(rope_parameters=None, rope_theta=5e5, rope_scaling={"type": "linear", "factor": 4.0})
    fields = model_fields(legacy)
    assert fields["rope_theta"] == 5e5 and fields["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    mistral = _config(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    assert model_fields(mistral)["qkv_bias"] is False


def test_weights_that_do_not_match_config_json_are_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = tmp_path / "model"
    shutil.copytree(fixture("tiny-llama"), directory)
    tensors = load_file(directory / "model.safetensors")
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int8)
    save_file(tensors, directory / "model.safetensors")
    cfg = model_config(str(directory))
    with pytest.raises(HFCheckpointError) as error:
        imported_params(str(directory), cfg)
    assert "missing 1 tensors (model.layers.1.mlp.up_proj.weight)" in str(error.value)
    assert "k_proj.weight: (16, 64) (expected (32, 64))" in str(error.value)
    assert "no parameter for (model.layers.0.self_attn.o_proj.bias)" in str(error.value)
    assert "not floating point (F64, F32, BF16, F16): model.norm.weight: I8" in str(error.value)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_block_reads_equal_slices_of_the_whole_tensor(qkv_bias):
    """TensorMap.read of any block (rank-coded values, every dimension sliced) equals the block of
    the whole converted tensor, and to_hf inverts to_jvarlen."""
    cfg = ModelConfig(
        vocab_size=24,
        d_model=12,
        num_heads=4,
        num_kv_heads=2,
        head_dim=6,
        mlp_dim=20,
        qkv_bias=qkv_bias,
        tie_embeddings=False,
    )
    rng = np.random.default_rng(0)
    for m in tensor_maps(cfg):
        assert isinstance(m, TensorMap)
        hf = np.arange(np.prod(m.hf_shape), dtype=np.float32).reshape(m.hf_shape)
        whole = m.to_jvarlen(hf)
        assert whole.shape == m.shape
        np.testing.assert_array_equal(m.to_hf(whole), hf)
        sizes = []

        def read(name, index, hf=hf, sizes=sizes):
            sizes.append(hf[index].size)
            return hf[index]

        for _ in range(5):
            index = []
            for n in m.shape:
                a = int(rng.integers(0, n))
                index.append(slice(a, int(rng.integers(a + 1, n + 1))))
            np.testing.assert_array_equal(m.read(read, None, tuple(index)), whole[tuple(index)])
        np.testing.assert_array_equal(m.read(read, None, tuple(slice(None) for _ in m.shape)), whole)
        assert sizes[-1] == hf.size
        # one slice of the first dimension (an FSDP shard) reads exactly that share of the tensor
        m.read(read, None, (slice(0, 1),) + tuple(slice(None) for _ in m.shape[1:]))
        assert sizes[-1] * m.shape[0] == hf.size


def test_research_session_starts_from_the_checkpoint():
    from jvarlen.api import Session
    from jvarlen.config import Config

    cfg = model_config(fixture("tiny-qwen2"))
    session = Session.from_config(Config(model=cfg))
    _, params = imported_params(fixture("tiny-qwen2"), cfg)
    for a, b in zip(jax.tree.leaves(session.state.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding
    assert int(session.state.step) == 0
    assert all(not np.asarray(m).any() for m in jax.tree.leaves(session.state.opt_state) if np.ndim(m) > 0)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_packed_row_is_the_fixture_documents_back_to_back(name):
    """The row the logits test compares with transformers: each document's tokens in order, its own
    segment, positions from 0, and exactly len - 1 targets per document (none across a boundary)."""
    ref = reference(name)
    row = {k: v[0] for k, v in packed_row(ref).items()}
    offsets = ref["offsets"]
    np.testing.assert_array_equal(row["tokens"], ref["tokens"])
    for d, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        assert (row["segment_ids"][a:b] == d + 1).all()
        np.testing.assert_array_equal(row["positions"][a:b], np.arange(b - a))
        np.testing.assert_array_equal(row["targets"][a : b - 1], ref["tokens"][a + 1 : b])
        assert row["loss_mask"][a : b - 1].all() and row["loss_mask"][b - 1] == 0
    assert row["loss_mask"].sum() == len(ref["tokens"]) - (len(offsets) - 1)
