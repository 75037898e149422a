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
the executor's buffers (:func:`jvarlen.plan.assemble.fit_executor_memory`)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional, Sequence

from jvarlen.layout import Layout
from jvarlen.plan.assemble import assemble, simulate, uniform_unit
from jvarlen.plan.baselines import dapple_chunks, fixed_size_chunks
from jvarlen.plan.checkpointing import SolverOptions
from jvarlen.plan.chunk import ChunkShape, executor_bucket
from jvarlen.plan.cost import CostModel, ModelShape
from jvarlen.plan.grouping import group, lockstep_order, order_families, resolve_unit
from jvarlen.plan.plan import Plan
from jvarlen.plan.sequence_processor import chunk_batch, cut, longest_slice, split_mesh
from jvarlen.plan.units import PlannedChunk, families_of

# execution models of PlannerOptions.simulation: InfiniPipe's async events, lock-step ticks with one
# op per stage, the executor's paired ticks (a backward and a forward per stage and tick)
SIMULATIONS = ("async", "ticks", "paired")
LOCKSTEP = ("ticks", "paired")
POLICIES = ("epp", "epp-fast", "wo-wbc", "wo-ckpt", "full-ckpt", "seq1f1b", "seq1f1b-tuned", "dapple")


class PlanningError(RuntimeError):
    """No plan of the requested policy fits (e.g. a document too long for any chunking)."""


@dataclasses.dataclass(frozen=True)
class PlannerOptions:
    """Knobs of :func:`plan_iteration`.

    ``n_slices``: fix Alg. 1's N (None: tune over at most ``n_candidates`` values
    of :func:`slice_candidates`). ``solver``: limits of each checkpointing MILP. ``chunk_tokens``: candidate
    fixed chunk sizes for seq1f1b-tuned / wo-wbc (the best simulated one is used).
    ``seq1f1b_chunk_tokens`` / ``seq1f1b_reference_context``: the paper-protocol
    Seq1F1B baseline's fixed chunk size and the context its uniform recomputation is
    sized for (InfiniPipe §5.1: "checkpointing configurations optimized for 96K").
    ``simulation``: the execution model candidates are simulated in and the plan's
    ``iteration_time_s`` is reported for: ``"async"`` (InfiniPipe's simulator: a stage starts an
    op as soon as its inputs are ready), ``"ticks"`` (lock-step, every stage runs one op per tick,
    a tick lasts as long as its slowest op) or ``"paired"`` (jvarlen's pipeline executor: lock-step
    ticks in which a stage runs a backward and a forward, the last stage's adjacent F and B fused).
    ``gpipe_units`` (EPP policies, with a lock-step ``simulation`` only): a unit runs in GPipe order
    where the lock-step simulation says that is faster and it fits memory
    (:func:`jvarlen.plan.grouping.lockstep_order`); the baselines keep their schedules.
    """

    n_slices: Optional[int] = None
    n_candidates: int = 3
    n_ratio: float = 2.0
    min_slice_tokens: int = 4096
    solver: SolverOptions = SolverOptions()
    chunk_tokens: tuple[int, ...] = (4096, 8192, 16384, 32768)
    seq1f1b_chunk_tokens: int = 8192
    seq1f1b_reference_context: int = 96 * 1024
    simulation: str = "async"
    gpipe_units: bool = True

    def __post_init__(self):
        if self.simulation not in SIMULATIONS:
            raise ValueError(f"simulation must be one of {SIMULATIONS}, got {self.simulation!r}")


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
) -> Plan:
    """Plans one iteration over the documents ``lengths`` (tokens each).

    ``progress(message)`` is told of each slice count N the EPP policies simulate (long
    documents make planning take seconds; the CLI shows these).

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
    lengths = [int(x) for x in lengths]
    if not lengths or min(lengths) < 1:
        raise ValueError("lengths must be a non-empty list of positive document lengths")
    t0 = time.perf_counter()
    if policy in ("epp", "epp-fast", "wo-ckpt", "full-ckpt"):
        mode = {"epp": "milp", "epp-fast": "greedy", "wo-ckpt": "none", "full-ckpt": "full"}[policy]
        plan = _plan_epp(policy, lengths, cost, options, mode, progress)
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


# --------------------------------------------------------------------------- EPP and ablations


def smallest_slices(lengths: Sequence[int], cost, min_slice_tokens: int = 1) -> int:
    """Smallest N whose longest mesh slice fits the cost model's per-chunk token capacity.

    The first slice of a mesh is its longest (later slices pay for their context), so the
    largest admissible time target is that of a capacity-sized first slice, and one cut of the
    longest document at that target counts the slices needed: O(N) cost evaluations. Never
    finer than an average slice of ``min_slice_tokens``; raises :class:`PlanningError` saying
    what fits when no N does."""
    longest = max(lengths)
    if longest <= cost.max_tokens(in_flight=1, tail=True):
        return 1  # nothing needs splitting: every document fits as a (tail) chunk of its own
    cap = cost.max_tokens(in_flight=1, tail=False)
    budget = f"{cost.memory_budget / 2**30:.2f} GiB per device"
    if cap < 1:
        state = max(map(cost.memory_floor, range(cost.layout.pp))) / 2**30
        raise PlanningError(
            f"the model states and a backward's layer gradients ({state:.2f} GiB per device) exceed the "
            f"memory budget ({budget}): add pipeline stages or devices"
        )
    n_max = max(2, longest // max(1, min_slice_tokens))
    advice = "raise pp or sp, lower plan.min_slice_tokens, or shorten data.seq_len"
    tau = cost.bwd_time(ChunkShape(0, (cap,), tail=False))
    first = longest_slice(cost, 0, longest, tau, tail_at_end=False)
    if first > cap:  # cost flat below the profile's smallest token bucket: no shorter slice is cheaper
        raise PlanningError(
            f"a document of {longest:,} tokens cannot be split into slices that fit memory on {cost.layout}: a "
            f"slice may hold at most {cap:,} tokens ({budget}), but the cost model charges a {cap:,}-token slice "
            f"as much as a {first:,}-token one (its smallest token bucket), so balanced slices are never shorter; "
            + advice
        )
    needed = cut(cost, longest, tau, n_max)
    if needed is None:
        raise PlanningError(
            f"a document of {longest:,} tokens cannot be split into slices that fit memory on {cost.layout}: a "
            f"slice may hold at most {cap:,} tokens ({budget}), which takes more than {n_max:,} slices (an average "
            f"of {max(1, min_slice_tokens):,} tokens, plan.min_slice_tokens); " + advice
        )
    n = max(2, len(needed))
    while n < n_max and split_mesh(cost, longest, n).token_threshold > cap:  # bisection slack: rarely runs
        n += 1
    return n


def _epp_units(lengths, cost, options: PlannerOptions, mode: str, n: int, slice_tokens: Optional[int] = None):
    cap = cost.max_tokens(in_flight=1, tail=n == 1)  # N = 1 splits nothing: all chunks are tails
    pack = cost.max_tokens(in_flight=cost.layout.pp, tail=True)  # a full window of batched chunks
    res = chunk_batch(lengths, cost, n, token_capacity=cap, pack_tokens=pack, slice_tokens=slice_tokens)
    chunks = list(res.chunks)
    shapes = [c.shape(lengths) for c in chunks]
    return res, chunks, shapes, _group(chunks, lengths, cost, options, mode, shapes)


def _group(chunks: Sequence[PlannedChunk], lengths, cost, options: PlannerOptions, mode: str, shapes=None):
    shapes = shapes if shapes is not None else [c.shape(lengths) for c in chunks]
    fams = families_of(chunks, lengths)
    return group(fams, shapes, cost, cost.layout.pp, cost.layers_per_stage, options.solver, mode)


def slice_candidates(lengths, cost, options: PlannerOptions, policy: str) -> list[int]:
    """Alg. 1's N candidates, largest first: ``n0·n_ratio^i`` up to an average slice of
    ``min_slice_tokens`` (finer chunks lose GPU efficiency, InfiniPipe App. B)."""
    if options.n_slices is not None:
        return [options.n_slices]
    n0 = smallest_slices(lengths, cost, options.min_slice_tokens)
    if policy == "epp-fast":
        return [n0]
    n_max = max(n0, max(lengths) // max(1, options.min_slice_tokens))
    out, x = [], float(n0)
    while int(round(x)) <= n_max:
        if int(round(x)) not in out:
            out.append(int(round(x)))
        x = x * options.n_ratio if options.n_ratio > 1 else x + 1
    return sorted(out or [n0], reverse=True)


def bucket_candidates(lengths, cost, options: PlannerOptions) -> list[int]:
    """Slice (and chunk) sizes for :func:`jvarlen.plan.sequence_processor.bucket_mesh`, largest first:
    two executor buckets per power of two (:func:`jvarlen.plan.chunk.executor_bucket` of ``2^k`` and
    ``3·2^(k-2)``; more would add planning time) from ``min_slice_tokens`` (and the profile's smallest
    measured token bucket: below it the cost model extrapolates, and on CPU it under-predicted a
    384-token step by 23 %) up to twice the power of two that holds the longest document (sizes
    above it split nothing and pack short documents into larger chunks)."""
    measured = min(cost.coeffs.token_buckets, default=0)
    lo, longest, sp = max(16, options.min_slice_tokens, measured), max(lengths), cost.layout.sp
    top = 2 << max(0, (longest - 1).bit_length())
    out, p = set(), 16
    while p <= top:
        out |= {executor_bucket(v, sp) for v in (3 * p // 4, p)}
        p *= 2
    return sorted((b for b in out if lo <= b <= top), reverse=True)


def refine_candidate(best: int, tried: dict, ratio: float, n_lo: int, n_hi: int) -> int | None:
    """One refinement step of the N search: the geometric midpoint ``best·ratio^±1/2``
    towards the faster of best's two coarse neighbours ``best·ratio^±1`` (a neighbour
    not simulated counts as faster: the coarse search never looked there). None when
    both midpoints are out of ``[n_lo, n_hi]``, equal to ``best`` or already tried."""
    if ratio <= 1:
        return None
    step = math.sqrt(ratio)
    sides = []
    for mid, nb in (
        (int(round(best * step)), int(round(best * ratio))),
        (int(round(best / step)), int(round(best / ratio))),
    ):
        if n_lo <= mid <= n_hi and mid != best and mid not in tried:
            sides.append((tried.get(nb, -math.inf), mid))
    return min(sides)[1] if sides else None


def _plan_epp(policy: str, lengths, cost, options: PlannerOptions, mode: str, progress=None) -> Plan:
    """Alg. 1 + Eq. 14 + Alg. 2. N is tuned by simulating candidates (§3.2), largest first,
    stopping at the first candidate slower than the best so far (or after ``n_candidates``), then
    refined once: the geometric midpoint between the best N and its faster coarse neighbour (an
    untried neighbour counts as faster) is simulated too (:func:`refine_candidate`). During tuning
    the DP prices ranges with greedy checkpointing, and the MILP then re-solves the chosen units.

    Under the ``"paired"`` simulation (jvarlen's executor, which pads every chunk of a step to one
    token bucket) ``epp`` also cuts along bucket-sized slices (:func:`.sequence_processor.bucket_mesh`):
    the sizes of :func:`bucket_candidates` that are powers of two, then the two ``3·2^k`` sizes
    beside the best; the faster of the two meshes' plans wins. Tuned times are keyed ``"N"`` (equal-time mesh) and ``"b<tokens>"`` (bucket
    mesh). Where no equal-time mesh fits memory (a profile whose time is flat within a token bucket
    has no balanced slice shorter than the bucket), the bucket mesh alone is searched."""
    events: list[str] = []
    buckets = options.simulation == "paired" and options.n_slices is None and policy != "epp-fast"
    try:
        candidates = slice_candidates(lengths, cost, options, policy)
    except PlanningError as e:
        if not buckets:
            raise
        events.append(f"equal-time mesh: {e}")  # bucket-sized slices may still fit (docstring)
        candidates, unsliced = [], e
    tune_mode = "greedy" if mode == "milp" else mode
    finest = max(1, max(lengths) // 512)  # never slice finer than 512 tokens on average
    tuned: dict[str, float] = {}

    def evaluate(n: int, slice_tokens: Optional[int] = None):
        res, chunks, shapes, grouping = _epp_units(lengths, cost, options, tune_mode, n, slice_tokens)
        ordered = _ordered(grouping.units, shapes, cost, options)
        plan = assemble(policy, lengths, chunks, list(ordered.values()), cost, simulation=options.simulation)
        if not plan.stats["fits_memory"]:  # the executor's buffers (paired), recomputing all they can
            raise PlanningError(f"needs {plan.stats.get('executor_memory_bytes', 0) / 1e6:,.0f} MB per device")
        t = plan.stats["iteration_time_s"]
        key = str(n) if slice_tokens is None else f"b{slice_tokens}"
        tuned[key] = t
        if progress is not None:
            what = f"N={n}" if slice_tokens is None else f"{slice_tokens}-token slices"
            progress(f"{what}: {len(chunks)} chunks, {t:.4g} s simulated")
        n_slices = n if slice_tokens is None else len(res.mesh.slices)
        return (n_slices, slice_tokens, res, chunks, shapes, grouping, ordered, t)

    def search_time():
        """Alg. 1's mesh: the best N (None if none fits)."""
        best, tried = None, {}
        cands = list(candidates)
        queue = list(cands)
        while queue and len(tried) < options.n_candidates:
            n = queue.pop(0)
            try:
                found = evaluate(n)
                tried[n] = found[-1]
            except (ValueError, PlanningError) as e:
                events.append(f"N={n}: infeasible ({e})")
                # Finer slicing shrinks the chunk windows: if even the largest candidate does not
                # fit, try a finer one before the coarser ones.
                bigger = int(round(n * max(options.n_ratio, 1.5)))
                bumps = len(cands) - len(candidates)
                if best is None and options.n_slices is None and n == max(cands) and bigger <= finest and bumps < 2:
                    cands.append(bigger)
                    queue.insert(0, bigger)
                continue
            if best is not None and found[-1] > best[-1]:
                break  # unimodal in N: further (smaller) candidates only get worse
            if best is None or found[-1] < best[-1]:
                best = found
        if best is not None and options.n_slices is None and policy != "epp-fast":
            n_hi = max(max(cands), max(lengths) // max(1, options.min_slice_tokens))
            mid = refine_candidate(best[0], tried, options.n_ratio, min(cands), n_hi)
            if mid is not None:
                try:
                    found = evaluate(mid)
                    if found[-1] < best[-1]:
                        best = found
                except (ValueError, PlanningError) as e:
                    events.append(f"N={mid}: infeasible ({e})")
        return best

    def search_bucket(best):
        """Bucket-sized slices: every power of two, then the 3·2^k sizes beside the best one; returns
        the best of them and ``best`` (the equal-time mesh's plan)."""
        sizes = bucket_candidates(lengths, cost, options)
        tried: dict[int, Optional[float]] = {}

        def attempt(b: int):
            nonlocal best
            try:
                found = evaluate(0, b)
            except (ValueError, PlanningError) as e:
                events.append(f"{b}-token slices: infeasible ({e})")
                tried[b] = None
                return None
            tried[b] = found[-1]
            if best is None or found[-1] < best[-1]:
                best = found
            return found[-1]

        for b in sizes:  # not unimodal: 2,048 < 1,024 > 512 tokens happens (fewer ticks vs less padding)
            if b & (b - 1) == 0:
                attempt(b)
        timed = {b: t for b, t in tried.items() if t is not None}
        if timed:
            top = min(timed, key=timed.get)
            for b in (3 * top // 4, 3 * top // 2):
                if b in sizes and b not in tried:
                    attempt(b)
        return best

    best = search_time() if candidates else None
    if buckets:
        best = search_bucket(best)
    if best is None and not candidates:
        raise PlanningError(f"{policy}: {unsliced}; no bucket-sized slices fit either") from unsliced
    if best is None:
        raise PlanningError(f"{policy}: no slice number in {candidates} gives a grouping that fits memory")
    n, slice_tokens, res, chunks, shapes, grouping, ordered, _ = best
    planned = list(grouping.units)
    if mode == "milp":
        planned = [resolve_unit(u, shapes, cost, cost.layers_per_stage, options.solver) for u in planned]
    # a unit the MILP left as it was keeps the order chosen while tuning
    units = [ordered[id(u)] if id(u) in ordered else _ordered([u], shapes, cost, options)[id(u)] for u in planned]
    stats = dict(
        n_slices=n,
        slice_tokens=slice_tokens,  # None: Alg. 1's equal-time mesh
        tuned_iteration_times=tuned,
        time_threshold_s=res.time_threshold,
        token_threshold=res.token_threshold,
        mesh=list(res.mesh.slices),
        perturbations=res.perturbations,
        ckpt_solves=grouping.solves,
        gpipe_units=sum(a is not b for a, b in zip(planned, units)),  # units reordered for the lock-step executor
    )
    return assemble(policy, lengths, chunks, units, cost, stats, events, simulation=options.simulation)


def _ordered(units, shapes, cost, options: PlannerOptions) -> dict:
    """``{id(unit): unit as the executor will run it}`` in unit order: planned for the lock-step
    executor (``simulation`` "ticks" or "paired"), a unit runs in GPipe order where that is faster and fits
    (:func:`jvarlen.plan.grouping.lockstep_order`); InfiniPipe's async model keeps 1F1B."""
    if options.simulation not in LOCKSTEP or not options.gpipe_units or cost.layout.pp == 1:
        return {id(u): u for u in units}
    return {id(u): lockstep_order(u, shapes, cost, options.simulation) for u in units}


# --------------------------------------------------------------------------- fixed-size chunking


def _plan_fixed(policy: str, lengths, cost, options: PlannerOptions, even: bool) -> Plan:
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
                units = list(_group(chunks, lengths, cost, options, "greedy").units)
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
        units = list(_group(chunks, lengths, cost, options, "milp").units)
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


__all__ = ["POLICIES", "PlannerOptions", "PlanningError", "make_cost", "plan_iteration", "simulate"]
