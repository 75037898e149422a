"""Dual-layer profiler (DCP §3.5) of the real decoder on the current backend.

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

On the CPU backend times are process CPU times of a single-threaded XLA
(:data:`SINGLE_THREAD_XLA_FLAGS`, set by the entry points before JAX starts): on a machine
shared with other jobs wall time varies several-fold, CPU time of one thread does not.

Ulysses sp > 1 (``ChunkHarness(sp=…)``, ``ProfileConfig.sp``): the same programs run with the
tokens split over ``sp`` devices and attention through the Ulysses all-to-alls, on the reduced
grid :data:`SP_GRID`. The fit gives per-degree coefficients (``per_sp``, ``recompute_per_sp``,
``head_per_sp``, ``step_overhead_per_sp``) in which the all-to-all is included. On CPU the fake
devices are threads of one process; process CPU time counts all of them, so the per-device
time is process CPU time / sp (:func:`per_device_divisor`): the step time each device would
take with a core of its own and nothing to wait for.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvarlen.config import ModelConfig, OptimizerConfig
from jvarlen.layout import Layout
from jvarlen.model import AttentionInputs, build_model, cross_entropy_sums, make_attention_fn
from jvarlen.model.transformer import apply_stacked_layers
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, LayerTime, ModelShape, ProfileMeta

# the fits live in cost_fit (pure numpy); re-exported here for the profiler's callers
from jvarlen.plan.cost_fit import fit_layer_programs, fit_memory, fit_time_terms  # noqa: F401
from jvarlen.plan.cost_fit import parse_chunk as _parse_chunk  # noqa: F401


def default_clock() -> Callable[[], float]:
    """Process CPU time on the CPU backend (robust when other processes share the cores; run XLA
    single-threaded so that it equals the step's compute time), wall time elsewhere."""
    return time.process_time if jax.default_backend() == "cpu" else time.perf_counter


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


from jvarlen.profile import SINGLE_THREAD_XLA_FLAGS  # noqa: E402,F401  (re-exported)

TOKEN_BUCKETS = (256, 512, 1024, 2048)
CONTEXT_BUCKETS = (0, 2048, 6144)


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
    ):
        self.cfg = cfg
        self.sp = sp
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
                x = apply_stacked_layers(gdef, part, x, inputs, attn, compute_dtype=self.dtype, remat=remat)
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
            sums = cross_entropy_sums(model.logits(x), batch["targets"], batch["loss_mask"])
            return sums["loss_sum"]

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
            sums = cross_entropy_sums(model.logits(x), batch["targets"], batch["loss_mask"])
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


def run_plan(harness: ChunkHarness, chunks: Sequence[ChunkShape], ckpt: Sequence[int], repeats: int = 3) -> dict:
    """Time of one pp = 1 plan: every chunk forward + backward with its recomputed layers,
    gradients accumulated, then the optimizer update. Programs are compiled (and run once)
    before timing. Returns ``{"cpu": s, "wall": s}``, each the minimum over ``repeats``; raw
    clock readings (divide ``cpu`` by :func:`per_device_divisor` for per-device seconds when
    ``harness.sp > 1``)."""
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
    runs = [once() for _ in range(repeats)]
    return {"cpu": min(r[0] for r in runs), "wall": min(r[1] for r in runs)}


# --------------------------------------------------------------------------- profiling


@dataclasses.dataclass(frozen=True)
class ProfileGrid:
    """What is profiled. For every (token bucket, context bucket) pair one program per layer
    count and mode is compiled, and several chunks of that bucket pair are timed on it: full and
    partly filled buckets, single slices with the largest and a middle context, packed documents.
    Recomputation is profiled on the pairs in ``remat_pairs``."""

    token_buckets: tuple[int, ...] = (512, 1024, 2048)
    context_buckets: tuple[int, ...] = (0, 2048, 6144)
    remat_pairs: tuple[tuple[int, int], ...] = ((512, 0), (1024, 0), (2048, 0), (1024, 2048))
    repeats: int = 5
    # Whole-model chunk steps that correct the layer and head fit in situ (an attention factor and
    # one token factor per bucket, :func:`jvarlen.plan.cost_fit.fit_in_situ_scales`): every token
    # bucket, packed, split and hybrid chunks, contexts up to 2048 (the sp > 1 grid's largest).
    calibration: tuple[ChunkShape, ...] = (
        ChunkShape(0, (200, 150, 90)),
        ChunkShape(1000, (470,), tail=False),
        ChunkShape(0, (512,)),
        ChunkShape(0, (650,)),
        ChunkShape(600, (350, 250)),
        ChunkShape(0, (700, 300)),
        ChunkShape(1500, (900,), tail=False),
        ChunkShape(0, (1300,)),
        ChunkShape(0, (600, 500, 400, 300)),
        ChunkShape(2000, (1200, 400)),
        ChunkShape(1800, (1700,), tail=False),
        ChunkShape(0, (2048,)),
    )

    def chunks(self, tb: int, cb: int) -> list[ChunkShape]:
        prev_t = max([b for b in self.token_buckets if b < tb], default=0)
        prev_c = max([b for b in self.context_buckets if b < cb], default=0)
        sizes = [tb, (tb + prev_t) // 2 + 1]
        out = []
        for t in sizes:
            if cb == 0:
                out.append(ChunkShape(0, (t,)))
                out.append(ChunkShape(0, tuple([t // 4] * 3 + [t - 3 * (t // 4)])))
                n = max(2, t // 96)
                out.append(ChunkShape(0, tuple([t // n] * (n - 1) + [t - (n - 1) * (t // n)])))
            else:
                for c in (cb, (cb + prev_c) // 2 + 1):
                    out.append(ChunkShape(c, (t,), tail=False))
                out.append(ChunkShape(cb, (t // 2, t // 4, t - t // 2 - t // 4)))
        return out


# Reduced grid for Ulysses degrees > 1 (CPU budget): the sp = 1 token buckets and chunk families,
# contexts up to 2048 only (no 6144 bucket).
SP_GRID = ProfileGrid(context_buckets=(0, 2048))


@dataclasses.dataclass
class ProfileSamples:
    chunks: list[ChunkShape]
    fwd: np.ndarray  # [n] seconds per layer
    bwd: np.ndarray
    recompute: np.ndarray  # [n] NaN where not profiled
    raw: dict


def dual_layers(num_layers: int) -> tuple[int, int]:
    """Layer counts whose time difference is one layer: (2, 3) — a one-layer scan compiles to a
    different program than a loop, so as in DCP the first layer only warms up — or (1, 2)."""
    return (2, 3) if num_layers >= 3 else (1, 2)


def profile_layers(harness: ChunkHarness, grid: ProfileGrid, progress: Optional[Callable] = None) -> ProfileSamples:
    """Per-layer forward/backward/recompute samples by the dual-layer difference (3 layers − 2)."""
    lo, hi = dual_layers(harness.cfg.num_layers)
    pairs = [(tb, cb) for tb in grid.token_buckets for cb in grid.context_buckets]
    chunks, fwd, bwd, rec, raw = [], [], [], [], {}
    for done, (tb, cb) in enumerate(pairs):
        remat = (tb, cb) in grid.remat_pairs
        for chunk in grid.chunks(tb, cb):
            batch = harness.layer_inputs(chunk)
            t = {}
            for nl in (lo, hi):
                t[("fwd", nl)] = time_call(
                    harness.layers_program(nl, "fwd", False), harness.params, batch, repeats=grid.repeats
                )
                t[("fb", nl)] = time_call(
                    harness.layers_program(nl, "fwdbwd", False), harness.params, batch, repeats=grid.repeats
                )
                if remat:
                    t[("fbr", nl)] = time_call(
                        harness.layers_program(nl, "fwdbwd", True), harness.params, batch, repeats=grid.repeats
                    )
            f = t[("fwd", hi)] - t[("fwd", lo)]
            fb = t[("fb", hi)] - t[("fb", lo)]
            chunks.append(chunk)
            fwd.append(f)
            bwd.append(fb - f)
            rec.append((t[("fbr", hi)] - t[("fbr", lo)]) - fb if remat else np.nan)
            raw[str(chunk)] = {f"{k[0]}{k[1]}": v for k, v in t.items()}
        if progress:
            progress(done + 1, len(pairs), (tb, cb))
    return ProfileSamples(chunks, np.array(fwd), np.array(bwd), np.array(rec), raw)


def program_memory(fn: Callable, *args) -> Optional[dict]:
    """XLA's buffer sizes (bytes) of ``fn`` compiled for ``args`` (not run): ``temp`` (peak of the
    program's own buffers), ``argument``, ``output``, ``alias``; None where the backend reports
    nothing."""
    try:
        stats = fn.lower(*args).compile().memory_analysis()
    except Exception:  # noqa: BLE001 - backends without memory analysis
        return None
    if stats is None:
        return None
    return {
        "temp": int(stats.temp_size_in_bytes),
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes),
    }


def memory_layer_counts(num_layers: int) -> tuple[int, ...]:
    """Layer counts of the memory slices: 2..4 (capped at the model depth). A least-squares slope
    over equally spaced counts 2, 3, 4 is ``(m(4) − m(2)) / 2``: XLA's buffer assignment of the
    3-layer program is not halfway between (+3 KB/token at T = 512 on CPU), so two differences
    are averaged rather than trusting one."""
    return tuple(n for n in (2, 3, 4) if n <= num_layers) if num_layers >= 2 else (1,)


def measure_memory(harness: ChunkHarness, tokens: Sequence[int], progress: Optional[Callable] = None) -> list[dict]:
    """``memory_analysis()`` of the forward+backward layer programs (compiled, not run) over
    (tokens ∈ ``tokens``, context 0, layer counts :func:`memory_layer_counts`, recomputation of
    none or all layers). Rows: ``{tokens, context, layers, remat, temp, argument, output, alias}``;
    empty when the backend reports nothing."""
    rows = []
    for t in tokens:
        chunk = ChunkShape(0, (t,))
        batch = harness.layer_inputs(chunk)
        for n in memory_layer_counts(harness.cfg.num_layers):
            for remat in (0, n):
                stats = program_memory(harness.layers_program(n, "fwdbwd", remat), harness.params, batch)
                if stats is None:
                    return []
                rows.append(dict(tokens=t, context=0, layers=n, remat=remat, **stats))
        if progress:
            progress(t)
    return rows


def measure_alltoall(
    sp: int, token_counts: Sequence[int], heads: int, head_dim: int, dtype, repeats: int = 5
) -> list[list[float]]:
    """Times the Ulysses all-to-all ``[1, T/sp, H, hd] -> [1, T, H/sp, hd]`` (``seq_to_heads``) on
    ``sp`` devices alone. Rows ``[bytes each device sends, seconds per device]``; a device sends
    ``(sp−1)/sp`` of its ``e·T/sp·H·hd`` bytes. Seconds per device = clock time / ``sp`` on the CPU
    backend, whose fake devices are threads of one process timed by process CPU time
    (:func:`default_clock`); elsewhere the clock is wall time and is not divided."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jvarlen.parallel.layouts import SP, layout_mesh
    from jvarlen.parallel.ulysses import seq_to_heads

    mesh = layout_mesh(Layout(1, 1, sp), jax.devices()[:sp])
    spec = P(None, SP, None, None)
    fn = jax.jit(jax.shard_map(seq_to_heads, mesh=mesh, in_specs=spec, out_specs=P(None, None, SP, None)))
    per_device = per_device_divisor(sp)
    e = jnp.dtype(dtype).itemsize
    rows = []
    for t in token_counts:
        x = jax.device_put(jnp.ones((1, t, heads, head_dim), dtype), NamedSharding(mesh, spec))
        sec = time_call(fn, x, repeats=repeats) / per_device
        rows.append([e * t / sp * heads * head_dim * (sp - 1) / sp, sec])
    return rows


def measure_calibration(
    harness: ChunkHarness, chunks: Sequence[ChunkShape], repeats: int = 5, progress: Optional[Callable] = None
) -> list:
    """Raw clock readings of whole-model chunk steps (embedding, layers, head, loss, backward,
    gradient accumulation; no recomputation): rows ``[[context, slices, tail], seconds]``, the
    minimum over ``repeats`` rounds. Each round times every chunk once, so the repeats of one chunk
    are spread over the whole measurement and a slow spell of the machine cannot spoil all of
    them."""
    prog = harness.chunk_step_program(0)
    acc = harness.zeros_like_params()
    batches = [harness.chunk_inputs(c) for c in chunks]
    clock = default_clock()

    def once(batch) -> float:
        nonlocal acc
        t0 = clock()
        acc, v = prog(harness.params, acc, batch)
        jax.block_until_ready(v)
        return clock() - t0

    for batch in batches:  # warm-up: compile every bucket pair
        once(batch)
    best = [float("inf")] * len(chunks)
    for r in range(repeats):
        for i, batch in enumerate(batches):
            best[i] = min(best[i], once(batch))
        if progress:
            progress(r + 1, repeats)
    return [[[c.context, list(c.slices), c.tail], t] for c, t in zip(chunks, best)]


def measure_profile(
    harness: ChunkHarness, grid: ProfileGrid = ProfileGrid(), progress: Optional[Callable] = None
) -> dict:
    """All measurements of a profile as a JSON-able report (no fitting). Raw clock readings; with
    ``harness.sp > 1`` the report's ``clock_divisor`` turns them into per-device seconds, and memory
    is not measured (the memory coefficients come from the sp = 1 programs)."""
    samples = profile_layers(harness, grid, progress)
    head = []
    for t in grid.token_buckets:
        batch = harness.chunk_inputs(ChunkShape(0, (t,)))
        x = jnp.asarray(np.random.default_rng(0).standard_normal((1, t, harness.shape.d_model)), harness.dtype)
        x = harness._shard({"x": x})["x"]
        f = time_call(harness.head_program("fwd"), harness.params, x, batch, repeats=grid.repeats)
        fb = time_call(harness.head_program("fwdbwd"), harness.params, x, batch, repeats=grid.repeats)
        head.append([t, f, fb])
    memory = measure_memory(harness, grid.token_buckets) if harness.sp == 1 else []

    init, update = harness.optimizer_program()
    params = jax.tree.map(jnp.copy, harness.params)
    opt_state = init(params)
    grads = harness.zeros_like_params()

    def opt_once():
        nonlocal params, opt_state
        params, opt_state = update(params, opt_state, grads)
        return params

    optimizer_s = time_call(opt_once, repeats=grid.repeats)
    calibration = measure_calibration(harness, grid.calibration, grid.repeats)
    return {
        "raw": samples.raw,
        "dual_layers": list(dual_layers(harness.cfg.num_layers)),
        "head": head,
        "memory": memory,
        "m_token": fit_memory(memory).get("m_token") if memory else None,
        "optimizer_s": optimizer_s,
        "calibration": calibration,
        "repeats": grid.repeats,
        "token_buckets": list(harness.token_buckets),
        "context_buckets": list(harness.context_buckets),
        "sp": harness.sp,
        "clock_divisor": per_device_divisor(harness.sp),
    }


def fit_profile(report: dict, shape: ModelShape, base: CostCoefficients) -> CostCoefficients:
    """Coefficients from a :func:`measure_profile` report (pure numpy; re-runnable on saved reports).

    Forward, forward+backward and forward+backward-with-remat layer programs are fitted with
    :func:`fit_layer_programs`; backward = (fwd+bwd) − fwd, recompute = (remat) − (fwd+bwd), term
    by term. The head is fitted on its own; whole-model chunk steps on the calibration chunks then
    rescale the attention terms and, per token bucket, the token terms (which also absorb the
    per-chunk constant: embedding, accumulation, dispatch; with sp > 1 the gradient all-reduce over
    the sp group) into ``bucket_token_scale`` (:func:`jvarlen.plan.cost_fit.fit_in_situ_scales`);
    the optimizer update is ``step_overhead``. ``report["sp_reports"]`` (``{"2": report, ...}``, from
    ``ChunkHarness(sp=2)``) gives the per-degree coefficients the same way; the sp = 1 fit does not
    depend on them. Memory coefficients come from the sp = 1 report only.
    """
    c0 = base.replace(token_buckets=tuple(report["token_buckets"]), attention_block=_attention_block())
    terms = fit_time_terms(report, shape, c0, 1)
    bucket_scale = {1: terms.pop("bucket_token_scale")}
    mem = fit_memory(report["memory"]) if report.get("memory") else {}
    if mem:
        report["memory_fit"] = mem
    per_sp, rec_sp, head_sp, over_sp = {}, {}, {}, {}
    for key, sub in sorted(report.get("sp_reports", {}).items()):
        sp = int(key)
        t = fit_time_terms(sub, shape, c0, sp)
        bucket_scale[sp] = t.pop("bucket_token_scale")
        per_sp[sp] = (t["fwd"], t["bwd"])
        if t["recompute"] is not None:
            rec_sp[sp] = t["recompute"]
        head_sp[sp] = (t["head_fwd"], t["head_bwd"])
        over_sp[sp] = t["step_overhead"]
    return c0.replace(
        **terms,
        m_token=mem.get("m_token") or report.get("m_token") or c0.m_token,
        m_work_token=mem.get("m_work_token", c0.m_work_token),
        m_work_remat_token=mem.get("m_work_remat_token", c0.m_work_remat_token),
        per_sp=per_sp,
        recompute_per_sp=rec_sp,
        head_per_sp=head_sp,
        step_overhead_per_sp=over_sp,
        bucket_token_scale={k: v for k, v in bucket_scale.items() if v},
    )


def _in_situ_text(report: dict) -> str:
    f = report.get("in_situ", {})
    tokens = " ".join(f"{b}:x{v:.3f}" for b, v in f.get("bucket_token_scale", {}).items())
    return f"pairs x{f.get('pairs_scale', 1):.3f} tokens {tokens or 'x1'} chunk {f.get('chunk_constant_s', 0):+.2e} s"


def profile_meta(shape: ModelShape, report: dict) -> ProfileMeta:
    dev = jax.devices()[0]
    return ProfileMeta(
        model_key=shape.key(),
        backend=jax.default_backend(),
        device_kind=dev.device_kind,
        analytic=False,
        source=f"jvarlen.profile dual-layer {report['dual_layers']} grid: {len(report['raw'])} chunks, "
        f"min of {report['repeats']}, joint NNLS; in situ {_in_situ_text(report)}; "
        + "".join(
            f"sp={k}: {len(r['raw'])} chunks, Ulysses all-to-all inside per_sp, clock / {r.get('clock_divisor', 1)}, in situ {_in_situ_text(r)}; "
            for k, r in sorted(report.get("sp_reports", {}).items())
        )
        + f"jax {jax.__version__}",
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def _attention_block() -> int:
    """Tile size of the block-skipping attention kernel (the kernels' default BlockSizes)."""
    from jvarlen.kernels.common import BlockSizes

    return BlockSizes().block_q


def _default_base(model_cfg: ModelConfig) -> CostCoefficients:
    """Non-measured fields for a single-host CPU/GPU run: no interconnect model, budget from the
    device when it reports one."""
    from jvarlen.model.transformer import resolve_compute_dtype
    from jvarlen.plan.hardware import activation_bytes_per_token

    shape = ModelShape.from_config(model_cfg)

    budget = 16e9
    try:
        stats = jax.devices()[0].memory_stats()
        if stats and "bytes_limit" in stats:
            budget = float(stats["bytes_limit"]) * 0.9
    except Exception:  # noqa: BLE001 - CPU has no memory_stats
        pass
    e = resolve_compute_dtype(model_cfg.compute_dtype).itemsize
    return CostCoefficients(
        fwd=LayerTime(),
        m_token=activation_bytes_per_token(shape, e),
        m_head_token=(e + 4.0) * shape.vocab_size,  # logits (compute dtype) + fp32 log-softmax
        # The layer concatenates cached and own K/V before attention and autodiff keeps the
        # concatenation: 2 · e · kv_dim bytes per context token per stored layer; while a layer's
        # backward runs, the concatenation's cotangent and the context gradient cut from it.
        m_context_token=2.0 * e * shape.kv_dim,
        m_work_context_token=2.0 * 2.0 * e * shape.kv_dim,
        bytes_per_element=e,
        master_bytes_per_param=12.0,
        stage_bytes_per_param=6.0,
        memory_budget=budget,
        gpus_per_node=max(1, jax.local_device_count()),
    )


def enable_compilation_cache(path: Optional[str]) -> None:
    from jvarlen.runtime.step_cache import enable_persistent_cache

    enable_persistent_cache(path)


def run_profiler(cfg) -> str:
    """Entry of ``python -m jvarlen.profile`` (``cfg``: :class:`jvarlen.profile.ProfileConfig`).
    Returns the path of the saved (or reused) profile."""
    import json
    import os

    from tqdm import tqdm

    from jvarlen.config import ModelConfig, load_config
    from jvarlen.plan.cost import profile_filename

    enable_compilation_cache(cfg.compilation_cache)
    model_cfg = load_config(cfg.config).model if cfg.config else ModelConfig()
    shape = ModelShape.from_config(model_cfg)
    dev = jax.devices()[0]
    path = os.path.join(cfg.out_dir, profile_filename(shape, jax.default_backend(), dev.device_kind))
    if cfg.refit_from:
        refit_profile(cfg.refit_from, model_cfg, path)
        return path
    if os.path.exists(path) and not cfg.force and not cfg.extend_report:
        return path

    def measure(sp: int, grid: ProfileGrid) -> dict:
        harness = ChunkHarness(model_cfg, token_buckets=grid.token_buckets, context_buckets=grid.context_buckets, sp=sp)
        n_pairs = len(grid.token_buckets) * len(grid.context_buckets)
        with tqdm(total=n_pairs, desc=f"profiling sp={sp} (token, context) buckets", unit="bucket") as bar:

            def progress(done, total, key):
                bar.set_postfix_str(f"T={key[0]} C={key[1]}")
                bar.update(1)

            return measure_profile(harness, grid, progress=progress)

    if cfg.extend_report:
        with open(cfg.extend_report) as f:
            report = json.load(f)
        if cfg.recalibrate:
            for sp, sub in [(1, report)] + [(int(k), v) for k, v in sorted(report.get("sp_reports", {}).items())]:
                harness = ChunkHarness(
                    model_cfg, token_buckets=sub["token_buckets"], context_buckets=sub["context_buckets"], sp=sp
                )
                with tqdm(total=cfg.repeats, desc=f"calibrating sp={sp}", unit="round") as bar:
                    sub["calibration"] = measure_calibration(
                        harness, ProfileGrid().calibration, cfg.repeats, progress=lambda done, total: bar.update(1)
                    )
    else:
        report = measure(1, ProfileGrid(repeats=cfg.repeats))
    for sp in sorted(set(cfg.sp) - {1}):
        if str(sp) not in report.get("sp_reports", {}):
            report.setdefault("sp_reports", {})[str(sp)] = measure(
                sp, dataclasses.replace(SP_GRID, repeats=cfg.repeats)
            )
    _fit_and_save(report, model_cfg, path)
    with open(path.replace(".json", ".report.json"), "w") as f:
        json.dump(report, f, indent=1)
    return path


def refit_profile(
    report_path: str, model_cfg: ModelConfig, out_path: str, base: Optional[CostCoefficients] = None
) -> CostCoefficients:
    """Re-fits a profile from a saved report (``*.report.json``) without measuring again."""
    import json

    with open(report_path) as f:
        report = json.load(f)
    return _fit_and_save(report, model_cfg, out_path, base)


def _fit_and_save(
    report: dict, model_cfg: ModelConfig, path: str, base: Optional[CostCoefficients] = None
) -> CostCoefficients:
    """:func:`fit_profile` with :func:`profile_meta`, saved as the profile JSON ``path``."""
    shape = ModelShape.from_config(model_cfg)
    coeffs = fit_profile(report, shape, base or _default_base(model_cfg))
    coeffs = coeffs.replace(meta=profile_meta(shape, report))
    coeffs.save(path)
    return coeffs
