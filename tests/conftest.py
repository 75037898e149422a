"""Test setup: eight fake CPU devices, set before JAX starts; shared helpers (device check, small planner cost models)."""

import atexit
import functools
import os
import re
import shutil
import tempfile
from typing import Optional

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# The suite compiles hundreds of small CPU programs, and LLVM's optimisation of the generated code
# is a large part of that (the layouts-loop resume test: 61 -> 38 s of CPU). Programs that run
# many small steps get slower (pipeline-loop resume: 65 -> 95 s); the whole suite is faster (657 ->
# 591 s on 2 cores). HLO passes, and so the programs' structure, are unchanged. Inherited by the
# CLI subprocesses (cli_env); set the flag yourself to test at another level.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S+")


def cli_env(host_devices: Optional[int] = None, values_only: bool = False, **extra: str) -> dict:
    """The environment of a CLI subprocess: the suite's XLA flags with ``host_devices`` host
    devices (None: no count, the entry point gives the host what the run needs); ``values_only``:
    XLA:CPU's legacy emitters too, for a test that checks no compiled program's memory or HLO
    (:func:`values_compile`)."""
    flags = _DEVICE_COUNT.sub("", os.environ["XLA_FLAGS"]).strip()
    if host_devices is not None:
        flags = f"{flags} --xla_force_host_platform_device_count={host_devices}".strip()
    if values_only and _legacy_emitters():
        flags = f"{flags} --xla_cpu_use_fusion_emitters=false"
    return {**os.environ, "XLA_FLAGS": flags, **extra}


@functools.cache
def _legacy_emitters() -> dict:
    """``{"xla_cpu_use_fusion_emitters": False}`` where this XLA has the option, else ``{}``."""
    import jax
    import jax.numpy as jnp

    option = {"xla_cpu_use_fusion_emitters": False}
    try:
        jax.jit(lambda x: x + 1).lower(jnp.zeros(())).compile(option)
    except jax.errors.JaxRuntimeError:  # "No such compile option": an XLA without it keeps its emitters
        return {}
    return option


def values_compile() -> dict:
    """Compiler options for the tests that check values (losses and gradients against a reference,
    bitwise resumes, logged metrics), not a compiled program's HLO or bytes: the suite's -O0
    backend and XLA:CPU's legacy (LLVM IR) emitters instead of its MLIR fusion emitters, which
    compile each of a pipeline step's ~350 fusions as its own module (the 2-layer pipeline step of
    test_pipeline_memory: 5.5 -> 1.9 s). The emitters decide some fusions and so the buffers (that
    step's temp memory: +0.03..0.6 %): the HLO tests and those that compare a program's bytes with
    the planner's account keep XLA's defaults (:func:`relative_memory_compile`: the memory tests that
    may use these options). Their elementwise code is not XLA's default either: the layer-remat
    test of test_kernels_gpu_config, jitted with these options, finds the rematerialised and the
    plain gradients 4e-4 apart (relative; equal to 1e-5 with the default emitters, and eager), so a
    test that compares two programs of one model at a tight tolerance checks it under both first."""
    return {"xla_backend_optimization_level": 0, **_legacy_emitters()}


def relative_memory_compile() -> dict:
    """Compiler options for a test that compares the temp memory of programs compiled alike: growth
    with the chunks, layers, context or bucket, sharded against replicated weights, one part against
    two. They are :func:`values_compile`'s: the legacy emitters move a pipeline step's temporaries
    by 0.03-0.6 % (measured on this suite's steps), inside these tests' margins, and compile it 2-3x
    faster. What they compare is the executor's buffers, which both kinds of emitter see alike. A
    test that reads a compiled program's HLO (copies, in-place updates) or compares its bytes with
    the planner's account keeps XLA's defaults (``pipeline_helpers.FAST_COMPILE``): that is the
    program the runtime runs on CPU."""
    return values_compile()


def tile_head_logits(monkeypatch, logits: int) -> None:
    """Makes the head compute at most ``logits`` fp32 logits at a time (``jvarlen.head_tiles``),
    however few its rows: without the rule that keeps a head of ``width`` hidden size in one tile
    while its rows are at most ``width`` more than a tile (a test model's width is its whole chunk)."""
    from jvarlen import head_tiles

    tiles = head_tiles.logits_tiles
    monkeypatch.setattr(head_tiles, "LOGITS_TILE_BYTES", 4 * logits)
    monkeypatch.setattr(
        head_tiles, "logits_tiles", lambda rows, columns, width, tile_bytes=None: tiles(rows, columns, 0, tile_bytes)
    )


os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Lets an installed CUDA plugin register without cuDNN or a driver, for the deviceless
# compile tests (marker gpu_aot); without the plugin it does nothing.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache per test session, made by the first process that loads this
# file (pytest's controller) and inherited by the xdist workers and the subprocesses they start:
# many tests compile the same small programs, and XLA's own cache key (the optimized HLO and
# compile options) decides what is reused, so results are unchanged. Removed at exit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jvarlen-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"]
if "JVARLEN_TEST_CORPUS_CACHE" not in os.environ:  # tokenized corpora, shared the same way
    os.environ["JVARLEN_TEST_CORPUS_CACHE"] = tempfile.mkdtemp(prefix="jvarlen-test-corpus-")
    atexit.register(shutil.rmtree, os.environ["JVARLEN_TEST_CORPUS_CACHE"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True)
def _session_compilation_cache():
    """A test that turns on its own persistent cache (parallel.compilation_cache_dir) gets the
    session's back afterwards: the setting is process-wide."""
    yield
    if jax.config.jax_compilation_cache_dir != _CACHE:
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", _CACHE)


@pytest.fixture
def corpus_cache() -> str:
    """``data.cache_dir`` shared by the whole session (the stdlib corpus is tokenized once)."""
    return os.environ["JVARLEN_TEST_CORPUS_CACHE"]


def flip_a_bit(step_dir, at: float = 0.5) -> str:
    """Flips one bit at fraction ``at`` of the largest array data file of a checkpoint's train state
    (bit rot, a bad copy: the file stays readable); returns the file's path. Flipping the same bit
    again undoes it. Where the byte lands in a compressed frame's header, the reader itself rejects
    the file; elsewhere it reads other bits than were written."""
    import glob

    files = sorted(glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True), key=os.path.getsize)
    with open(files[-1], "r+b") as f:
        f.seek(int(os.path.getsize(files[-1]) * at))
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x40]))
    return files[-1]


def require_devices(n: int) -> None:
    """Skips the calling test when fewer than ``n`` devices are visible."""
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, have {jax.device_count()}")


# ---------------------------------------------------------------- small analytic cost models for the planner tests
from jvarlen.config import ModelConfig  # noqa: E402
from jvarlen.layout import Layout  # noqa: E402
from jvarlen.plan.cost import CostModel, ModelShape, profile_filename  # noqa: E402
from jvarlen.plan.hardware import A800, analytic_coefficients  # noqa: E402
from jvarlen.runtime.cost_check import PACKAGE_PROFILES  # noqa: E402

SMALL = ModelShape(
    num_layers=8, d_model=1024, num_heads=8, num_kv_heads=8, head_dim=128, mlp_dim=2816, vocab_size=32000
)


def small_cost(pp: int = 4, sp: int = 2, budget: float | None = None, model: ModelShape = SMALL) -> CostModel:
    """A800-analytic cost of a ~0.1B model; ``budget`` (bytes) overrides the memory budget."""
    layout = Layout(1, pp, sp)
    coeffs = analytic_coefficients(model, A800, num_nodes=1)
    if budget is not None:
        coeffs = coeffs.replace(memory_budget=budget)
    return CostModel(model, layout, coeffs)


# The CPU profile shipped from 2026-11-26 to 2026-11-30 (plain-autodiff layers), frozen for tests
# whose scenario rests on its numbers (which constraint binds, which partition is fastest): they
# test the planner's logic and must not change meaning when the shipped profile is measured again.
FROZEN_CPU_PROFILE = os.path.join(
    os.path.dirname(__file__), "fixtures", "profiles", "cpu_plain_autodiff_2026-11-26.json"
)

# The CPU profile jvarlen ships for the default model (tests of what the runtime plans with today).
SHIPPED_CPU_PROFILE = os.path.join(
    PACKAGE_PROFILES, profile_filename(ModelShape.from_config(ModelConfig()), "cpu", "cpu")
)


def tight_budget(cost: CostModel, tokens: int) -> float:
    """A budget that holds the model states plus ``tokens`` non-tail tokens with no recomputation
    (and the layer gradients the executor's backward returns, ``layer_gradient_memory``)."""
    from jvarlen.plan.chunk import ChunkShape

    state = max(cost.model_state_memory(p) for p in range(cost.layout.pp)) + cost.layer_gradient_memory()
    return state + cost.activation_memory(ChunkShape(0, (tokens,), tail=False), 0, cost.layout.pp - 1)


def group_budget(cost: CostModel, tokens: int) -> float:
    """:func:`tight_budget` for a device group of the strategy policies (``SchemeCosts``), whose
    every device holds the rest of the model (``CostModel.holds_rest``)."""
    return tight_budget(cost.replace(group=True), tokens)
