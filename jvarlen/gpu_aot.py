"""Deviceless GPU compilation: compile for an H100 / A100 on a machine without one.

With the CUDA plugin installed (``pip install -e '.[gpu-aot]'``), XLA compiles for an
abstract GPU described by a target spec (``jvarlen/gpu_targets/*.txtpb``, XLA's published
configs): Triton lowering of the Pallas kernels, ptxas, buffer assignment. What the GPU
would run is then inspectable here: ``memory_analysis()``, the optimized HLO, each Pallas
kernel's shared memory (XLA's thunk sequence) and registers/spills (``ptxas -v`` on the
PTX XLA produced). ``scripts/gpu_compile_check.py`` and the ``gpu_aot`` tests use this.

    devs = abstract_devices("h100", 8)
    report = compile_report(jax.jit(f).lower(*shape_dtype_structs_on(devs)))
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
import shutil
import subprocess
import tempfile
from importlib import resources
from typing import Optional

# The plugin refuses to register without cuDNN / a driver unless told to skip the check;
# compiling needs neither. Must be set before JAX initialises its backends.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

from jvarlen.kernels.gpu_config import GpuTarget  # noqa: E402

TARGETS = {"h100": "h100_sxm.txtpb", "a100": "a100_sxm_80.txtpb"}
KERNEL_PREFIX = "varlen_flash"


def unavailable_reason() -> Optional[str]:
    """None when deviceless CUDA compilation works here, else why not (for skips)."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return "the CUDA plugin is not installed (pip install -e '.[gpu-aot]')"
    try:
        abstract_devices("h100", 1)
    except Exception as e:  # plugin present but unusable (version mismatch, ...)
        return f"abstract CUDA devices unavailable: {type(e).__name__}: {str(e)[:200]}"
    return None


def target_spec(name: str) -> str:
    """The XLA target spec text of ``name`` (a key of TARGETS or a path to a .txtpb)."""
    if os.path.exists(name):
        with open(name, encoding="utf-8") as f:
            return f.read()
    if name not in TARGETS:
        raise ValueError(f"unknown GPU target {name!r}: one of {sorted(TARGETS)} or a target spec file")
    return resources.files("jvarlen").joinpath("gpu_targets", TARGETS[name]).read_text(encoding="utf-8")


def gpu_target(name: str) -> GpuTarget:
    return GpuTarget.from_spec(target_spec(name), name=name)


@functools.lru_cache(maxsize=None)
def abstract_devices(name: str, count: int = 1) -> tuple:
    """``count`` abstract devices of target ``name`` on one host (topology 1x1xN)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc("aot", "cuda", target_config=target_spec(name), topology=f"1x1x{count}")
    return tuple(topo.devices)


def lowering_device(device):
    """Context making ``device`` JAX's default device while lowering: JAX >= 0.12 asks the
    default device which GPU the Pallas Triton lowering targets (jax 0.10 does not)."""
    import jax

    return jax.default_device(device)


@dataclasses.dataclass(frozen=True)
class KernelStats:
    """One Pallas (Triton) kernel of a compiled program."""

    name: str
    shared_memory: int  # bytes of (dynamic) shared memory per block
    registers: Optional[int] = None  # per thread, from ptxas -v
    spill_stores: Optional[int] = None  # bytes
    spill_loads: Optional[int] = None


@dataclasses.dataclass
class CompileReport:
    """What a deviceless compile tells: memory per device, kernels, optimized HLO."""

    memory: dict  # CompiledMemoryStats fields (bytes)
    kernels: list[KernelStats]
    hlo: str

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs + temporaries - donated (aliased) bytes: one device's need."""
        m = self.memory
        return int(m["argument_size_in_bytes"] + m["output_size_in_bytes"] + m["temp_size_in_bytes"]) - int(
            m["alias_size_in_bytes"]
        )

    @property
    def max_shared_memory(self) -> int:
        return max((k.shared_memory for k in self.kernels), default=0)

    @property
    def spill_bytes(self) -> Optional[int]:
        """Register spill stores of every kernel, None where ptxas did not tell one kernel's (no
        ptxas, ``ptxas=False``, or output it could not read): unknown is not zero."""
        spills = [k.spill_stores for k in self.kernels]
        return None if None in spills else sum(spills)

    def count(self, kernel: str) -> int:
        """Launches of custom kernel ``kernel`` in the optimized HLO (calls, not fusions)."""
        return len(re.findall(rf'name\s*[:=]\s*\\?"{re.escape(kernel)}\\?"', self.hlo))

    def overlapped(self, collective: str = "all-gather", loops_only: bool = False) -> tuple[int, int]:
        """(async ``collective``s — "all-gather", "reduce-scatter", "all-to-all", … — with a kernel
        launch, conditional or loop scheduled between their start and done, all of them) in the
        scheduled HLO: how many the compiler overlaps with compute. ``loops_only``: only those in
        the bodies of loops (the passes over a stage's layers), not the ones before a loop or
        outside any."""
        bodies = set(re.findall(r" body=%([\w.-]+)", self.hlo))
        op = re.escape(collective)
        starts = {}
        overlapped = total = 0
        inside = not loops_only
        for line in self.hlo.splitlines():
            head = re.match(r"^(?:ENTRY )?%([\w.-]+) .*\{$", line)
            if head:
                inside = not loops_only or head.group(1) in bodies
                starts = {}
                continue
            if not inside:
                continue
            start = re.search(rf"%({op}-start[.\w]*) = .* {op}-start\(", line)
            if start:
                starts[start.group(1)] = []
                continue
            done = re.search(rf" {op}-done\(%({op}-start[.\w]*)\)", line)
            if done and done.group(1) in starts:
                total += 1
                overlapped += any(
                    re.search(r" (custom-call|conditional|while)\(", b) for b in starts.pop(done.group(1))
                )
                continue
            for between in starts.values():
                between.append(line)
        return overlapped, total


_THUNK = re.compile(r"kCustomKernel.*?\]\s+(\S+)\s+grid:.*?shared_memory:\s*(\d+)\s*bytes")


def _ptxas() -> Optional[str]:
    try:
        import nvidia.cuda_nvcc as nvcc

        for root in nvcc.__path__:
            path = os.path.join(root, "bin", "ptxas")
            if os.path.exists(path):
                return path
    except ImportError:
        pass
    return shutil.which("ptxas")


def _ptxas_stats(ptx_path: str, kernel: str) -> tuple[Optional[int], Optional[int], Optional[int]]:
    """(registers, spill store bytes, spill load bytes) of ``kernel`` in ``ptx_path``."""
    ptxas = _ptxas()
    if ptxas is None:
        return None, None, None
    with open(ptx_path, encoding="utf-8") as f:
        arch = re.search(r"^\.target\s+(\S+)", f.read(), re.M)
    cmd = [ptxas, "-v", f"-arch={arch.group(1) if arch else 'sm_80'}", ptx_path, "-o", os.devnull]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False).stderr
    block = out[out.find(f"Function properties for {kernel}") :]
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
    regs = re.search(r"Used (\d+) registers", block)
    return (
        int(regs.group(1)) if regs else None,
        int(spill.group(1)) if spill else None,
        int(spill.group(2)) if spill else None,
    )


def _memory_dict(stats) -> dict:
    names = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    names += ("generated_code_size_in_bytes",)
    return {n: int(getattr(stats, n, 0) or 0) for n in names}


def compile_report(lowered, *, kernel_prefix: str = KERNEL_PREFIX, ptxas: bool = True) -> CompileReport:
    """Compiles ``lowered`` (for abstract GPU devices) and reads memory, kernels and HLO.

    Raises what XLA raises when the program does not compile. Compiled at XLA's default backend
    optimization level, whatever ``XLA_FLAGS`` says (the test suite lowers it for its CPU programs;
    at level 0 the GPU kernels spill registers that a training compile does not).
    XLA's dump (HLO, buffer assignment, live ranges) is kept in a new folder under
    ``$JVARLEN_AOT_DUMP`` where that is set (``scripts/xla_buffers.py`` reads it), else deleted.
    """
    keep = os.environ.get("JVARLEN_AOT_DUMP")
    if keep:
        os.makedirs(keep, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jvarlen-aot-") as scratch:
        dump = tempfile.mkdtemp(prefix="compile-", dir=keep) if keep else scratch
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump, "xla_backend_optimization_level": 3})
        kernels: dict[str, KernelStats] = {}
        for path in glob.glob(os.path.join(dump, "*thunk_sequence.txt")):
            with open(path, encoding="utf-8") as f:
                for name, smem in _THUNK.findall(f.read()):
                    if name.startswith(kernel_prefix):
                        prev = kernels.get(name)
                        if prev is None or int(smem) > prev.shared_memory:
                            kernels[name] = KernelStats(name, int(smem))
        if ptxas:
            for name, ks in list(kernels.items()):
                for ptx in glob.glob(os.path.join(dump, "*.ptx")):
                    with open(ptx, encoding="utf-8") as f:
                        if f".entry {name}(" not in f.read():
                            continue
                    regs, st, ld = _ptxas_stats(ptx, name)
                    kernels[name] = dataclasses.replace(ks, registers=regs, spill_stores=st, spill_loads=ld)
                    break
    return CompileReport(
        memory=_memory_dict(compiled.memory_analysis()),
        kernels=sorted(kernels.values(), key=lambda k: k.name),
        hlo=compiled.as_text(),
    )


def abstract_step_context(config, devices):
    """The run's :class:`~jvarlen.runtime.strategy.StepContext` with an abstract train state
    (``jax.eval_shape``, nothing allocated) in its canonical sharding over ``devices``."""
    import jax

    from jvarlen.model import abstract_model
    from jvarlen.parallel.sharding import Placement
    from jvarlen.runtime.state import TrainState, make_optimizer, split_model
    from jvarlen.runtime.strategy import StepContext

    graphdef, params = split_model(abstract_model(config.model))
    optimizer = make_optimizer(config.optimizer, config.train.steps)
    state = jax.eval_shape(
        lambda p: TrainState(
            step=jax.numpy.zeros((), jax.numpy.int32),
            params=p,
            opt_state=optimizer.init(p),
            rng=jax.random.key_data(jax.random.key(0)),
        ),
        params,
    )
    placement = Placement.for_state(state, optimizer, devices)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, placement.state_sharding
    )
    return StepContext(graphdef, config.model, optimizer, placement, abstract)


def lower_train_step(config, devices, layout=None, *, rows: Optional[int] = None, seq_len: Optional[int] = None):
    """The data-parallel train step of ``config`` lowered for ``devices`` (abstract GPUs).

    Nothing is allocated: the state is abstract (``jax.eval_shape``), the batch is
    ``rows x seq_len`` tokens (default: the config's ``data.tokens_per_batch`` as rows of
    ``data.seq_len``). Call inside ``kernels.compile_for(target)`` so that attention and the
    compute dtype resolve as on the GPU. ``layout`` defaults to pure data parallelism.
    """
    import numpy as np

    from jvarlen.layout import Layout
    from jvarlen.runtime.step import BATCH_KEYS
    from jvarlen.runtime.strategies.layouts import LayoutPolicy, LayoutStrategy, shape_bucket

    layout = layout or Layout(dp=len(devices))
    ctx = abstract_step_context(config, devices)
    seq_len = seq_len or config.data.seq_len
    rows = rows or max(layout.dp, config.data.tokens_per_batch // seq_len)
    policy = LayoutPolicy(len(devices), config.model.num_heads, 1, layout)
    strategy = LayoutStrategy(ctx, policy, rows, seq_len, residual=config.parallel.residual_policy)
    batch = {k: np.zeros((rows, seq_len), np.float32 if k == "loss_mask" else np.int32) for k in BATCH_KEYS}
    with lowering_device(devices[0]):
        return ctx.lower(*strategy.step_inputs(("layout", layout, shape_bucket(batch))))


def recomputed_layers(recompute: bool | int, layers_per_stage: int) -> int:
    """Layers of a stage recomputed per chunk: all for True, none for False, else the count."""
    if recompute is True or recompute is False:
        return layers_per_stage if recompute else 0
    if not 0 <= recompute <= layers_per_stage:
        raise ValueError(f"recompute must be in [0, {layers_per_stage}] layers of a stage, got {recompute}")
    return int(recompute)


def lower_pipeline_step(
    config,
    devices,
    layout,
    *,
    chunks: int,
    bucket: int,
    stage_weights: str = "replicated",
    split: bool = False,
    recompute: bool | int = False,
):
    """The elastic pipeline's train step of ``config`` on ``layout`` lowered for ``devices``
    (abstract GPUs): every pipeline runs ``chunks`` one-document chunks of ``bucket`` tokens in
    1F1B order with no recomputation (the signature of such a plan); ``split``: one document of
    ``chunks × bucket`` tokens cut into ``chunks`` slices instead (Seq1F1B's token-level order;
    each slice attends to the slices before it, so the step has context buffers); ``recompute``:
    every layer of every chunk recomputed in its backward (no residual slots), or an int: that many
    of each stage's layers per chunk (the plan's ``ckpt_layers``). Call inside
    ``kernels.compile_for(target)``."""
    import numpy as np

    from jvarlen.parallel import pipeline as pl
    from jvarlen.plan import schedule
    from jvarlen.runtime.strategies.pipeline import PipelineStrategy

    ctx = abstract_step_context(config, devices)
    if split:
        docs = [np.ones(chunks * bucket, np.int32)]
        pack = pl.pack_chunks([[(0, i * bucket, bucket)] for i in range(chunks)], docs, bucket)
        sched = schedule.token_level_1f1b(pack.chunk_prev, layout.pp)
    else:
        docs = [np.ones(bucket, np.int32)] * chunks
        pack = pl.pack_chunks([[(i, 0, bucket)] for i in range(chunks)], docs, bucket)
        sched = schedule.one_f_one_b(chunks, layout.pp)
    ckpt = np.full((chunks, layout.pp), recomputed_layers(recompute, config.model.num_layers // layout.pp), np.int32)
    sig, _ = pl.prepare_batch(
        [pack] * layout.dp, [sched] * layout.dp, [ckpt] * layout.dp, layout, config.model.num_layers
    )
    strategy = PipelineStrategy.for_given_plans(
        ctx, layout, residual=config.parallel.residual_policy, stage_weights=stage_weights
    )
    with lowering_device(devices[0]):
        return ctx.lower(*strategy.step_inputs(sig))


# Attention cases of the compile matrix: (q heads, kv heads, query tokens, key tokens).
ATTENTION_CASES = {
    "gqa": (8, 2, 2048, 2048),  # packed self-attention, 4 query heads per kv head
    "context": (8, 8, 2048, 4096),  # a slice attending to 2048 cached tokens of its document
}


def lower_attention(device, dtype, head_dim: int, case: str = "gqa", kernel_config=None, target=None):
    """Forward + backward of ``varlen_attention`` (Pallas, compiled) on one abstract GPU.

    The schedule is an input (built once per batch by the model), so only the kernels and
    their surroundings compile. Raises ``kernels.UnsupportedError`` for configurations the
    project refuses.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from jvarlen import kernels

    h, hkv, t, s = ATTENTION_CASES[case]
    sharding = SingleDeviceSharding(device)
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    ids_t, ids_s = jnp.zeros((1, t), jnp.int32), jnp.zeros((1, s), jnp.int32)
    info = jax.eval_shape(lambda a, b: kernels.block_info_for(a, b, a, b), ids_t, ids_s)
    info = jax.tree.map(lambda x: sds(x.shape, x.dtype), info)

    def loss(q, k, v, q_seg, q_pos, kv_seg, kv_pos, info):
        o = kernels.varlen_attention(
            q,
            k,
            v,
            q_segment_ids=q_seg,
            kv_segment_ids=kv_seg,
            q_positions=q_pos,
            kv_positions=kv_pos,
            implementation="pallas",
            interpret=False,
            block_info=info,
            kernel_config=kernel_config,
        )
        return jnp.sum(o.astype(jnp.float32))

    args = (
        sds((1, t, h, head_dim), dtype),
        sds((1, s, hkv, head_dim), dtype),
        sds((1, s, hkv, head_dim), dtype),
        *(sds((1, n), jnp.int32) for n in (t, t, s, s)),
        info,
    )
    with kernels.compile_for(target or device), lowering_device(device):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args)
