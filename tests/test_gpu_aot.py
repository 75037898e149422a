"""Deviceless CUDA compilation for an abstract H100 (needs the gpu-aot extra; skipped
without the CUDA plugin). A representative subset of scripts/gpu_compile_check.py: about a
minute of compiling on 2 cores; the full matrix is the script's."""

import jax.numpy as jnp
import pytest

from jvarlen import gpu_aot, kernels
from jvarlen.config import load_config
from jvarlen.runtime.memory_fit import check_fit

pytestmark = [
    pytest.mark.gpu_aot,
    pytest.mark.skipif(gpu_aot.unavailable_reason() is not None, reason=str(gpu_aot.unavailable_reason())),
]


@pytest.mark.parametrize(
    "dtype,head_dim,case",
    [
        (jnp.float32, 128, "gqa"),  # 263,168 B of shared memory with the old 128-row tiles
        (jnp.bfloat16, 96, "context"),  # not a power of two: failed at Triton lowering before padding
    ],
)
def test_attention_compiles_for_h100(dtype, head_dim, case):
    import jax

    device = gpu_aot.abstract_devices("h100", 1)[0]
    # conftest sets matmul precision "highest" for the CPU reference tests; it changes the f32
    # Triton dots (more registers). Compile as training does, with the default precision.
    with jax.default_matmul_precision("default"):
        lowered = gpu_aot.lower_attention(device, dtype, head_dim, case, target=gpu_aot.gpu_target("h100"))
    report = gpu_aot.compile_report(lowered)
    names = {k.name for k in report.kernels}
    assert names == {"varlen_flash_fwd", "varlen_flash_dq", "varlen_flash_dkv"}
    assert report.max_shared_memory <= 232_448
    assert report.spill_bytes == 0, report.kernels


def test_head_dim_above_256_is_refused_before_xla():
    device = gpu_aot.abstract_devices("h100", 1)[0]
    with pytest.raises(kernels.UnsupportedError):
        gpu_aot.lower_attention(device, jnp.bfloat16, 320, "gqa", target=gpu_aot.gpu_target("h100"))


def test_data_parallel_step_runs_one_attention_forward_per_layer():
    """configs/default.yaml with model.remat on 2 abstract H100s: the compiled step holds one
    forward kernel (in the scanned layer body), not a second one for the recomputation."""
    config = load_config("configs/default.yaml", **{"parallel.pp": "1", "model.remat": "true"})
    target = gpu_aot.gpu_target("h100")
    with kernels.compile_for(target):
        lowered = gpu_aot.lower_train_step(config, gpu_aot.abstract_devices("h100", 2))
    report = gpu_aot.compile_report(lowered, ptxas=False)
    assert report.count("varlen_flash_fwd") == 1
    assert report.count("varlen_flash_dq") == 1 and report.count("varlen_flash_dkv") == 1
    fit = check_fit(report.memory, device_bytes=target.memory_bytes, env={})
    assert fit.fits, fit.message


@pytest.mark.parametrize("dp,sp", [(8, 1), (2, 4)])
def test_data_parallel_step_sums_weight_gradients_in_fp32(dp, sp):
    """bf16 compute on 8 abstract H100s: the partitioner sums the layer matrices' gradients over dp / sp
    where their matmuls produce them, in the dot's output dtype. Every all-reduce / reduce-scatter of
    the compiled step is fp32 (before: the layer matrices' gradients went as bf16 all-reduces in every layer)."""
    import re

    from jvarlen.layout import Layout

    model = {"compute_dtype": "bfloat16", "attention": "auto", "d_model": 256, "mlp_dim": 512, "num_heads": 8}
    config = load_config("configs/epp-cpu.yaml", **{f"model.{k}": str(v) for k, v in model.items()})
    with kernels.compile_for(gpu_aot.gpu_target("h100")):
        lowered = gpu_aot.lower_train_step(
            config, gpu_aot.abstract_devices("h100", 8), Layout(dp=dp, sp=sp), rows=8, seq_len=1024
        )
    hlo = lowered.compile().as_text()
    sums = re.findall(r"= (\w+)\[[\d,]*\](?:\{[\d,]*\})? (?:all-reduce|reduce-scatter)(?:-start)?\(", hlo)
    assert sums and set(sums) <= {"f32", "s32"}, sums


def test_data_parallel_step_keeps_what_its_residual_policy_saves():
    """Remat off, bf16 on 2 abstract H100s: what a layer adds per token to the compiled step's
    temporaries (the mixed difference of 2 / 4 layers and 2K / 4K tokens per device) is within 10 %
    of what the cost model charges it (``stage.stored_token_bytes`` under the run's residual policy:
    5,416 B here, compiled 5,662), and a step that keeps every residual holds more (before
    2026-11-30 the data-parallel step kept every residual whatever the policy)."""
    from jvarlen.layout import Layout
    from jvarlen.parallel.pipeline.stage import stored_token_bytes

    model = {"compute_dtype": "bfloat16", "attention": "auto", "d_model": 256, "mlp_dim": 768, "num_heads": 8}

    def temp(layers, seq, policy="dots_and_attention"):
        overrides = {f"model.{k}": str(v) for k, v in model.items()}
        overrides.update({"model.num_layers": str(layers), "model.remat": "false", "parallel.residual_policy": policy})
        config = load_config("configs/epp-cpu.yaml", **overrides)
        with kernels.compile_for(gpu_aot.gpu_target("h100")):
            lowered = gpu_aot.lower_train_step(
                config, gpu_aot.abstract_devices("h100", 2), Layout(dp=2), rows=2, seq_len=seq
            )
        return lowered.compile().memory_analysis().temp_size_in_bytes, config

    (a, _), (b, _), (c, _), (d, config) = temp(2, 2048), temp(2, 4096), temp(4, 2048), temp(4, 4096)
    per_token_and_layer = ((d - c) - (b - a)) / 2 / 2048
    charged = stored_token_bytes(config.model, "dots_and_attention")
    assert abs(per_token_and_layer - charged) <= 0.1 * charged, (per_token_and_layer, charged)
    assert temp(4, 4096, "all")[0] > d


def test_pipeline_step_never_gathers_the_whole_table():
    """The pipeline executor splits the embedding table and head by vocabulary over sp; the move
    from the canonical state (split on the model dimension) to that split gathers 1/sp of them
    (``rest.hand_rest``), never the whole fp32 table or head on one device (before e2ada72: both,
    4.2 GB per device at a 128K vocabulary on llama-7b's width)."""
    import re

    from jvarlen.layout import Layout

    vocab, d = 32000, 256
    model = {"compute_dtype": "bfloat16", "attention": "auto", "d_model": d, "mlp_dim": 512, "num_heads": 8}
    model.update(vocab_size=vocab, num_layers=2, tie_embeddings="false")
    config = load_config("configs/epp-cpu.yaml", **{f"model.{k}": str(v) for k, v in model.items()})
    layout = Layout(dp=1, pp=2, sp=2)
    with kernels.compile_for(gpu_aot.gpu_target("h100")):
        lowered = gpu_aot.lower_pipeline_step(config, gpu_aot.abstract_devices("h100", 4), layout, chunks=2, bucket=512)
    hlo = lowered.compile().as_text()
    ops = re.findall(r" = (.*?) all-gather(?:-start)?\(", hlo)  # the result types of every all-gather
    shapes = {tuple(int(n) for n in g.split(",")) for r in ops for g in re.findall(r"\w+\[([\d,]+)\]", r)}
    assert shapes, "no all-gather found: the pattern no longer matches XLA's text"
    assert (vocab, d) not in shapes and (d, vocab) not in shapes, sorted(shapes)
    assert (vocab // 2, d) in shapes or (d, vocab // 2) in shapes, sorted(shapes)  # 1/sp of them, gathered
