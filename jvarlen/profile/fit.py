"""From measurements to a saved profile: the fit (jvarlen.plan.cost_fit), its metadata, and the
entry of ``python -m jvarlen.profile`` (measure or refit, save the JSON and its report)."""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from typing import Optional

import jax

from jvarlen.config import ModelConfig
from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostCoefficients, LayerTime, ModelShape, ProfileMeta
from jvarlen.plan.cost_fit import fit_time_terms
from jvarlen.plan.json_file import write_json
from jvarlen.profile.harness import REFERENCE_CHUNKS, REFERENCE_PROBE, ChunkHarness
from jvarlen.profile.measure import SP_GRID, ProfileGrid, fit_memory, measure_calibration, measure_profile


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
        m_context_token=mem.get("m_context_token", c0.m_context_token),
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
    reference = reference_reading(report)
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
        reference_s=reference,
        reference_probe=REFERENCE_PROBE if reference else "",
        reference_calls=int(report.get("calibration_rounds", 0)) if reference else 0,
        residual_policy=report_residual_policy(report),
    )


def report_residual_policy(report: dict) -> str:
    """What the report's layers kept for their backward; reports from before it was recorded
    profiled plain-autodiff layers (``"all"``)."""
    return report.get("residual_policy", "all")


def reference_reading(report: dict) -> float:
    """The sp = 1 calibration's reading of the reference probe: the sum of its chunks' readings
    (raw clock seconds, each the minimum over the rounds; the sp = 1 clock divisor is 1), 0.0 when
    the report did not time all of them."""
    timed = {
        ChunkShape(ctx, tuple(slices), bool(tail)): sec for (ctx, slices, tail), sec in report.get("calibration", [])
    }
    if not all(c in timed for c in REFERENCE_CHUNKS):
        return 0.0
    return float(sum(timed[c] for c in REFERENCE_CHUNKS))


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
    # the stage's copy is in the compute dtype, its gradient accumulator in the parameters' (fp32 at least)
    accumulator = max(4, resolve_compute_dtype(model_cfg.param_dtype).itemsize)
    return CostCoefficients(
        fwd=LayerTime(),
        m_token=activation_bytes_per_token(shape, e),
        m_head_token=(4.0 + e) * shape.vocab_size,  # a tile's fp32 logits + their gradient, per row
        # The layer concatenates cached and own K/V before attention and plain autodiff keeps the
        # concatenation: 2 · e · kv_dim bytes per context token per stored layer (the memory grid
        # measures it under the run's policy); while a layer's backward runs, the concatenation's
        # cotangent and the context gradient cut from it.
        m_context_token=2.0 * e * shape.kv_dim,
        m_work_context_token=2.0 * 2.0 * e * shape.kv_dim,
        bytes_per_element=e,
        dkv_bytes_per_element=e,  # the executor's dK/dV pools: the compute dtype
        master_bytes_per_param=12.0,
        stage_bytes_per_param=float(e + accumulator),
        memory_budget=budget,
        gpus_per_node=max(1, jax.local_device_count()),
    )


def enable_compilation_cache(path: Optional[str]) -> None:
    from jvarlen.runtime.compile_cache import enable_persistent_cache

    enable_persistent_cache(path)


def run_profiler(cfg) -> str:
    """Entry of ``python -m jvarlen.profile`` (``cfg``: :class:`jvarlen.profile.ProfileConfig`).
    Returns the path of the saved (or reused) profile."""
    import json

    from tqdm import tqdm

    from jvarlen.config import Config, load_config
    from jvarlen.plan.cost import profile_filename

    enable_compilation_cache(cfg.compilation_cache)
    run_cfg = load_config(cfg.config) if cfg.config else Config()
    model_cfg, residual = run_cfg.model, run_cfg.parallel.residual_policy
    shape = ModelShape.from_config(model_cfg)
    dev = jax.devices()[0]
    path = os.path.join(cfg.out_dir, profile_filename(shape, jax.default_backend(), dev.device_kind))
    if cfg.refit_from:
        if os.path.exists(path) and not cfg.force:
            raise FileExistsError(f"{path} exists; pass --force true to replace it with the refit of {cfg.refit_from}")
        refit_profile(cfg.refit_from, model_cfg, path)
        return path
    if os.path.exists(path) and not cfg.force and not cfg.extend_report:
        try:
            saved = CostCoefficients.load(path)
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(
                f"{path} exists but cannot be read ({error!r:.120}); --force true measures it again"
            ) from None
        measured = saved.meta is not None and not saved.meta.analytic
        profiled = saved.meta.profiled_residual_policy if measured else residual or "all"
        if profiled != (residual or "all"):  # one file name for every policy: not this config's
            raise ValueError(
                f"{path} timed layers keeping residual_policy {profiled!r}, the config's keep {residual!r}; "
                "--force true measures it again (replacing it), or choose another --out_dir"
            )
        print(f"[jvarlen] reusing the profile {path} (--force true measures it again)", file=sys.stderr)
        return path

    def measure(sp: int, grid: ProfileGrid) -> dict:
        harness = ChunkHarness(
            model_cfg, token_buckets=grid.token_buckets, context_buckets=grid.context_buckets, sp=sp, residual=residual
        )
        n_pairs = len(grid.token_buckets) * len(grid.context_buckets)
        with tqdm(total=n_pairs, desc=f"profiling sp={sp} (token, context) buckets", unit="bucket") as bar:

            def progress(done, total, key):
                bar.set_postfix_str(f"T={key[0]} C={key[1]}")
                bar.update(1)

            return measure_profile(harness, grid, progress=progress)

    if cfg.extend_report:
        with open(cfg.extend_report) as f:
            report = json.load(f)
        check_report(report, shape, cfg.extend_report, residual)
        if cfg.recalibrate:
            for sp, sub in [(1, report)] + [(int(k), v) for k, v in sorted(report.get("sp_reports", {}).items())]:
                harness = ChunkHarness(
                    model_cfg,
                    token_buckets=sub["token_buckets"],
                    context_buckets=sub["context_buckets"],
                    sp=sp,
                    residual=residual,
                )
                rounds = cfg.calibration_rounds
                with tqdm(total=rounds, desc=f"calibrating sp={sp}", unit="round") as bar:
                    sub["calibration"] = measure_calibration(
                        harness, ProfileGrid().calibration, rounds, progress=lambda done, total: bar.update(1)
                    )
                sub["calibration_rounds"] = rounds
    else:
        report = measure(1, ProfileGrid(repeats=cfg.repeats, calibration_rounds=cfg.calibration_rounds))
    for sp in sorted(set(cfg.sp) - {1}):
        if str(sp) not in report.get("sp_reports", {}):
            report.setdefault("sp_reports", {})[str(sp)] = measure(
                sp, dataclasses.replace(SP_GRID, repeats=cfg.repeats, calibration_rounds=cfg.calibration_rounds)
            )
    report.update(model_key=shape.key(), backend=jax.default_backend())
    # the measurements first: a fit that fails loses nothing (``--refit_from`` fits them again)
    write_json(path.replace(".json", ".report.json"), report, sort_keys=False)  # whole or not replaced
    _fit_and_save(report, model_cfg, path)
    return path


def refit_profile(
    report_path: str, model_cfg: ModelConfig, out_path: str, base: Optional[CostCoefficients] = None
) -> CostCoefficients:
    """Re-fits a profile from a saved report (``*.report.json``) without measuring again."""
    import json

    with open(report_path) as f:
        report = json.load(f)
    check_report(report, ModelShape.from_config(model_cfg), report_path)
    return _fit_and_save(report, model_cfg, out_path, base)


def check_report(report: dict, shape: ModelShape, where: str, residual: Optional[str] = None) -> None:
    """A file that is not a report (before: it replaced the saved report, then the fit failed), or a
    saved report that measured another model shape or backend, or (``residual`` given) layers under
    another residual policy: refused (its numbers would be saved as this model's, or mixed with
    timings of other layers). Reports from before the model keys were recorded are taken as they
    are."""
    import jax

    if not isinstance(report, dict) or not {"token_buckets", "context_buckets"} <= report.keys():
        raise ValueError(f"{where} is not a profile report of python -m jvarlen.profile (no token/context buckets)")
    mine = (shape.key(), jax.default_backend())
    theirs = (report.get("model_key", mine[0]), report.get("backend", mine[1]))
    if theirs != mine:
        raise ValueError(f"{where} was measured for {theirs[0]} on {theirs[1]}, not this {mine[0]} on {mine[1]}")
    if residual is not None and report_residual_policy(report) != residual:
        raise ValueError(
            f"{where} profiled layers under residual_policy {report_residual_policy(report)!r}, this run's "
            f"parallel.residual_policy is {residual!r}: profile again (--force true) or run with the report's policy"
        )


def _fit_and_save(
    report: dict, model_cfg: ModelConfig, path: str, base: Optional[CostCoefficients] = None
) -> CostCoefficients:
    """:func:`fit_profile` with :func:`profile_meta`, saved as the profile JSON ``path``."""
    shape = ModelShape.from_config(model_cfg)
    coeffs = fit_profile(report, shape, base or _default_base(model_cfg))
    coeffs = coeffs.replace(meta=profile_meta(shape, report))
    coeffs.save(path)
    return coeffs
