"""EPP's search over chunkings (InfiniPipe §3.2): Alg. 1's slice number N, tuned by simulation,
and for the padding executor bucket-sized slices; each candidate chunking is grouped into units
(Eq. 14), checkpointed (Alg. 2) and simulated, and the fastest plan is kept.

Most candidates lose by far (large bucket sizes pad every chunk to 1.4-6x the best plan's time;
Alg. 1's equal-time mesh rarely beats the bucket mesh under padding), and their grouping, ordering
and simulation are ~90 % of a candidate's planning time. So the search is a branch and bound: a
candidate's chunks give a lower bound on any plan of them
(:func:`jvarlen.plan.simulator.lower_bound`), and a candidate whose bound exceeds the best time
found so far is skipped (``PlannerOptions.prune``; which ones, and what that changes:
:func:`plan_epp`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from jvarlen.plan.assemble import assemble
from jvarlen.plan.chunk import ChunkShape, executor_bucket
from jvarlen.plan.epp_refusals import (
    refuse_states_over_budget,
    refuse_unsplittable,
    split_memory_bound,
    states_error,
    unfit_message,
)
from jvarlen.plan.grouping import group, resolve_unit
from jvarlen.plan.options import PlannerOptions, PlanningError, SlowerThanCeiling
from jvarlen.plan.plan import Plan
from jvarlen.plan.sequence_processor import ChunkingResult, chunk_batch, cut, longest_slice, split_mesh
from jvarlen.plan.simulator import lower_bound
from jvarlen.plan.units import PlannedChunk, families_of


def smallest_slices(lengths: Sequence[int], cost, min_slice_tokens: int = 1) -> int:
    """Smallest N whose longest mesh slice fits the cost model's per-chunk token capacity.

    The first slice of a mesh is its longest (later slices pay for their context), so the
    largest admissible time target is that of a capacity-sized first slice, and one cut of the
    longest document at that target counts the slices needed: O(N) cost evaluations. Never
    finer than an average slice of ``min_slice_tokens``; raises :class:`PlanningError` saying
    what fits when no N does, and before any cut where no slicing can (:func:`refuse_unsplittable`)."""
    longest = max(lengths)
    if longest <= cost.max_tokens(in_flight=1, tail=True):
        return 1  # nothing needs splitting: every document fits as a (tail) chunk of its own
    cap = cost.max_tokens(in_flight=1, tail=False)
    budget = f"{cost.memory_budget / 2**30:.2f} GiB per device"
    if cap < 1:
        raise states_error(cost)
    refuse_unsplittable(lengths, cost)
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


def group_chunks(chunks: Sequence[PlannedChunk], lengths, cost, options: PlannerOptions, mode: str, shapes=None):
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


@dataclasses.dataclass
class Candidate:
    """One chunking of the search: its chunks, and once grouped and simulated its units and time."""

    key: str  # "N" (Alg. 1's equal-time mesh) or "b<tokens>" (bucket mesh)
    n_slices: int
    slice_tokens: Optional[int]
    result: ChunkingResult
    chunks: list
    shapes: list
    bound: float = 0.0
    grouping: object = None
    time: float = math.inf


def chunk_candidate(lengths, cost, n: int, slice_tokens: Optional[int] = None) -> Candidate:
    """Alg. 1's chunks for N = ``n`` (or bucket-sized slices of ``slice_tokens``), capped by what one
    chunk in flight may hold and batched chunks by a full window (``pp`` in flight)."""
    # N = 1, or slices no shorter than the longest document, split nothing: all chunks are tails
    splits = max(lengths) > slice_tokens if slice_tokens is not None else n > 1
    cap = cost.max_tokens(in_flight=1, tail=not splits)
    pack = cost.max_tokens(in_flight=cost.layout.pp, tail=True)
    res = chunk_batch(lengths, cost, n, token_capacity=cap, pack_tokens=pack, slice_tokens=slice_tokens)
    chunks = list(res.chunks)
    key = str(n) if slice_tokens is None else f"b{slice_tokens}"
    n_slices = n if slice_tokens is None else len(res.mesh.slices)
    return Candidate(key, n_slices, slice_tokens, res, chunks, [c.shape(lengths) for c in chunks])


SCAN_COUNTS = 24  # slice counts the fallback scan of :meth:`_Search.time_mesh` tries at most


def scan_counts(lo: int, hi: int, skip=(), limit: int = SCAN_COUNTS) -> list[int]:
    """The slice counts ``lo..hi`` not in ``skip``, ascending: all of them where there are at most
    ``limit``, else ``limit`` of them spread evenly on a log scale, as Alg. 1's candidates are (every
    N of a 1.5M-token document's range, ~3,000, took minutes to chunk, group and simulate). A window
    of fitting N narrower than the spread's step may be missed: the batch is then refused."""
    rest = [n for n in range(max(1, lo), hi + 1) if n not in skip]
    if len(rest) <= limit:
        return rest
    picks = {
        min(rest, key=lambda n: abs(math.log(n) - x)) for x in _spread(math.log(rest[0]), math.log(rest[-1]), limit)
    }
    return sorted(picks)


def _spread(a: float, b: float, k: int) -> list[float]:
    return [a + (b - a) * i / (k - 1) for i in range(k)]


class _Search:
    """The state of one EPP search: every candidate simulated (``tuned``) or skipped by its bound
    (``pruned``), the events, and the best plan of each mesh."""

    def __init__(self, policy: str, lengths, cost, options: PlannerOptions, mode: str, progress, ceiling: float):
        self.policy, self.lengths, self.cost, self.options, self.progress = policy, lengths, cost, options, progress
        self.ceiling = ceiling  # a plan this slow is not wanted (the caller has a faster one)
        self.tune_mode = "greedy" if mode == "milp" else mode  # the MILP re-solves the chosen units only
        # planned for the lock-step executor, units run in GPipe order where that is faster and fits
        self.assembly = dict(simulation=options.simulation, gpipe_order=options.gpipe_units)
        self.tuned: dict[str, float] = {}
        self.pruned: dict[str, float] = {}
        self.events: list[str] = []
        self.unfit: dict[int, str] = {}  # N -> why its plan does not fit memory
        self.best: dict[str, Optional[Candidate]] = {"time": None, "bucket": None}
        self._bucket_rank: tuple = ()

    def incumbent(self) -> float:
        return min((c.time for c in self.best.values() if c is not None), default=self.ceiling)

    def evaluate(self, cand: Candidate, against: float) -> Optional[Candidate]:
        """``cand`` grouped, ordered and simulated; None (and recorded as pruned) where its lower
        bound exceeds ``against``. Raises PlanningError where it does not fit memory."""
        cost, options = self.cost, self.options
        what = f"N={cand.key}" if cand.slice_tokens is None else f"{cand.slice_tokens}-token slices"
        if options.prune:
            cand.bound = cand.bound or lower_bound(cand.shapes, cost, options.simulation)  # (bucket mesh: known)
            if cand.bound > against:
                self.pruned[cand.key] = cand.bound
                if self.progress is not None:
                    self.progress(f"{what}: {len(cand.chunks)} chunks, skipped (lower bound {cand.bound:.4g} s)")
                return None
        cand.grouping = group_chunks(cand.chunks, self.lengths, cost, options, self.tune_mode, cand.shapes)
        plan = assemble(self.policy, self.lengths, cand.chunks, list(cand.grouping.units), cost, **self.assembly)
        if not plan.stats["fits_memory"]:  # the executor's buffers (paired), recomputing all they can
            least = plan.stats.get("executor_memory_least_bytes", plan.stats.get("executor_memory_bytes", 0))
            raise PlanningError(f"needs {least / 1e6:,.1f} MB per device even recomputing all it can")
        cand.time = self.tuned[cand.key] = plan.stats["iteration_time_s"]
        if self.progress is not None:
            self.progress(f"{what}: {len(cand.chunks)} chunks, {cand.time:.4g} s simulated")
        return cand

    def attempt(self, n: int, slice_tokens: Optional[int], against: float, prepared=None):
        """(candidate or None, True where it is infeasible)."""
        try:
            cand = prepared or chunk_candidate(self.lengths, self.cost, n, slice_tokens)
            return self.evaluate(cand, against), False
        except (ValueError, PlanningError) as e:
            what = f"N={n}" if slice_tokens is None else f"{slice_tokens}-token slices"
            self.events.append(f"{what}: infeasible ({e})")
            if slice_tokens is None:
                self.unfit[n] = str(e)
            if self.progress is not None:
                self.progress(f"{what}: does not fit memory")
            return None, True

    def scan(self, lo: int, hi: int, skip) -> Optional[Candidate]:
        """The first slice count of :func:`scan_counts` ``(lo, hi)`` whose plan fits memory, telling
        ``progress`` of each; None where none does."""
        todo = scan_counts(lo, hi, skip)
        if self.progress is not None and todo:
            self.progress(f"no N of {sorted(skip)} fits memory: trying {len(todo)} others from {lo} to {hi}")
        for n in todo:
            found, _ = self.attempt(n, None, self.ceiling)
            if found is not None:
                return found
        return None

    def time_mesh(self, candidates: list[int]) -> None:
        """Alg. 1's N: candidates largest first, stopping at the first slower than the best N so far
        (unimodal in N), then the one refinement step of :func:`refine_candidate`, and N = 1 (no
        document split) where it is a candidate the stop rule did not reach. The refinement
        is skipped where its bound exceeds the best time of either mesh (it cannot win); the coarse
        candidates only by a ``ceiling`` (their times steer the refinement, so skipping one because
        the bucket mesh's plan is faster could change it). A candidate skipped by the ceiling stops
        the search where its bound exceeds the best N's time, as the unimodal rule would."""
        options, lengths = self.options, self.lengths
        finest = max(1, max(lengths) // 512)  # never slice finer than 512 tokens on average
        best, tried, cands = None, {}, list(candidates)
        queue = list(cands)
        while queue and len(tried) < options.n_candidates:
            n = queue.pop(0)
            local = math.inf if best is None else best.time
            found, infeasible = self.attempt(n, None, self.ceiling)
            if infeasible:
                # Finer slicing shrinks the chunk windows: if even the largest candidate does not
                # fit, try a finer one before the coarser ones.
                bigger = min(int(round(n * max(options.n_ratio, 1.5))), finest)  # at most the finest
                bumps = len(cands) - len(candidates)
                if best is None and options.n_slices is None and n == max(cands) and bigger > n and bumps < 2:
                    cands.append(bigger)
                    queue.insert(0, bigger)
                continue
            if found is None:  # pruned
                tried[n] = self.pruned[str(n)]
                if self.pruned[str(n)] > local:
                    break
                continue
            tried[n] = found.time
            if best is not None and found.time > best.time:
                break
            if best is None or found.time < best.time:
                best = found
        unplanned = self.best["bucket"] is None and math.isinf(self.ceiling)
        if best is None and not tried and options.n_slices is None and unplanned:
            # Near the memory bound whether an N fits is not monotone in N: the lone longest document
            # needs less the fewer its slices, the executor's buffers more the more chunks there are
            # (CPU profile, pp = 2, 7,614 tokens: N = 15-18 fit, 1-14 and 19-39 do not), so where no
            # coarse candidate (and no bucket size) fits memory, other N of their range are tried
            # before the batch is refused. Not under a ceiling: there a refusal only drops a scheme
            # from a comparison (``auto``'s and epp-pipelines' searches), and the scan would cost
            # most of their time.
            n_hi = max(max(cands), finest, max(lengths) // max(1, options.min_slice_tokens))
            best = self.scan(min(cands) + 1, n_hi, set(cands))
        if best is not None and options.n_slices is None and self.policy != "epp-fast":
            n_hi = max(max(cands), max(lengths) // max(1, options.min_slice_tokens))
            mid = refine_candidate(best.n_slices, tried, options.n_ratio, min(cands), n_hi)
            if mid is not None:
                found, _ = self.attempt(mid, None, min(best.time, self.incumbent()))
                if found is not None and found.time < best.time:
                    best = found
            if 1 in cands and 1 not in tried and best.n_slices != 1:
                # the unsplit mesh (DAPPLE's micro-batches): the time is not unimodal in N where
                # memory binds (30B, 192K: N = 4 410 s, 2 547 s, 1 361 s), and the stop rule above
                # would never reach it
                found, _ = self.attempt(1, None, min(best.time, self.incumbent()))
                if found is not None and found.time < best.time:
                    best = found
        self.best["time"] = best

    def bucket_mesh(self) -> None:
        """Bucket-sized slices: every power of two of :func:`bucket_candidates` (not unimodal:
        2,048 < 1,024 > 512 tokens happens, fewer ticks against less padding), in the order of
        their bounds, then the two ``3·2^k`` sizes beside the fastest. A power of two skipped by
        its bound is slower than one simulated, so the fastest is that of an exhaustive search."""
        sizes = bucket_candidates(self.lengths, self.cost, self.options)
        prepared = {}
        for b in (b for b in sizes if b & (b - 1) == 0):
            try:
                prepared[b] = chunk_candidate(self.lengths, self.cost, 0, b)
            except (ValueError, PlanningError) as e:
                self.events.append(f"{b}-token slices: infeasible ({e})")
        if self.options.prune:
            for cand in prepared.values():
                cand.bound = lower_bound(cand.shapes, self.cost, self.options.simulation)
        timed: dict[int, float] = {}
        for b in sorted(prepared, key=lambda b: (prepared[b].bound, -b)):
            found, _ = self.attempt(0, b, self.incumbent(), prepared[b])
            if found is not None:
                timed[b] = found.time
                self._keep_bucket(found, (0, -b))
        if timed:
            top = min(timed, key=lambda b: (timed[b], -b))  # ties: the larger size, as simulated first before
            for i, b in enumerate((3 * top // 4, 3 * top // 2)):
                if b in sizes and b not in prepared:
                    found, _ = self.attempt(0, b, self.incumbent())
                    if found is not None:
                        self._keep_bucket(found, (1, i))

    def _keep_bucket(self, cand: Candidate, rank: tuple) -> None:
        """Keeps the fastest; among equal times the one the exhaustive search simulates first (powers
        of two largest first, then the two sizes beside the fastest), which it keeps."""
        if self.best["bucket"] is None or (cand.time, rank) < (self.best["bucket"].time, self._bucket_rank):
            self.best["bucket"], self._bucket_rank = cand, rank

    def winner(self) -> Optional[Candidate]:
        """The faster mesh's best plan; on a tie Alg. 1's."""
        t, b = self.best["time"], self.best["bucket"]
        if t is None or (b is not None and b.time < t.time):
            return b
        return t


def plan_epp(
    policy: str, lengths, cost, options: PlannerOptions, mode: str, progress=None, ceiling: float = math.inf
) -> Plan:
    """Alg. 1 + Eq. 14 + Alg. 2. N is tuned by simulating candidates (§3.2), largest first,
    stopping at the first candidate slower than the best so far (or after ``n_candidates``), then
    refined once: the geometric midpoint between the best N and its faster coarse neighbour (an
    untried neighbour counts as faster) is simulated too (:func:`refine_candidate`). During tuning
    the DP prices ranges with greedy checkpointing, and the MILP then re-solves the chosen units.

    Under the ``"paired"`` simulation (jvarlen's executor, which pads every chunk of a step to one
    token bucket) ``epp`` also cuts along bucket-sized slices (:func:`.sequence_processor.bucket_mesh`),
    searched first (:meth:`_Search.bucket_mesh`): its plans usually win, and their time lets the
    search over N skip its refinement step by its bound; the faster of the two meshes' plans wins.
    Simulated times are kept as ``stats["tuned_iteration_times"]``, keyed ``"N"`` (equal-time mesh)
    and ``"b<tokens>"`` (bucket mesh), and the bounds of skipped candidates as
    ``stats["pruned_lower_bounds"]``. Where no equal-time mesh fits memory (a profile whose time is
    flat within a token bucket has no balanced slice shorter than the bucket), the bucket mesh alone
    is searched.

    ``ceiling``: the caller wants only a plan faster than that (it has one as fast elsewhere); the
    search starts with it as its best time, and raises :class:`SlowerThanCeiling` when no plan beats
    it. Without bounds (``prune=False``) it changes nothing.

    What the bounds change: without a ceiling, no plan. A power of two of the bucket mesh is skipped
    only where its bound exceeds a time already simulated, so the fastest one, and the sizes beside
    it, are those of the exhaustive search; Alg. 1's coarse candidates are all simulated (their
    times steer the refinement), and the refinement is skipped only where it cannot win. With a
    ceiling, the coarse candidates and powers of two whose bounds exceed it are skipped too, so a
    refinement step beside one of them (which the exhaustive search might take, and which might
    beat the ceiling) is not tried. ``tests/test_planner_lockstep.py`` compares the two searches on
    random batches, and ``scripts/bench_strategies.py --parts bounds`` inside ``auto``.
    """

    ceiling = ceiling if options.prune else math.inf
    refuse_unsplittable(lengths, cost)  # not caught below: no bucket size can fit either
    search = _Search(policy, lengths, cost, options, mode, progress, ceiling)
    buckets = options.simulation == "paired" and options.n_slices is None and policy != "epp-fast"
    try:
        candidates = slice_candidates(lengths, cost, options, policy)
    except PlanningError as e:
        if not buckets:
            raise
        search.events.append(f"equal-time mesh: {e}")  # bucket-sized slices may still fit (docstring)
        candidates, unsliced = [], e
    if buckets:
        search.bucket_mesh()
    if candidates:
        search.time_mesh(candidates)
    best = search.winner()
    if best is not None and best.time >= ceiling or best is None and search.pruned:
        fastest = min([*search.pruned.values(), *search.tuned.values()])
        raise SlowerThanCeiling(f"{policy}: no plan faster than {ceiling:.4g} s (at best {fastest:.4g} s)")
    if best is None and not candidates:
        raise PlanningError(f"{policy}: {unsliced}; no bucket-sized slices fit either") from unsliced
    if best is None:
        raise PlanningError(f"{policy}: {unfit_message(search.unfit, lengths, buckets)}")
    units = list(best.grouping.units)
    if mode == "milp":
        units = [resolve_unit(u, best.shapes, cost, cost.layers_per_stage, options.solver) for u in units]
    res = best.result
    stats = dict(
        n_slices=best.n_slices,
        slice_tokens=best.slice_tokens,  # None: Alg. 1's equal-time mesh
        tuned_iteration_times=search.tuned,
        pruned_lower_bounds=search.pruned,
        time_threshold_s=res.time_threshold,
        token_threshold=res.token_threshold,
        mesh=list(res.mesh.slices),
        perturbations=res.perturbations,
        ckpt_solves=best.grouping.solves,
        gpipe_units=0,  # assemble() counts the units it runs in GPipe order
    )
    return assemble(policy, lengths, best.chunks, units, cost, stats, search.events, **search.assembly)


__all__ = [
    "bucket_candidates",
    "chunk_candidate",
    "group_chunks",
    "plan_epp",
    "refine_candidate",
    "refuse_states_over_budget",
    "refuse_unsplittable",
    "slice_candidates",
    "smallest_slices",
    "split_memory_bound",
]
