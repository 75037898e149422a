"""The pipeline benchmark's policies part, apart from the executor: the batches, the shipped CPU
profile, every policy's plan of a batch, and earlier runs' files read back (``--runs``). Imported
by ``bench_pipeline.py``; numpy and the planner, JAX only where a cost model needs a stored
layer's bytes."""

from __future__ import annotations

import dataclasses
import glob
import json
from typing import Optional

import numpy as np

from jvarlen.layout import Layout
from jvarlen.plan import schedule as sch


def shipped_profile(cfg) -> Optional[str]:
    """Path of the shipped CPU profile of ``cfg``'s shape (None if there is none)."""
    from jvarlen.plan.cost import ModelShape
    from jvarlen.runtime.cost_check import PACKAGE_PROFILES

    found = sorted(glob.glob(f"{PACKAGE_PROFILES}/{ModelShape.from_config(cfg).key()}__cpu__*[!t].json"))
    return found[0] if found else None


POLICIES_RUN = ("epp", "seq1f1b", "dapple", "gpipe", "epp-ticks")
POLICY_LABEL = {
    "epp": "EPP (paired-tick planner)",
    "seq1f1b": "Seq1F1B (fixed chunks, uniform recomputation for the reference context)",
    "dapple": "DAPPLE (whole documents, 1F1B)",
    "gpipe": "GPipe (DAPPLE's micro-batches, all forwards first)",
    "epp-ticks": "EPP planned for one op per tick (GPipe order where that looked faster)",
}


def long_tailed_batch(seed: int, workload: str, tokens: int, context: int, scale: int) -> list[int]:
    """Document lengths of one batch: a shipped workload's lengths divided by ``scale`` (8K -> 512
    tokens at 16) and truncated to ``context``, drawn until ``tokens`` tokens."""
    from jvarlen.plan.workloads import MIXTURES

    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < tokens:
        n = int(np.clip(MIXTURES[workload].sample(1, rng)[0] // scale, 8, context))
        out.append(n)
        total += n
    return out


RESIDUAL_POLICY = "dots_and_attention"  # what the benchmark's stored layers keep


def policy_cost(args, cfg):
    """The shipped CPU profile of ``cfg``'s shape on Layout(1, pp, 1), with ``--budget-mb``, and the
    executor's stored residual bytes where the profile lacks them."""
    from jvarlen.parallel.pipeline.stage import stored_token_bytes
    from jvarlen.plan.cost import CostCoefficients, CostModel, ModelShape

    shape = ModelShape.from_config(cfg)
    path = args.profile or shipped_profile(cfg)
    if path is None:
        raise SystemExit(f"no shipped CPU profile for {shape.key()}: pass --profile")
    coeffs = CostCoefficients.load(path)
    if not coeffs.m_stored_token:
        coeffs = coeffs.replace(m_stored_token=stored_token_bytes(cfg, RESIDUAL_POLICY))
    if args.budget_mb:
        coeffs = coeffs.replace(memory_budget=args.budget_mb * 1e6)
    return CostModel(shape, Layout(1, args.pp, 1), coeffs), path


def plan_policies(lengths, cost, args, policies) -> dict:
    """{policy: Plan}, every plan's prediction in the executor's model (paired ticks); a policy that
    cannot plan the batch is left out (with its reason printed). CP-SAT stops
    on its deterministic limit only (``deterministic_options``): with the default 0.05 s wall-clock
    limit, seeds 150 and 151 at 60 MB gave one of two EPP plans (3.536 or 3.624 s; 4.031 or 4.203
    s) depending on the machine's load, in the same planning time (0.1-0.3 s)."""
    from jvarlen.plan.api import PlannerOptions, PlanningError, plan_iteration
    from jvarlen.plan.assemble import record_simulation, simulate
    from jvarlen.plan.service import deterministic_options

    options = deterministic_options(
        PlannerOptions(
            min_slice_tokens=args.min_slice,
            simulation="paired",
            seq1f1b_chunk_tokens=args.seq1f1b_chunk,
            seq1f1b_reference_context=args.reference_context,
        )
    )
    plans = {}
    for policy in policies:
        if policy == "gpipe":  # DAPPLE's micro-batches in GPipe order, least uniform recomputation that fits
            d = plans.get("dapple") or plan_iteration(lengths, cost=cost, policy="dapple", options=options)
            order = sch.gpipe(d.n_chunks, cost.layout.pp, d.schedule.chunk_prev, d.schedule.chunk_docs)
            for layers in range(cost.layers_per_stage + 1):
                ckpt = np.full_like(np.asarray(d.ckpt_layers), layers)
                plan = dataclasses.replace(d, policy="gpipe", schedule=order, ckpt_layers=ckpt, stats=dict(d.stats))
                if simulate(plan, cost, "paired").fits:
                    break
        elif policy == "epp-ticks":
            plan = plan_iteration(
                lengths, cost=cost, policy="epp", options=dataclasses.replace(options, simulation="ticks")
            )
            plan = dataclasses.replace(plan, policy="epp-ticks", stats=dict(plan.stats))
        else:
            try:
                plan = plan_iteration(lengths, cost=cost, policy=policy, options=options)
            except PlanningError as e:  # the batch does not fit this policy's plans: the others still run
                print(f"{policy}: cannot plan this batch: {e}", flush=True)
                continue
        record_simulation(plan, cost, "paired")
        plans[policy] = plan
    return plans


def batch_documents(lengths, vocab: int, seed: int) -> list:
    rng = np.random.default_rng(10_000 + seed)
    return [rng.integers(1, vocab, size=n).astype(np.int32) for n in lengths]


REFERENCE_KEY = "_reference_probe_s"  # in the times JSON: worker 0's probe readings, one list per round


def reference_matches(cost) -> bool:
    """Whether this process's reference probe is the one whose reading ``cost``'s profile holds."""
    from jvarlen.profile.harness import REFERENCE_PROBE

    meta = cost.coeffs.meta
    return bool(meta.reference_s) and meta.model_key == cost.model.key() and meta.reference_probe == REFERENCE_PROBE


def profile_clock_scale(spec: dict, times: dict) -> float:
    """Factor that converts this run's measured seconds to the profile's (reference units,
    :func:`jvarlen.profile.clock.to_profile_clock`); 1.0 when the profile or the run has no reading."""
    from jvarlen.profile.clock import to_profile_clock
    from jvarlen.profile.harness import reference_seconds

    if not (spec.get("reference_s") and times.get(REFERENCE_KEY)):
        return 1.0
    return to_profile_clock(1.0, reference_seconds(times[REFERENCE_KEY]), spec["reference_s"])


def budget_cost(spec: dict, plan, costs: dict, profile: str):
    """The cost model of ``profile`` for ``spec``'s model at ``plan``'s memory budget, memoised in
    ``costs`` by budget (a spec's plans share one or two)."""
    import argparse

    from jvarlen.config import ModelConfig

    budget = plan.memory_budget_bytes / 1e6 if plan.memory_budget_bytes else 0.0
    if budget not in costs:
        ns = argparse.Namespace(profile=profile, budget_mb=budget, pp=spec["pp"])
        costs[budget] = policy_cost(ns, ModelConfig(**spec["model"]))[0]
    return costs[budget]


def check_units(runs: list[tuple[dict, dict]], cost, path: str) -> None:
    """Refuses runs whose steps were converted to another profile's clock than ``cost``'s (another
    reference reading or probe residual policy): fitting or scoring them against ``cost`` would
    compare seconds of two clocks. ``--parts retime --profile`` times such plans again on this one."""
    meta = cost.coeffs.meta
    for spec, _ in runs:
        theirs = (spec.get("reference_s") or 0.0, spec.get("probe_residual_policy", "all"))
        if not (theirs[0] and meta.reference_s):
            continue
        if not np.isclose(theirs[0], meta.reference_s, rtol=1e-9) or theirs[1] != meta.profiled_residual_policy:
            raise SystemExit(
                f"the run of {spec['profile']} was timed against its probe reading {theirs[0]:.4f} s "
                f"({theirs[1]} layers), {path} reads {meta.reference_s:.4f} s ({meta.profiled_residual_policy}): "
                "its steps are on another clock; time its plans again with --parts retime --profile "
                f"{path}"
            )


def adopt_profile(spec: dict, path: str) -> None:
    """Re-aims an earlier run's ``spec`` at the profile at ``path`` before its plans are timed
    again: the probe reading and probe policy the steps are converted with become that profile's,
    and every plan's prediction is simulated again with it (each at its own memory budget). The
    plans (chunks, schedule, recomputation) stay as they were planned."""
    from jvarlen.plan.assemble import record_simulation
    from jvarlen.plan.plan import Plan

    costs: dict = {}
    for batch in spec["batches"]:
        for policy, plan_json in batch["plans"].items():
            plan = Plan.from_json(plan_json)
            record_simulation(plan, budget_cost(spec, plan, costs, path), "paired")
            batch["plans"][policy] = plan.to_json()
    cost = next(iter(costs.values()))
    spec["adopted_from"] = spec["profile"]
    spec["profile"] = path
    spec["reference_s"] = cost.coeffs.meta.reference_s if reference_matches(cost) else 0.0
    spec["probe_residual_policy"] = cost.coeffs.meta.profiled_residual_policy


def load_runs(paths: str) -> list[tuple[dict, dict]]:
    """(spec, times) of earlier ``--parts policies|overheads`` runs: their comma-separated
    ``.spec.json`` files, each with its ``.times.json`` beside it."""
    runs = []
    for spec_path in paths.split(","):
        with open(spec_path) as f:
            spec = json.load(f)
        with open(spec_path.replace(".spec.json", ".times.json")) as f:
            runs.append((spec, json.load(f)))
    return runs


def timed_steps(runs: list[tuple[dict, dict]]):
    """Every timed step of ``runs`` ((spec, times) pairs): (key, plan, tick table, median measured
    seconds on the profile's clock)."""
    from jvarlen.plan.plan import Plan

    for spec, times in runs:
        scale = profile_clock_scale(spec, times)
        for b in spec["batches"]:
            for policy, plan_json in b["plans"].items():
                for table in spec["tables"]:
                    key = f"{b['seed']}/{policy}/{table}"
                    if key in times:
                        yield key, Plan.from_json(plan_json), table, float(np.median(times[key]["times"])) * scale


def add_recompute_variants(spec: dict) -> None:
    """Beside every plan of ``spec`` that recomputes nothing, the same plan with every layer
    recomputed (``<policy>+remat``: the same chunks, schedule and tick table, predicted with the
    spec's profile): pairs of steps that differ in their recomputation only, which a fit of the
    executor's terms can tell from the terms that grow with the ticks and buffers (otherwise the
    steps that recompute are those with long contexts, and the fit gives one the other's cost)."""
    from jvarlen.plan.assemble import record_simulation
    from jvarlen.plan.plan import Plan

    costs: dict = {}  # by budget: the spec's plans share one or two
    for batch in spec["batches"]:
        for policy, plan_json in list(batch["plans"].items()):
            plan = Plan.from_json(plan_json)
            layers = np.asarray(plan.ckpt_layers)
            if layers.any():
                continue
            cost = budget_cost(spec, plan, costs, spec["profile"])
            full = np.full_like(layers, cost.layers_per_stage)
            variant = dataclasses.replace(plan, policy=f"{policy}+remat", ckpt_layers=full, stats={})
            record_simulation(variant, cost, "paired")
            batch["plans"][variant.policy] = variant.to_json()
