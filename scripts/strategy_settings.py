"""The strategy benchmarks' settings and building blocks: the settings (workload, model, cluster,
devices, tokens per iteration, context), their cost models, corpora drawn from the shipped
workloads, token-budget batches and one planned batch as a record.

Shared by ``scripts/bench_strategies.py`` (its tables), ``scripts/bench_auto.py`` (its ``auto``
parts) and the checks that replay the benchmark's batches (``group_time_check.py``,
``pipeline_cut_ranking.py``, ``stage_weights_choice.py``, ``sp_planning_time.py``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jvarlen.config import load_config  # noqa: E402
from jvarlen.layout import Layout  # noqa: E402
from jvarlen.plan.api import PlanningError, make_cost  # noqa: E402
from jvarlen.plan.cost import CostModel, ModelShape  # noqa: E402
from jvarlen.plan.hardware import CLUSTERS  # noqa: E402
from jvarlen.plan.hydraulis import HydraulisOptions  # noqa: E402
from jvarlen.plan.strategy import SchemeCosts, plan_strategy  # noqa: E402
from jvarlen.plan.workloads import MIXTURES, stdlib_lengths  # noqa: E402

K = 1024

# LLaMA-33B-like shape for Hydraulis' 32B runs (the paper does not give its shape): 60 layers, 52 heads
LLAMA_32B = ModelShape(60, 6656, 52, 52, 128, 17920, 32000, tie_embeddings=False)
# Hydraulis §8.1: 8 x A800 per node, NVLink 400 GB/s, InfiniBand 200 GB/s per node
A800_HYDRAULIS = dataclasses.replace(CLUSTERS["a800"], name="a800-ib200", network_bandwidth_per_node=200e9)


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    workload: str
    model: str
    cluster: str
    devices: int
    tokens: int
    context: int
    half_rows: float = 0.0
    overlap: bool = False  # pull/push hidden behind propagation (Hydraulis §5.3 subgraph scheduling): no sync cost
    # decoder layers sharded over each stage's devices (parallel.stage_weights="sharded"); replicated,
    # a 32B stage of 64 A800s (pp <= 4: 60 layers) needs 68.5 GiB before any token, over the 67 GiB budget
    sharded_stage_weights: bool = False


def shape(model: str) -> ModelShape:
    if model == "llama-32b":
        return LLAMA_32B
    return ModelShape.from_config(load_config(ROOT / "configs" / f"{model}.yaml").model)


def costs_for(s: Setting) -> SchemeCosts:
    spec = A800_HYDRAULIS if s.cluster == "a800-ib200" else CLUSTERS[s.cluster]
    spec = dataclasses.replace(spec, gemm_half_rows=s.half_rows)
    base = make_cost(shape(s.model), spec, Layout(s.devices, 1, 1))
    coeffs = base.coeffs.replace(sync_bytes_per_param=0.0) if s.overlap else base.coeffs
    base = CostModel(base.model, base.layout, coeffs, stage_weights_sharded=s.sharded_stage_weights)
    return SchemeCosts(base, s.devices)


def corpus(workload: str, context: int, n: int = 100_000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if workload == "stdlib":
        pool = np.asarray(stdlib_lengths())
        x = pool[rng.integers(0, pool.size, n)]
    else:
        x = MIXTURES[workload].sample(n, rng)
    return np.minimum(x, context).astype(np.int64)


def token_batch(pool: np.ndarray, tokens: int, seed: int) -> list[int]:
    """Documents drawn from ``pool`` until the batch holds ``tokens`` tokens (Hydraulis §2.1)."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < tokens:
        x = int(pool[rng.integers(pool.size)])
        out.append(x)
        total += x
    return out


def run_plan(policy: str, lengths, costs, options) -> dict:
    """Plans one batch; the metrics come from the groups, so that every strategy policy reports alike."""
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        plan = plan_strategy(policy, lengths, costs, options)
    except PlanningError as e:
        return {"error": str(e)}
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    summary = plan.group_summary()
    return {
        "iter_s": plan.stats["iteration_time_s"],
        "prop_s": summary["propagation_s"],
        "imbalance": summary["imbalance"],
        "bubble": summary["bubble_ratio"],
        "headroom": 1 - summary["peak_memory_fraction"],
        "fits": summary["fits_memory"],
        "cpu_s": cpu,
        "wall_s": wall,
        "strategy": plan.describe(),
    }


def prepare(options_type, pool, costs, context):
    options = options_type()
    t0 = time.process_time()
    if hasattr(options, "for_corpus"):
        options = options.for_corpus(pool, costs, context)
    return options, time.process_time() - t0


def settings(quick: bool) -> list[Setting]:
    out = []
    for overlap in (False, True):  # the 64 devices / 200K tokens on the shipped workloads
        for wl in ("github", "commoncrawl", "stdlib"):
            for cl in ("h100", "a800"):
                tag = ", pull/push overlapped" if overlap else ""
                out.append(
                    Setting(
                        f"{wl} 7B {cl} 64 dev 200K tok 32K ctx{tag}",
                        wl,
                        "llama-7b",
                        cl,
                        64,
                        200_000,
                        32 * K,
                        0.0,
                        overlap,
                    )
                )
    for wl in ("commoncrawl", "github"):  # Hydraulis §8.2 (F2/F3: 32K context, 100K tokens per iteration)
        for model, devs in (("llama-7b", (8, 16)), ("llama-13b", (16, 32)), ("llama-32b", (32, 64))):
            for n in devs:
                sharded = model == "llama-32b"
                name = f"{wl} {model[6:].upper()} a800-ib200 {n} dev 100K tok 32K ctx, overlapped"
                name += ", sharded stage weights" if sharded else ""
                out.append(Setting(name, wl, model, "a800-ib200", n, 100_000, 32 * K, 0.0, True, sharded))
    # sensitivity: small GEMMs slower (jvarlen.plan.hardware, Hockney m_half); a longer context
    out.append(
        Setting(
            "commoncrawl 7B h100 64 dev 200K tok, m_half 256, overlapped",
            "commoncrawl",
            "llama-7b",
            "h100",
            64,
            200_000,
            32 * K,
            256.0,
            True,
        )
    )
    out.append(
        Setting(
            "github 7B h100 64 dev 400K tok 128K ctx, overlapped",
            "github",
            "llama-7b",
            "h100",
            64,
            400_000,
            128 * K,
            0.0,
            True,
        )
    )
    return out[:2] if quick else out


def auto_settings() -> list[Setting]:
    """The 64-device settings with pull/push overlapped, where ``auto`` is measured."""
    return [s for s in settings(False) if s.overlap and s.devices == 64]


def auto_setup(setting: Setting):
    """(costs, corpus, per-policy options) of ``setting``: Hydraulis with its corpus proposal."""
    costs = costs_for(setting)
    pool = corpus(setting.workload, setting.context)
    return costs, pool, {"hydraulis": HydraulisOptions().for_corpus(pool, costs, setting.context)}


def plan_record(plan) -> str:
    """The plan as JSON without what the searches record about themselves (candidates simulated or
    skipped, solve times, events): equal records are the same plan."""
    data = plan.to_json()
    for g in data["groups"]:
        g["plan"]["stats"] = {k: v for k, v in g["plan"]["stats"].items() if k == "iteration_time_s"}
        g["plan"]["events"] = []
    return json.dumps(data["groups"], sort_keys=True, default=str)
