"""Planner entry points: ``plan_iteration(lengths, cluster, model, cost, policy=...) -> Plan``.

Policies (all in one framework, InfiniPipe §3 and §5):

=============  ================================================  ==========================
policy         chunking                                          units / recomputation
=============  ================================================  ==========================
``epp``        Alg. 1, N tuned by simulation                     Eq. 14 DP + Alg. 2 MILP
``epp-fast``   Alg. 1, smallest feasible N (no tuning)           Eq. 14 DP + greedy
``wo-wbc``     even split + fixed-length packing, size tuned     Eq. 14 DP + Alg. 2 MILP
``wo-ckpt``    Alg. 1, N tuned                                   Eq. 14 DP, no recomputation
``full-ckpt``  Alg. 1, N tuned                                   Eq. 14 DP, full recomputation
``seq1f1b``    fixed-size slices + packing, fixed size           one unit, uniform for 96K
``seq1f1b-tuned`` same, size tuned per iteration                 one unit, uniform (least fit)
``dapple``     whole documents packed (batch-level)              one unit, uniform (least fit)
=============  ================================================  ==========================

A plan that cannot fit (DAPPLE with a long document, say) is returned with ``stats["fits_memory"]
= False`` and an event; EPP skips such candidates. Under the ``"paired"`` simulation that includes
the executor's buffers (:func:`jvarlen.plan.assemble.fit_executor_memory`). The EPP policies'
search over chunkings is :func:`jvarlen.plan.epp.plan_epp`."""

from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence

from jvarlen.layout import Layout
from jvarlen.plan.assemble import assemble, simulate, uniform_unit
from jvarlen.plan.baselines import dapple_chunks, fixed_size_chunks
from jvarlen.plan.chunk import document_lengths
from jvarlen.plan.cost import CostModel, ModelShape
from jvarlen.plan.epp import group_chunks, plan_epp, refuse_states_over_budget, smallest_slices
from jvarlen.plan.grouping import order_families
from jvarlen.plan.options import LOCKSTEP, SIMULATIONS, PlannerOptions, PlanningError, SlowerThanCeiling
from jvarlen.plan.plan import Plan
from jvarlen.plan.units import families_of

POLICIES = ("epp", "epp-fast", "wo-wbc", "wo-ckpt", "full-ckpt", "seq1f1b", "seq1f1b-tuned", "dapple")
EPP_POLICIES = ("epp", "epp-fast", "wo-ckpt", "full-ckpt")  # the search over N (:func:`jvarlen.plan.epp.plan_epp`)


def make_cost(model, cluster="a800", layout: Layout = Layout(1, 4, 8), zero3_sp: bool = False) -> CostModel:
    """Analytic cost model of ``model`` (ModelShape or ModelConfig) on ``cluster`` (a name or
    a :class:`~jvarlen.plan.hardware.ClusterSpec`, see hardware.py).

    ``zero3_sp``: InfiniPipe's testbed (§3: Ulysses SP "equipped with ZeRO-3 (degree d_s)",
    SP intra-node, PP inter-node, §5.1). The stage's compute parameters and gradient
    accumulators are sharded over its SP group (``stage_bytes_per_param / sp`` per
    device; the gathered layer lives in the profile's workspace), and the end-of-step
    gradient/parameter sync of a stage stays inside that group: over NVLink when the
    group fits in a node (with dp = 1 no parameter or gradient crosses nodes). This shards
    embedding and head too, as InfiniPipe's testbed does; jvarlen's executor shards only the
    decoder layers (``parallel.stage_weights="sharded"``, ``CostModel(stage_weights_sharded=True)``
    models it). Default off: a full stage copy, sync over the slowest link.
    """
    from jvarlen.plan.hardware import CLUSTERS, analytic_coefficients

    shape = model if isinstance(model, ModelShape) else ModelShape.from_config(model)
    spec = CLUSTERS[cluster] if isinstance(cluster, str) else cluster
    nodes = max(1, math.ceil(layout.num_devices / spec.gpus_per_node))
    coeffs = analytic_coefficients(shape, spec, num_nodes=nodes)
    if zero3_sp:
        sync = coeffs.p2p_intra if layout.sp <= spec.gpus_per_node and layout.dp == 1 else coeffs.sync_link
        coeffs = coeffs.replace(stage_bytes_per_param=coeffs.stage_bytes_per_param / layout.sp, sync_link=sync)
    return CostModel(shape, layout, coeffs)


def plan_iteration(
    lengths: Sequence[int],
    cluster=None,
    model=None,
    cost: Optional[CostModel] = None,
    policy: str = "epp",
    options: PlannerOptions = PlannerOptions(),
    layout: Layout = Layout(1, 4, 8),
    progress: Optional[Callable[[str], None]] = None,
    ceiling: Optional[float] = None,
) -> Plan:
    """Plans one iteration over the documents ``lengths`` (tokens each).

    ``progress(message)`` is told of each slice count N the EPP policies simulate (long
    documents make planning take seconds; the CLI shows these). ``ceiling`` (EPP policies only):
    only a plan faster than that many seconds is wanted; the search skips what cannot beat it and
    raises :class:`SlowerThanCeiling` when nothing does (:func:`jvarlen.plan.epp.plan_epp`).

    Either pass ``cost`` (its layout is used) or ``cluster`` + ``model`` (+ ``layout``)
    to build an analytic one. Returns a :class:`Plan` whose ``stats`` hold
    ``solve_seconds``, the simulated ``iteration_time_s``, ``bubble_ratio`` and
    ``peak_memory_bytes`` per stage.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if cost is None:
        if model is None:
            raise ValueError("plan_iteration needs either cost or model (+ cluster)")
        cost = make_cost(model, cluster or "a800", layout)
    lengths = document_lengths(lengths)
    if ceiling is not None and policy not in EPP_POLICIES:
        raise ValueError(f"ceiling is an EPP search bound; policy {policy!r} has no search to bound")
    t0 = time.perf_counter()
    if policy in EPP_POLICIES:
        mode = {"epp": "milp", "epp-fast": "greedy", "wo-ckpt": "none", "full-ckpt": "full"}[policy]
        plan = plan_epp(policy, lengths, cost, options, mode, progress, math.inf if ceiling is None else ceiling)
    elif policy == "wo-wbc":
        plan = _plan_fixed(policy, lengths, cost, options, even=True)
    elif policy == "seq1f1b-tuned":
        plan = _plan_fixed(policy, lengths, cost, options, even=False)
    elif policy == "seq1f1b":
        plan = _plan_seq1f1b(lengths, cost, options)
    else:
        plan = _plan_dapple(lengths, cost, options)
    plan.stats["solve_seconds"] = time.perf_counter() - t0 - plan.stats.get("simulate_seconds", 0.0)
    plan.stats["policy"] = policy
    return plan


# --------------------------------------------------------------------------- fixed-size chunking
# (the EPP policies and their ablations search in jvarlen.plan.epp)


def _plan_fixed(policy: str, lengths, cost, options: PlannerOptions, even: bool) -> Plan:
    # a document that only slices finer than options.min_slice_tokens could hold is refused now (as
    # the EPP search refuses it), not after chunking it at every size
    smallest_slices(lengths, cost, options.min_slice_tokens)
    cap = cost.max_tokens(in_flight=1, tail=False)
    sizes = [s for s in options.chunk_tokens if s <= cap] or [cap]
    best, tried, events = None, {}, []
    for size in sizes:
        chunks = fixed_size_chunks(lengths, size, even_split=even)
        shapes = [c.shape(lengths) for c in chunks]
        if policy == "seq1f1b-tuned":
            fams = order_families(families_of(chunks, lengths), shapes, cost)
            unit, fits = uniform_unit(fams, shapes, cost)
            units = [unit]
        else:
            try:
                units = list(group_chunks(chunks, lengths, cost, options, "greedy").units)
                fits = True
            except ValueError:
                fits = False
        if not fits:
            events.append(f"chunk_tokens={size}: does not fit memory")
            continue
        plan = assemble(policy, lengths, chunks, units, cost, simulation=options.simulation)
        tried[size] = plan.stats["iteration_time_s"]
        if best is None or tried[size] < best[0]:
            best = (tried[size], size, chunks, units)
    if best is None:
        raise PlanningError(f"{policy}: no chunk size in {sizes} fits memory")
    _, size, chunks, units = best
    if policy == "wo-wbc":
        units = list(group_chunks(chunks, lengths, cost, options, "milp").units)
    stats = dict(chunk_tokens=size, tuned_iteration_times={str(k): v for k, v in tried.items()})
    return assemble(policy, lengths, chunks, units, cost, stats, events, simulation=options.simulation)


def reference_uniform_layers(cost, chunk_tokens: int, context: int) -> int:
    """Uniform recomputation Seq1F1B needs for a worst-case batch of ``context``-token documents
    cut into ``chunk_tokens`` chunks (its setting "optimized for" that context, §5.1)."""
    lengths = [context] * 2
    chunks = fixed_size_chunks(lengths, chunk_tokens)
    shapes = [c.shape(lengths) for c in chunks]
    fams = order_families(families_of(chunks, lengths), shapes, cost)
    unit, fits = uniform_unit(fams, shapes, cost)
    return int(unit.ckpt.values.max()) if fits else cost.layers_per_stage


def _plan_seq1f1b(lengths, cost, options: PlannerOptions) -> Plan:
    """Paper-protocol Seq1F1B: fixed chunk size, uniform recomputation sized for the reference context
    (raised further only if this batch needs it)."""
    size = min(options.seq1f1b_chunk_tokens, cost.max_tokens(in_flight=1, tail=False))
    if size < 1:  # not even one token's chunk fits beside the model states
        refuse_states_over_budget(cost)
        raise PlanningError("seq1f1b: no chunk fits the memory left beside the model states, even fully recomputed")
    ref = reference_uniform_layers(cost, size, options.seq1f1b_reference_context)
    chunks = fixed_size_chunks(lengths, size)
    shapes = [c.shape(lengths) for c in chunks]
    fams = order_families(families_of(chunks, lengths), shapes, cost)
    unit, fits = uniform_unit(fams, shapes, cost)
    layers = max(ref, int(unit.ckpt.values.max()))
    unit, fits = uniform_unit(fams, shapes, cost, layers)
    events = [] if fits else [f"seq1f1b: out of memory with {layers} recomputed layers per stage"]
    stats = {"chunk_tokens": size, "uniform_ckpt_layers": layers, "reference_ckpt_layers": ref}
    plan = assemble("seq1f1b", lengths, chunks, [unit], cost, stats, events, simulation=options.simulation)
    plan.stats["oom"] = not fits
    return plan


def _plan_dapple(lengths, cost, options: PlannerOptions) -> Plan:
    chunks = dapple_chunks(lengths, max(lengths))
    shapes = [c.shape(lengths) for c in chunks]
    fams = order_families(families_of(chunks, lengths), shapes, cost)
    unit, fits = uniform_unit(fams, shapes, cost)
    events = [] if fits else ["dapple: out of memory even with full recomputation"]
    plan = assemble(
        "dapple",
        lengths,
        chunks,
        [unit],
        cost,
        {"micro_batch_tokens": max(lengths)},
        events,
        simulation=options.simulation,
    )
    plan.stats["oom"] = not fits
    return plan


__all__ = [
    "LOCKSTEP",
    "POLICIES",
    "SIMULATIONS",
    "PlannerOptions",
    "PlanningError",
    "SlowerThanCeiling",
    "make_cost",
    "plan_iteration",
    "simulate",
]
