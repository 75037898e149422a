"""What the profiler measures: the dual-layer grid of chunks (DCP §3.5), the head, the optimizer,
memory of compiled programs, all-to-all links and whole-model calibration steps (see
:mod:`jvarlen.profile.harness` for how chunks run)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape
from jvarlen.profile.harness import (
    ChunkHarness,
    chunk_step_timer,
    clock_name,
    per_device_divisor,
    time_call,
)


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
    # Rounds of the whole-model calibration steps. They set the profile's scale and its reference
    # reading (jvarlen.profile.clock); a 512-token step varies ~10 % between rounds
    calibration_rounds: int = 20
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


def fit_memory(rows: Sequence[dict]) -> dict[str, float]:
    """Per-token memory coefficients from :func:`measure_memory` rows (least squares).

    Without recomputation ``temp = n·m_token·T + m_work_token·T + c``; with all ``n`` layers
    recomputed ``temp = n·m_ckpt_token·T + m_work_remat_token·T + c'``. ``m_token`` is Eq. 5's
    stored activations per layer and token; ``m_ckpt_token`` is Eq. 9's checkpoint (the layer
    input, ``e·D`` for a tail chunk; returned for checking, the model uses ``e·D``); the
    ``m_work*`` slopes are the working memory of the backward in flight.

    Rows of a chunk after ``C`` context tokens (no recomputation) give ``m_context_token``: what a
    stored layer keeps per context token, the difference of the per-layer slopes (over the layer
    counts) of that chunk and of the same token count without context, divided by ``C`` (clipped
    at 0). With every residual kept it is the concatenated ``[cached; own]`` K/V that attention
    reads; a policy that saves matmul and attention outputs rebuilds it from the cache.
    """
    out = {}
    for remat, (slope, work) in ((False, ("m_token", "m_work_token")), (True, ("m_ckpt_token", "m_work_remat_token"))):
        sel = [r for r in rows if r["context"] == 0 and (r["remat"] > 0) == remat]
        if not sel:
            continue
        x = np.array([[r["layers"] * r["tokens"], r["tokens"], 1.0] for r in sel], float)
        y = np.array([r["temp"] for r in sel], float)
        theta, *_ = np.linalg.lstsq(x, y, rcond=None)
        out[slope], out[work] = float(theta[0]), float(theta[1])

    def per_layer(tokens: int, context: int) -> Optional[float]:
        sel = [r for r in rows if (r["tokens"], r["context"], r["remat"]) == (tokens, context, 0)]
        if len({r["layers"] for r in sel}) < 2:
            return None
        return float(np.polyfit([r["layers"] for r in sel], [r["temp"] for r in sel], 1)[0])

    extra = []
    for tokens, context in sorted({(r["tokens"], r["context"]) for r in rows if r["context"] > 0}):
        with_context, without = per_layer(tokens, context), per_layer(tokens, 0)
        if with_context is not None and without is not None:
            extra.append(max(0.0, (with_context - without) / context))
    if extra:
        out["m_context_token"] = float(np.mean(extra))
    return out


def measure_memory(harness: ChunkHarness, tokens: Sequence[int], progress: Optional[Callable] = None) -> list[dict]:
    """``memory_analysis()`` of the forward+backward layer programs (compiled, not run) over
    (tokens ∈ ``tokens``, context 0, layer counts :func:`memory_layer_counts`, recomputation of
    none or all layers), and of the smallest token count after the harness's smallest context
    bucket without recomputation (what a stored layer keeps per context token:
    :func:`fit_memory`'s ``m_context_token``). Rows: ``{tokens, context,
    layers, remat, temp, argument, output, alias}``; empty when the backend reports nothing."""
    rows = []
    contexts = [c for c in harness.context_buckets if c > 0][:1]
    cases = [ChunkShape(0, (t,)) for t in tokens] + [ChunkShape(c, (min(tokens),), tail=False) for c in contexts]
    for chunk in cases:
        batch = harness.layer_inputs(chunk)
        for n in memory_layer_counts(harness.cfg.num_layers):
            for remat in (0, n) if chunk.context == 0 else (0,):
                stats = program_memory(harness.layers_program(n, "fwdbwd", remat), harness.params, batch)
                if stats is None:
                    return []
                rows.append(dict(tokens=chunk.tokens, context=chunk.context, layers=n, remat=remat, **stats))
        if progress:
            progress(chunk.tokens)
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
    round_of_steps = chunk_step_timer(harness, chunks)  # compiles every bucket pair first
    best = [float("inf")] * len(chunks)
    for r in range(repeats):
        best = [min(b, t) for b, t in zip(best, round_of_steps())]
        if progress:
            progress(r + 1, repeats)
    return [[[c.context, list(c.slices), c.tail], t] for c, t in zip(chunks, best)]


def measure_profile(
    harness: ChunkHarness,
    grid: ProfileGrid = ProfileGrid(),
    progress: Optional[Callable] = None,  # noqa: B008
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
    calibration = measure_calibration(harness, grid.calibration, grid.calibration_rounds)
    return {
        "raw": samples.raw,
        "dual_layers": list(dual_layers(harness.cfg.num_layers)),
        "head": head,
        "memory": memory,
        "m_token": fit_memory(memory).get("m_token") if memory else None,
        "optimizer_s": optimizer_s,
        "calibration": calibration,
        "repeats": grid.repeats,
        "calibration_rounds": grid.calibration_rounds,
        "token_buckets": list(harness.token_buckets),
        "context_buckets": list(harness.context_buckets),
        "sp": harness.sp,
        "residual_policy": harness.residual_policy,
        "clock_divisor": per_device_divisor(harness.sp),
        "clock": clock_name(),
    }
