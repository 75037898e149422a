"""Export -> import is bitwise: jvarlen parameters written as a Hugging Face directory (one file,
or shards with their index) and read back by jvarlen.hf give the same arrays (float32), or the
arrays rounded once to the export dtype (bfloat16)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_helpers import fixture, imported_params, model_config

from jvarlen.config import ModelConfig
from jvarlen.hf import HFCheckpointError
from jvarlen.hf.export import ExportConfig, export_run, restore_params, write_hf
from jvarlen.hf.hf_config import hf_config_dict, read_hf_config
from jvarlen.hf.safetensors_dir import INDEX, SafetensorsDir
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


def _saved_run(tmp_path, name: str = "tiny-llama"):
    """A run directory whose checkpoint 7 holds perturbed fixture weights, started from a copy of the
    fixture (``tmp_path / "base"``): (run directory, base directory, its parameters)."""
    from jvarlen.config import CheckpointConfig
    from jvarlen.runtime.checkpoint import Checkpointer

    base = tmp_path / "base"
    shutil.copytree(fixture(name), base)
    cfg = model_config(str(base))
    _, params = imported_params(str(base), cfg)
    params = _perturbed(params, seed=5)
    checkpointer = Checkpointer(
        tmp_path / "run" / "checkpoints", CheckpointConfig(async_save=False), say=lambda _: None
    )
    checkpointer.save(7, {"params": params}, {}, cfg)
    checkpointer.manager.wait_until_finished()
    checkpointer.manager.close()
    return tmp_path / "run", base, params


def _export(run, out, **kw):
    return export_run(ExportConfig(run_dir=str(run), out_dir=str(out), dtype="float32", **kw), say=lambda _: None)


def test_export_never_leaves_stale_weights_or_overwrites_a_model(tmp_path):
    run, base, params = _saved_run(tmp_path)
    out = tmp_path / "hf"
    _export(run, out, max_shard_gb=2e-5)  # ~21 KB shards: several files plus the index
    sharded = sorted(os.listdir(out))
    umask = os.umask(0)
    os.umask(umask)  # readable as the umask allows (before: the directory 0700, the weights 0600)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask
    assert {os.stat(out / f).st_mode & 0o777 for f in sharded} == {0o666 & ~umask}
    assert INDEX in sharded and len([f for f in sharded if f.endswith(".safetensors")]) > 1
    with pytest.raises(ValueError, match="already holds a model"):
        _export(run, out)
    assert sorted(os.listdir(out)) == sharded
    # replaced by one file: no shard or index of the earlier export is left to be read
    _export(run, out, overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    _, back = imported_params(str(out), model_config(str(out)))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the pretrained model, the run directory, a missing tokenizer: refused before anything is written
    before = {f: (base / f).read_bytes() for f in os.listdir(base)}
    with pytest.raises(ValueError, match="is the run's model.init_from"):
        _export(run, base, overwrite=True)
    assert {f: (base / f).read_bytes() for f in os.listdir(base)} == before
    with pytest.raises(ValueError, match="is the run directory"):
        _export(run, run, overwrite=True)
    with pytest.raises(FileNotFoundError, match="is not a file"):
        _export(run, tmp_path / "hf2", tokenizer=str(tmp_path / "no-tokenizer.json"))
    assert not (tmp_path / "hf2").exists()
    assert [p for p in os.listdir(tmp_path) if "partial" in p] == []  # no staging directory left
    # a tensor in two files and no index: refused, not the last file's copy read
    (out / "extra.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    (out / "model.safetensors").rename(out / "a.safetensors")
    with pytest.raises(HFCheckpointError, match="is in both a.safetensors and extra.safetensors"):
        SafetensorsDir(out)


def test_export_takes_the_model_from_the_checkpoint_not_from_init_from(tmp_path):
    """init_from may change or go after the run started: the checkpoint's fields are exported."""
    run, base, _ = _saved_run(tmp_path)
    hf = json.loads((base / "config.json").read_text())
    hf["rope_parameters"]["rope_theta"] = 1e6
    hf["rms_norm_eps"] = 1e-6
    (base / "config.json").write_text(json.dumps(hf))
    saved = restore_params(str(run))
    assert saved.step == 7 and saved.init_from == str(base) and saved.model.init_from is None
    assert (saved.model.rope_theta, saved.model.norm_eps) == (10_000.0, 1e-5)
    _export(run, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["rope_theta"], written["rms_norm_eps"]) == (10_000.0, 1e-5)
    assert written["max_position_embeddings"] == 512  # the base's: the RoPE scaling is the base's
    shutil.rmtree(base)
    _export(run, tmp_path / "hf-after", tokenizer=str(tmp_path / "hf" / "tokenizer.json"))
    assert json.loads((tmp_path / "hf-after" / "config.json").read_text())["rope_theta"] == 10_000.0


def test_max_position_embeddings_follow_a_context_extension():
    from jvarlen.config import RopeScalingConfig

    base = json.loads(open(f"{fixture('tiny-qwen2')}/config.json").read())
    cfg = model_config(fixture("tiny-qwen2"))
    assert hf_config_dict(_plain(cfg), "float32", base)["max_position_embeddings"] == base["max_position_embeddings"]
    longer = dataclasses.replace(_plain(cfg), rope_scaling=RopeScalingConfig("llama3", 16.0, 1.0, 4.0, 4096))
    assert hf_config_dict(longer, "float32", base)["max_position_embeddings"] == max(
        base["max_position_embeddings"], 65536
    )
    assert base["rope_parameters"]["factor"] == 2.0  # linear ×2 in the fixture: ×8 reaches 4 times its length
    linear = dataclasses.replace(_plain(cfg), rope_scaling=RopeScalingConfig("linear", 8.0))
    assert hf_config_dict(linear, "float32", base)["max_position_embeddings"] == 4 * base["max_position_embeddings"]


def test_exported_token_ids_and_length_are_those_the_run_trained_with(tmp_path):
    """config.json names the special ids of the tokenizer the run's data went through (transformers
    stops generating at eos_token_id, and assumes 2 without one) and a maximum position of at least
    the longest document trained on (serving stacks cap the context by it); before: the base's ids or
    none, and the base's length or 4096."""
    run, base, _ = _saved_run(tmp_path)  # tiny-llama: bos/eos/pad 1/2/3, 512 positions, vocab 384
    (run / "config.json").write_text(
        json.dumps({"data": {"tokenizer": "byte", "seq_len": 2048, "max_doc_tokens": 1024}})
    )
    _export(run, tmp_path / "byte")
    written = json.loads((tmp_path / "byte" / "config.json").read_text())
    ids = [written[f"{kind}_token_id"] for kind in ("bos", "eos", "pad")]
    assert ids == [256, 257, 258] and written["max_position_embeddings"] == 1024
    (run / "config.json").write_text(json.dumps({"data": {"tokenizer": str(base / "tokenizer.json"), "seq_len": 256}}))
    _export(run, tmp_path / "own")
    written = json.loads((tmp_path / "own" / "config.json").read_text())
    ids = [written[f"{kind}_token_id"] for kind in ("bos", "eos", "pad")]
    assert ids == [1, 2, 3] and written["max_position_embeddings"] == 512  # the base's, longer than 256


def test_config_without_a_base_names_the_tokens_and_length_it_is_given():
    cfg = ModelConfig(vocab_size=320, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=64)
    bare = hf_config_dict(cfg, "float32")
    assert "eos_token_id" not in bare and bare["max_position_embeddings"] == 4096
    given = hf_config_dict(cfg, "float32", token_ids={"bos": 256, "eos": 257}, trained_length=128)
    assert (given["bos_token_id"], given["eos_token_id"], given["max_position_embeddings"]) == (256, 257, 128)
    # a base listing several end ids keeps its list when the run's EOS is one of them
    base = {"eos_token_id": [7, 257], "bos_token_id": 5, "max_position_embeddings": 8192}
    kept = hf_config_dict(cfg, "float32", base, token_ids={"bos": 256, "eos": 257}, trained_length=128)
    assert (kept["bos_token_id"], kept["eos_token_id"], kept["max_position_embeddings"]) == (256, [7, 257], 8192)


def test_unreadable_files_are_named(tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(fixture("tiny-llama"), directory)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(HFCheckpointError, match="config.json: cannot be read as JSON"):
        read_hf_config(directory)
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[:100])
    with pytest.raises(HFCheckpointError, match="model.safetensors: not a readable safetensors file"):
        SafetensorsDir(directory)
    (directory / "model.safetensors").unlink()
    (directory / INDEX).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(HFCheckpointError, match="not a safetensors index with a weight_map"):
        SafetensorsDir(directory)
    # an index that puts a tensor in a shard without it: named (before: the tensor dropped, later
    # reported as "missing" as if the model lacked it)
    (directory / "a.safetensors").write_bytes(data)
    names = hf_tensor_names(model_config(fixture("tiny-llama")))
    weight_map = {name: "a.safetensors" for name in names}
    (directory / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    assert SafetensorsDir(directory).names() == sorted(names)
    (directory / "b.safetensors").write_bytes(data)
    (directory / INDEX).write_text(json.dumps({"weight_map": {**weight_map, names[0]: "b.safetensors"}}))
    assert SafetensorsDir(directory).names() == sorted(names)  # the index says which copy: b's
    (directory / INDEX).write_text(json.dumps({"weight_map": {**weight_map, "lm_head.bias": "a.safetensors"}}))
    with pytest.raises(HFCheckpointError, match="puts 1 tensor.* in files that do not hold them, e.g. 'lm_head.bias'"):
        SafetensorsDir(directory)


def test_export_copies_the_tokenizer_that_made_the_training_ids(tmp_path):
    """The run's data.tokenizer goes with the export: none for the byte tokenizer (not init_from's,
    which did not make its ids), and a path that cannot be found from here is an error, not a
    fallback to init_from's."""
    run, base, _ = _saved_run(tmp_path)
    config = {"data": {"tokenizer": "byte"}}
    (run / "config.json").write_text(json.dumps(config))
    assert "tokenizer.json" not in _export(run, tmp_path / "byte")
    config["data"]["tokenizer"] = "relative/tokenizer.json"
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="data.tokenizer 'relative/tokenizer.json' is not a file"):
        _export(run, tmp_path / "missing")
    config["data"]["tokenizer"] = str(base / "tokenizer.json")
    (run / "config.json").write_text(json.dumps(config))
    _export(run, tmp_path / "own")
    assert (tmp_path / "own" / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    # with the file naming its special tokens (read by jvarlen and transformers alike); an export
    # replacing one with a tokenizer that has none leaves no stale copy
    (base / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (base / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert {"tokenizer_config.json", "chat_template.jinja"} <= set(_export(run, tmp_path / "own", overwrite=True))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "own" / name).read_bytes() == (base / name).read_bytes()
    (base / "tokenizer_config.json").unlink()
    (base / "chat_template.jinja").unlink()
    _export(run, tmp_path / "own", overwrite=True)
    assert sorted(os.listdir(tmp_path / "own")) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_an_export_through_a_link_to_another_file_system_replaces_the_model(tmp_path):
    """--out_dir a symlink to a directory on another file system (here /dev/shm): the export is staged
    beside the link's target, so --overwrite replaces the earlier model (before: staged beside the
    link, the move failed across file systems after the earlier files were deleted: both lost)."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    run, _, params = _saved_run(tmp_path)
    target = tempfile.mkdtemp(dir="/dev/shm", prefix="jvarlen-test-export-")
    try:
        (tmp_path / "link").symlink_to(target)
        _export(run, tmp_path / "link")
        _export(run, tmp_path / "link", overwrite=True)
        assert sorted(os.listdir(target)) == ["config.json", "model.safetensors", "tokenizer.json"]
        _, back = imported_params(target, model_config(target))
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert [p for p in os.listdir("/dev/shm") if "partial" in p and "link" in p] == []
    finally:
        shutil.rmtree(target, ignore_errors=True)


def test_float16_export_refuses_values_beyond_its_range(tmp_path):
    run, _, params = _saved_run(tmp_path)
    cfg = _plain(model_config(fixture("tiny-llama")))
    big = jax.tree.map(lambda x: x, params)
    big["final_norm"]["scale"] = jax.tree.map(lambda x: x * 1e5, big["final_norm"]["scale"])
    with pytest.raises(ValueError, match=r"model\.norm\.weight: \d+ value\(s\) beyond float16's range"):
        write_hf(big, cfg, str(tmp_path / "fp16"), "float16")
    write_hf(big, cfg, str(tmp_path / "bf16"), "bfloat16")  # within bfloat16's range
    big["final_norm"]["scale"] = jax.tree.map(lambda x: x.at[0].set(jnp.nan), params["final_norm"]["scale"])
    with pytest.raises(ValueError, match=r"model\.norm\.weight: 1 value\(s\) are NaN or Inf"):  # not "beyond range"
        write_hf(big, cfg, str(tmp_path / "fp32"), "float32")


def test_export_refuses_a_checkpoint_whose_bits_changed(tmp_path):
    """A flipped bit is refused whichever check finds it: the reader (the bit broke a compressed
    frame) or the checksums (it decompressed to other bits, the case only they catch). Bits are
    flipped and restored at several places until the checksums have been the ones to refuse."""
    from conftest import flip_a_bit

    run, _, _ = _saved_run(tmp_path)
    step_dir = run / "checkpoints" / "7"
    refused_by = []
    for at in (0.5, 0.3, 0.7, 0.1, 0.9, 0.4, 0.6, 0.2):
        flip_a_bit(step_dir, at)
        with pytest.raises(ValueError, match=r"checkpoint 7 in .*(does not hold the bits|cannot be read)") as refused:
            _export(run, tmp_path / "hf")
        assert not (tmp_path / "hf").exists()
        refused_by.append("checksum" if "does not hold the bits that were written" in str(refused.value) else "reader")
        if refused_by[-1] == "checksum":
            assert re.search(r"checkpoint 7 in .*: params/.* does not hold the bits", str(refused.value))
            break
        flip_a_bit(step_dir, at)  # undone: the next place is flipped on its own
    assert refused_by[-1] == "checksum", refused_by


def test_export_reports_a_truncated_checkpoint_as_unreadable(tmp_path):
    import glob

    run, _, _ = _saved_run(tmp_path)
    files = glob.glob(str(run / "checkpoints" / "7" / "state" / "**" / "d" / "*"), recursive=True)
    largest = max(files, key=os.path.getsize)  # the parameters' data, cut short
    os.truncate(largest, os.path.getsize(largest) // 2)
    with pytest.raises(ValueError, match=r"checkpoint 7 in .* cannot be read \(.*\); export an older checkpoint"):
        _export(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
