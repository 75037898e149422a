"""The real decoder on single chunks (the profiler's and the cost-model validation's harness).

Part of the dual-layer profiler (DCP §3.5) of the real decoder on the current backend.

DCP runs two layers and times the second; under ``jit`` one layer cannot be timed inside
a compiled program, so we compile the same chunk through 1 and through 2 stacked layers
and take the difference: it is the time of one layer with the per-call overhead removed.
Over a grid of chunks ``{C, S}`` (token count, context length, packed slices) and
recomputation on/off this gives per-layer forward, backward and recompute samples, which
:func:`jvarlen.plan.cost_fit.fit_layer_time` turns into Eq. 1 coefficients. The head
(final norm + logits + loss), the per-chunk overhead of a whole-model chunk step, the
optimizer update and memory (``compile().memory_analysis()``, where reported) are measured
the same way. The result is a :class:`jvarlen.plan.cost.CostCoefficients` JSON keyed by
model shape, backend and device kind.

:class:`ChunkHarness` is also what ``scripts/validate_cost_model.py`` uses to run whole
plans (gradient accumulation over the plan's chunks + optimizer update, pp = 1). A chunk
with context ``C`` attends to ``C`` cached K/V entries of its document (random values of
the right shape; the time does not depend on the values) and produces their gradients.

On the CPU backend times are process CPU times of a process pinned to one core
(:mod:`jvarlen.profile.clock`, done by the entry points before JAX starts): the time that core
spent on the program, which is its wall time on a core nobody else uses; on a machine shared
with other jobs wall time varies several-fold, this clock does not.

Ulysses sp > 1 (``ChunkHarness(sp=…)``, ``ProfileConfig.sp``): the same programs run with the
tokens split over ``sp`` devices and attention through the Ulysses all-to-alls, on the reduced
grid :data:`SP_GRID`. The fit gives per-degree coefficients (``per_sp``, ``recompute_per_sp``,
``head_per_sp``, ``step_overhead_per_sp``) in which the all-to-all is included. On CPU the fake
devices are threads of one process; process CPU time counts all of them, so the per-device
time is process CPU time / sp (:func:`per_device_divisor`): the step time each device would
take with a core of its own and nothing to wait for.

Layers that are not recomputed keep what the run's ``parallel.residual_policy`` saves
(``ChunkHarness(residual=...)``, default the config's default), as the training step's and the
pipeline executor's layers do: a profile times and measures the layers the runtime runs, and
records the policy (``ProfileMeta.residual_policy``).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvarlen.config import ModelConfig, OptimizerConfig, ParallelConfig
from jvarlen.layout import Layout
from jvarlen.model import AttentionInputs, build_model, make_attention_fn
from jvarlen.model.transformer import apply_stacked_layers, residual_policy
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import ModelShape
from jvarlen.profile import SINGLE_THREAD_XLA_FLAGS  # noqa: F401 (re-exported)


def default_clock() -> Callable[[], float]:
    """Process CPU time on the CPU backend (one core's time when the process is pinned to one core,
    :func:`jvarlen.profile.clock.pin_one_core`; robust when other processes share the core), wall
    time elsewhere."""
    return time.process_time if jax.default_backend() == "cpu" else time.perf_counter


def clock_name() -> str:
    """What :func:`default_clock` measures in this process (recorded in reports)."""
    from jvarlen.profile import clock

    return clock.describe() if jax.default_backend() == "cpu" else "wall"


def per_device_divisor(sp: int) -> int:
    """What a clock reading of an ``sp``-device program is divided by to give per-device seconds:
    ``sp`` on the CPU backend (fake devices are threads of one process, process CPU time sums
    them), 1 elsewhere (wall time of devices running side by side)."""
    return sp if jax.default_backend() == "cpu" else 1


def time_call(fn: Callable, *args, repeats: int = 5, warmup: int = 1, clock: Optional[Callable] = None) -> float:
    """Minimum time (s) of ``fn(*args)`` over ``repeats`` runs after ``warmup`` runs, measured with
    ``clock`` (default :func:`default_clock`). The minimum is the estimate least disturbed by
    other processes sharing the machine."""
    clock = clock or default_clock()
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        jax.block_until_ready(fn(*args))
        best = min(best, clock() - t0)
    return best


TOKEN_BUCKETS = (256, 512, 1024, 2048)
CONTEXT_BUCKETS = (0, 2048, 6144)
# The reference probe's chunks (jvarlen.profile.clock, "Reference units"): three of the profiler's
# calibration chunks (a small packed step, a long-context split step, a full 2,048-token step), so
# every profile's calibration carries their readings. One chunk is not enough: between two days the
# small steps here got 13-16 % faster and the long-context and 2,048-token ones 21-28 %.
REFERENCE_CHUNKS = (ChunkShape(0, (512,)), ChunkShape(1500, (900,), tail=False), ChunkShape(0, (2048,)))
# names the probe wherever a reading is stored: readings of different probes are not comparable
REFERENCE_PROBE = ";".join(map(str, REFERENCE_CHUNKS))


def bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; raises when n exceeds the largest."""
    for b in sorted(buckets):
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {max(buckets)}")


def chunk_metadata(chunk: ChunkShape, t_bucket: int, c_bucket: int) -> dict[str, np.ndarray]:
    """Per-token ids of a chunk padded to ``t_bucket`` queries and ``c_bucket`` context keys
    (int32, ``[1, ·]``; segment 0 is padding).

    Queries: ``[slice 0 | slice 1 | ... | padding]``; slice 0 continues a document after ``C``
    context tokens (segment 1, positions C..), every other slice is its own document
    (segments 2, 3, ..., positions from 0). Keys: ``[padding | C context tokens | queries]``,
    the context right-aligned so that it fills whole blocks before the chunk.
    """
    seg = np.zeros(t_bucket, np.int32)
    pos = np.zeros(t_bucket, np.int32)
    start = 0
    for i, s in enumerate(chunk.slices):
        seg[start : start + s] = i + 1
        pos[start : start + s] = np.arange(s) + (chunk.context if i == 0 else 0)
        start += s
    ctx_seg = np.zeros(c_bucket, np.int32)
    ctx_pos = np.zeros(c_bucket, np.int32)
    if chunk.context:
        ctx_seg[c_bucket - chunk.context :] = 1
        ctx_pos[c_bucket - chunk.context :] = np.arange(chunk.context)
    kv_seg = np.concatenate([ctx_seg, seg])
    kv_pos = np.concatenate([ctx_pos, pos])
    return {"seg": seg[None], "pos": pos[None], "kv_seg": kv_seg[None], "kv_pos": kv_pos[None]}


class ChunkHarness:
    """The real decoder of ``cfg`` run on single chunks: one device, or with ``sp > 1`` the first
    ``sp`` devices as one Ulysses group (tokens split over them, parameters replicated).

    A chunk is padded to the smallest token bucket and context bucket that hold it, so one
    compiled program serves every chunk of that bucket pair (segment layout, context length
    and document boundaries are runtime data, as in the pipeline executor).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        seed: int = 0,
        optimizer: Optional[OptimizerConfig] = None,
        token_buckets: Sequence[int] = TOKEN_BUCKETS,
        context_buckets: Sequence[int] = CONTEXT_BUCKETS,
        sp: int = 1,
        residual: Optional[str] = ParallelConfig.residual_policy,
    ):
        self.cfg = cfg
        self.sp = sp
        # what a layer that is not recomputed keeps ("all": every residual of plain autodiff)
        self.residual_policy = residual or "all"
        residual_policy(self.residual_policy)  # an unknown name fails here, before anything is compiled
        self.mesh = None
        if sp > 1:  # Ulysses over the first sp devices; tokens split over sp, parameters replicated
            from jvarlen.parallel.layouts import layout_mesh

            if len(jax.devices()) < sp:
                raise ValueError(
                    f"sp={sp} needs {sp} devices, have {len(jax.devices())} (set XLA_FLAGS=--xla_force_host_platform_device_count)"
                )
            self.mesh = layout_mesh(Layout(1, 1, sp), jax.devices()[:sp])
        self.token_buckets = tuple(token_buckets)
        self.context_buckets = tuple(context_buckets)
        self.shape = ModelShape.from_config(cfg)
        self.model = build_model(cfg, seed=seed)
        self.graphdef, self.params = nnx.split(self.model, nnx.Param)
        if self.mesh is not None:
            self.params = jax.device_put(
                self.params, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            )
        self.dtype = jnp.dtype(self.model.compute_dtype)
        self.attention_impl = cfg.attention
        self._cache: dict = {}
        self.optimizer_cfg = optimizer or OptimizerConfig()

    # ---- inputs
    def buckets(self, chunk: ChunkShape) -> tuple[int, int]:
        return bucket(chunk.tokens, self.token_buckets), bucket(chunk.context, self.context_buckets)

    def layer_inputs(self, chunk: ChunkShape, seed: int = 0) -> dict:
        """Inputs of the layer programs, padded to the chunk's buckets (one program per bucket pair)."""
        m = self.shape
        rng = np.random.default_rng(seed)
        tb, cb = self.buckets(chunk)
        meta = chunk_metadata(chunk, tb, cb)
        x = rng.standard_normal((1, tb, m.d_model)).astype(np.float32)
        ctx = rng.standard_normal((2, 1, cb, m.num_kv_heads, m.head_dim)).astype(np.float32)
        out = {k: jnp.asarray(v) for k, v in meta.items()}
        out["x"] = jnp.asarray(x, self.dtype)
        out["ctx_k"] = jnp.asarray(ctx[0], self.dtype)
        out["ctx_v"] = jnp.asarray(ctx[1], self.dtype)
        return self._shard(out)

    def _shard(self, batch: dict) -> dict:
        """With sp > 1 every per-token array is split over ``sp`` along its token axis (1)."""
        if self.mesh is None:
            return batch
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from jvarlen.parallel.layouts import SP

        return {k: jax.device_put(v, NamedSharding(self.mesh, P(None, SP))) for k, v in batch.items()}

    def chunk_inputs(self, chunk: ChunkShape, seed: int = 0) -> dict:
        out = self.layer_inputs(chunk, seed)
        rng = np.random.default_rng(seed + 1)
        tb = out["seg"].shape[1]
        tokens = rng.integers(0, self.shape.vocab_size, (1, tb + 1)).astype(np.int32)
        out["tokens"] = jnp.asarray(tokens[:, :-1])
        out["targets"] = jnp.asarray(tokens[:, 1:])
        out["loss_mask"] = (out["seg"] > 0).astype(jnp.float32)
        del out["x"]
        return self._shard(out)

    def _attention_fn(self, ctx_k, ctx_v):
        if self.mesh is None:
            base = make_attention_fn(self.attention_impl)
        else:
            from jvarlen.parallel.ulysses import ulysses_attention_fn

            base = ulysses_attention_fn(self.mesh, self.attention_impl)
        if ctx_k.shape[1] == 0:
            return base

        def attention_fn(q, k, v, inputs):
            k = jnp.concatenate([ctx_k.astype(k.dtype), k], axis=1)
            v = jnp.concatenate([ctx_v.astype(v.dtype), v], axis=1)
            return base(q, k, v, inputs)

        return attention_fn

    def _run_layers(self, params, x, batch, n_layers: int, remat_layers: int):
        """Applies the first ``n_layers`` stacked layers; the first ``remat_layers`` recomputed."""
        model = nnx.merge(self.graphdef, params)
        gdef, stacked = nnx.split(model.layers)
        inputs = AttentionInputs(batch["seg"], batch["pos"], batch["kv_seg"], batch["kv_pos"])
        attn = self._attention_fn(batch["ctx_k"], batch["ctx_v"])
        parts = [(0, remat_layers, True), (remat_layers, n_layers, False)]
        for lo, hi, remat in parts:
            if hi > lo:
                part = jax.tree.map(lambda a, lo=lo, hi=hi: a[lo:hi], stacked)
                x = apply_stacked_layers(
                    gdef, part, x, inputs, attn, compute_dtype=self.dtype, remat=remat, residual=self.residual_policy
                )
        return x

    # ---- layer-slice programs (profiling)
    def layers_program(self, n_layers: int, mode: str, remat: bool | int) -> Callable:
        """jit of ``n_layers`` layers: ``mode="fwd"`` forward only, ``"fwdbwd"`` forward + VJP w.r.t.
        parameters, input and context K/V. ``remat``: True recomputes all layers, an int that many
        (the first ones), False none."""
        n_remat = n_layers if remat is True else int(remat)
        if not 0 <= n_remat <= n_layers <= self.cfg.num_layers:
            raise ValueError(
                f"need 0 <= remat ({n_remat}) <= n_layers ({n_layers}) <= num_layers ({self.cfg.num_layers})"
            )
        key = ("layers", n_layers, mode, n_remat)
        if key in self._cache:
            return self._cache[key]

        def fwd(params, batch):
            return self._run_layers(params, batch["x"], batch, n_layers, n_remat)

        if mode == "fwd":
            fn = jax.jit(fwd)
        else:

            def fwdbwd(params, batch):
                def f(p, x, ck, cv):
                    b = dict(batch, x=x, ctx_k=ck, ctx_v=cv)
                    return fwd(p, b)

                y, vjp = jax.vjp(f, params, batch["x"], batch["ctx_k"], batch["ctx_v"])
                return vjp(jnp.ones_like(y))

            fn = jax.jit(fwdbwd)
        self._cache[key] = fn
        return fn

    def head_program(self, mode: str) -> Callable:
        """jit of final norm + logits + loss (+ backward to the hidden state and head weights)."""
        key = ("head", mode)
        if key in self._cache:
            return self._cache[key]

        def loss(params, x, batch):
            model = nnx.merge(self.graphdef, params)
            return model.loss_sums(x, batch["targets"], batch["loss_mask"])["loss_sum"]

        if mode == "fwd":
            fn = jax.jit(loss)
        else:
            fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
        self._cache[key] = fn
        return fn

    # ---- whole-model programs (validation, per-chunk overhead)
    def chunk_step_program(self, ckpt_layers: int) -> Callable:
        """jit of one chunk through the whole model: forward, loss, backward, gradients added to
        the accumulator ``acc`` (donated). Returns ``(acc, loss_sum)``."""
        key = ("chunk", ckpt_layers)
        if key in self._cache:
            return self._cache[key]
        n = self.cfg.num_layers

        def loss(params, ck, cv, batch):
            model = nnx.merge(self.graphdef, params)
            x = model.embed_tokens(batch["tokens"])
            x = self._run_layers(params, x, dict(batch, ctx_k=ck, ctx_v=cv), n, ckpt_layers)
            sums = model.loss_sums(x, batch["targets"], batch["loss_mask"])
            return sums["loss_sum"] / jnp.maximum(sums["target_tokens"], 1.0)

        def step(params, acc, batch):
            value, (g, _, _) = jax.value_and_grad(loss, argnums=(0, 1, 2))(
                params, batch["ctx_k"], batch["ctx_v"], batch
            )
            return jax.tree.map(jnp.add, acc, g), value

        fn = jax.jit(step, donate_argnums=1)
        self._cache[key] = fn
        return fn

    def optimizer_program(self):
        """(init, jitted update(params, opt_state, grads) -> (params, opt_state)) with the run's AdamW."""
        from jvarlen.runtime.state import make_optimizer

        if "opt" not in self._cache:
            tx = make_optimizer(self.optimizer_cfg, total_steps=1000)

            def update(params, opt_state, grads):
                import optax

                upd, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, upd), opt_state

            self._cache["opt"] = (tx.init, jax.jit(update, donate_argnums=(0, 1)))
        return self._cache["opt"]

    def zeros_like_params(self):
        return jax.tree.map(lambda a: jnp.zeros_like(a, device=a.sharding), self.params)


def chunk_step_timer(harness: ChunkHarness, chunks: Sequence[ChunkShape]) -> Callable[[], list[float]]:
    """Per call, one clock reading (:func:`default_clock`) of the whole-model step (no
    recomputation, gradients into one accumulator) of each of ``chunks``, in order. Every bucket
    pair is compiled and run once before the first call. The profiler's calibration and the
    reference probe both time chunks with it, so their readings are of the same programs."""
    prog = harness.chunk_step_program(0)
    batches = [harness.chunk_inputs(c) for c in chunks]
    clock = default_clock()
    acc = harness.zeros_like_params()

    def once() -> list[float]:
        nonlocal acc
        out = []
        for batch in batches:
            t0 = clock()
            acc, v = prog(harness.params, acc, batch)
            jax.block_until_ready(v)
            out.append(clock() - t0)
        return out

    once()  # compile
    return once


def reference_probe(harness: ChunkHarness) -> Callable[[], list[float]]:
    """Per call, one clock reading of the whole-model step of each of :data:`REFERENCE_CHUNKS`
    (:func:`chunk_step_timer`, as the profiler's calibration times them; sp = 1 harness only: the
    probe must be the same programs in the profile and beside a plan). :func:`reference_seconds`
    turns a series of calls into one reading."""
    if harness.sp != 1:
        raise ValueError(f"the reference probe runs on an sp = 1 harness, got sp = {harness.sp}")
    return chunk_step_timer(harness, REFERENCE_CHUNKS)


def reference_seconds(readings: Sequence[Sequence[float]]) -> float:
    """One reference reading from probe calls (each a reading per reference chunk): the sum over
    the chunks of each chunk's minimum, the profile's statistic
    (:func:`jvarlen.profile.fit.reference_reading`) when there are as many calls as its calibration
    had rounds; fewer calls read larger (:func:`jvarlen.profile.clock.nearest_probe_reading` pools
    neighbouring plans' calls to get there)."""
    if not readings:
        raise ValueError("no probe readings")
    return float(np.sum(np.min(np.asarray(readings, dtype=float), axis=0)))


def run_plan(
    harness: ChunkHarness,
    chunks: Sequence[ChunkShape],
    ckpt: Sequence[int],
    repeats: int = 3,
    probe: Optional[Callable[[], list[float]]] = None,
) -> dict:
    """Time of one pp = 1 plan: every chunk forward + backward with its recomputed layers,
    gradients accumulated, then the optimizer update. Programs are compiled (and run once)
    before timing. Returns ``{"cpu": s, "wall": s}``, each the minimum over ``repeats``; raw
    clock readings (divide ``cpu`` by :func:`per_device_divisor` for per-device seconds when
    ``harness.sp > 1``). With ``probe`` (:func:`reference_probe`) the probe runs before every
    repeat; ``"reference"`` is :func:`reference_seconds` of its calls, ``"reference_runs"`` the
    calls' readings."""
    init, update = harness.optimizer_program()
    batches = [harness.chunk_inputs(c, seed=i) for i, c in enumerate(chunks)]
    programs = [harness.chunk_step_program(int(k)) for k in ckpt]

    def once():
        params = jax.tree.map(jnp.copy, harness.params)
        opt_state = init(params)
        acc = harness.zeros_like_params()
        jax.block_until_ready((params, opt_state, acc))
        w0, c0 = time.perf_counter(), time.process_time()
        for prog, batch in zip(programs, batches):
            acc, _ = prog(params, acc, batch)
        params, opt_state = update(params, opt_state, acc)
        jax.block_until_ready(params)
        return time.process_time() - c0, time.perf_counter() - w0

    once()  # compile
    runs, readings = [], []
    for _ in range(repeats):
        if probe is not None:
            readings.append(probe())
        runs.append(once())
    out = {"cpu": min(r[0] for r in runs), "wall": min(r[1] for r in runs)}
    if probe is not None:
        out.update(reference=reference_seconds(readings), reference_runs=readings)
    return out


# --------------------------------------------------------------------------- profiling
