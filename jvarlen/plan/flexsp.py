"""FlexSP policy: SP groups of varying sizes per iteration, documents assigned so the slowest group is fastest.

FlexSP (its §4 "parallelism planner" and App. A) replaces one fixed Ulysses degree by SP groups
of different power-of-two sizes whose devices add up to the cluster, long sequences on large
groups, short ones on small groups (no all-to-all at sp = 1), and assigns sequences to groups by
a MILP that minimises the slowest group's time under the groups' memory. Here, per iteration:

1. **data** (:class:`FlexSPProblem`): every document's additive time on every scheme
   ``Scheme(1, sp)`` from the fitted cost model (all-to-all per layer included; ``inf`` where it
   does not fit even with full recomputation), micro-batch tokens without recomputation, the
   per-micro-batch and per-group constants (:class:`~jvarlen.plan.work_table.WorkTable`), in µs;
2. **model** (:func:`_cp_model`): group slots ``(s, j)``, ``j < N / sp_s``; ``y[s,j]`` slot used,
   ``x[i,s,j]`` document i on it, ``m[s,j]`` its shared micro-batches; ``Σ_g x[i,g] = 1``,
   ``x ≤ y``, ``Σ sp_s·y ≤ N``, ``cap_s·m ≥ Σ tokens·x`` (memory: Eq. 23-24 micro-batches that fit
   without recomputation), ``load = base·y + Σ w·x + c·m ≤ z``, minimise ``z``; symmetry broken
   by ordering the slots of one size by use and load; the device-time cut ``Σ sp·load ≤ N·z``;
3. **solve** (:func:`solve`): CP-SAT with the heuristic's assignment as hint, deterministic
   time limit, wall-clock safety net, workers and seed from the options, status checked;
   the heuristic (:func:`heuristic`) is the fallback;
4. **extract**: each used slot becomes a group, its documents cut into micro-batches by the
   memory-balanced chunking DP (Eq. 23-24, :mod:`jvarlen.plan.chunking`) over length-sorted
   documents, each micro-batch with the least recomputation that fits; the MILP's, the
   heuristic's and the ``homogeneous_top`` best one-degree layouts' groups (ranked by the exact
   group model, :meth:`GroupCosts.strategy_time`, which pads like the executor) are planned for the
   executor and the fastest simulated one is kept (:func:`~jvarlen.plan.sp_assemble.assemble_fastest`).

The heuristic (:mod:`jvarlen.plan.flexsp_heuristic`) walks the multisets of group sizes from "all devices in the largest groups"
down by splitting one group in two (the split whose LPT dispatch is fastest, the best multiset
seen kept), also tries every homogeneous multiset, then improves the best assignment by moves
and swaps off the slowest group.

Pure Python/numpy/OR-Tools: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional, Sequence

import numpy as np
from ortools.sat.python import cp_model

from jvarlen.plan import cpsat
from jvarlen.plan.api import SIMULATIONS, PlanningError
from jvarlen.plan.chunk import document_lengths
from jvarlen.plan.chunking import balanced_split
from jvarlen.plan.flexsp_heuristic import heuristic, homogeneous_finalists
from jvarlen.plan.sp_assemble import assemble_fastest, candidate_record
from jvarlen.plan.sp_groups import GroupChoice, GroupCosts, group_costs_for, infeasible_documents, too_long_message
from jvarlen.plan.sp_refine import refine_groups
from jvarlen.plan.strategy import SchemeCosts, StrategyPlan, register_policy
from jvarlen.plan.work_table import WorkTable

_US = 1e6


@dataclasses.dataclass(frozen=True)
class FlexSPOptions:
    """Knobs of the FlexSP policy.

    ``milp``: refine the heuristic with CP-SAT (False: heuristic only). ``deterministic_time``:
    CP-SAT's deterministic limit (reproducible); ``time_limit_s``: wall-clock safety net (a plan
    cut by it may differ between runs; an event says so). ``milp_classes``: at most this many
    document classes in the MILP (more documents: the longest alone, the rest in classes of equal
    token mass, counted per group). ``milp_max_vars``: skip the MILP when it would have more
    assignment variables. ``milp_linearization``: CP-SAT's ``linearization_level`` (0: no LP
    relaxation; see :func:`solve`). ``max_sp``: largest group. ``micro_batch_tokens``: cap on
    a micro-batch's tokens below what memory allows. ``max_recompute``: the most layers a
    micro-batch may recompute (0: none, FlexSP's GPT-7B protocol; None: all). ``patience``: split steps without improvement
    before the heuristic stops. ``homogeneous_top``: the best this many one-degree layouts by
    the exact group model are planned for the executor as well (:func:`homogeneous_finalists`).
    ``simulation``: the executor model of the group plans. ``bucket_parts``: a group's step may
    run in up to this many parts, each padded to its own bucket (docs/design/bucket-parts.md).
    ``local_search``: the assignments improved by moves and swaps on the additive model, and the
    fastest candidate also by moves on the exact group model (``sp_refine.refine_groups``).
    """

    milp: bool = True
    deterministic_time: float = 0.1
    time_limit_s: float = 2.0
    workers: int = 1
    seed: int = 0
    milp_classes: int = 24
    milp_linearization: int = 0
    milp_max_vars: int = 20000
    max_sp: Optional[int] = None
    micro_batch_tokens: Optional[int] = None
    max_recompute: Optional[int] = None
    patience: int = 6
    local_search: bool = True
    homogeneous_top: int = 2
    simulation: str = "paired"
    bucket_parts: int = 2

    def __post_init__(self):
        if self.simulation not in SIMULATIONS:
            raise ValueError(f"FlexSPOptions.simulation must be one of {SIMULATIONS}, got {self.simulation!r}")
        if min(self.patience, self.deterministic_time, self.time_limit_s, self.homogeneous_top) < 0 or self.workers < 1:
            raise ValueError(
                "FlexSPOptions: workers >= 1; patience, deterministic_time, time_limit_s, homogeneous_top >= 0"
            )


# --------------------------------------------------------------------------- data


@dataclasses.dataclass
class FlexSPProblem:
    """One iteration's assignment problem: the :class:`WorkTable` over every scheme, in integer µs
    (``work_us [D, S]``, -1 where a document does not fit), and the device count.

    A solution is a list of groups ``(s, rows)``; its objective is :meth:`makespan_us`."""

    table: WorkTable
    num_devices: int
    sp: np.ndarray  # [S] group sizes
    work_us: np.ndarray  # [D, S] int64, -1 = not eligible
    mbc_us: np.ndarray  # [S]
    base_us: np.ndarray  # [S]

    @classmethod
    def build(cls, lengths: Sequence[int], gc: GroupCosts) -> "FlexSPProblem":
        table = WorkTable.build(lengths, gc, gc.schemes)
        work = np.where(np.isfinite(table.work), np.round(np.where(np.isfinite(table.work), table.work, 0) * _US), -1)
        return cls(
            table=table,
            num_devices=gc.num_devices,
            sp=np.array([s.sp for s in table.schemes], dtype=np.int64),
            work_us=work.astype(np.int64),
            mbc_us=np.round(table.mbc * _US).astype(np.int64),
            base_us=np.round(table.base * _US).astype(np.int64),
        )

    @property
    def n_docs(self) -> int:
        return self.work_us.shape[0]

    def load_us(self, s: int, rows: Sequence[int]) -> int:
        rows = list(rows)
        if not rows:
            return 0
        if any(self.work_us[i, s] < 0 for i in rows):
            return math.inf
        t = self.table
        short = sum(int(t.tokens[i]) for i in rows if t.short[i, s])
        m = -(-short // int(t.cap[s])) if short else 0
        return int(self.base_us[s] + sum(int(self.work_us[i, s]) for i in rows) + self.mbc_us[s] * m)

    def makespan_us(self, groups: Sequence[tuple[int, Sequence[int]]]) -> float:
        """The MILP's objective for ``groups``; ``inf`` if they use too many devices, miss or repeat a
        document, or put one where it does not fit."""
        rows = sorted(i for _, r in groups for i in r)
        if rows != list(range(self.n_docs)) or sum(int(self.sp[s]) for s, r in groups if r) > self.num_devices:
            return math.inf
        return max((self.load_us(s, r) for s, r in groups if r), default=0)


# --------------------------------------------------------------------------- model


def document_classes(problem: FlexSPProblem, max_classes: int) -> list[list[int]]:
    """Rows grouped into at most ``max_classes`` classes the MILP counts instead of placing one by
    one: every document its own class when there are few enough (the exact MILP); otherwise the
    longest ``max_classes // 2`` alone and the rest, length-sorted, cut into classes of equal token
    mass by the Eq. 23-24 DP."""
    t = problem.table
    order = sorted(range(problem.n_docs), key=lambda i: (-int(t.tokens[i]), i))
    if problem.n_docs <= max_classes:
        return [[i] for i in order]
    alone = max(1, max_classes // 2)
    rest = order[alone:]
    k = min(len(rest), max_classes - alone)
    ends = balanced_split([int(t.tokens[i]) for i in rest], k)
    starts = [0, *ends[:-1]]
    return [[i] for i in order[:alone]] + [rest[b:e] for b, e in zip(starts, ends)]


def lower_bound_us(problem: FlexSPProblem) -> int:
    """A makespan no assignment beats: the longest single-document group, and the device time of
    every document at its cheapest scheme (plus one micro-batch and base per device) spread over N."""
    fit = problem.work_us >= 0
    own_mb = np.where(problem.table.short, problem.mbc_us[None, :], 0)  # a long document's work has its own
    alone = np.where(fit, problem.work_us + problem.base_us[None, :] + own_mb, np.iinfo(np.int64).max)
    single = int(alone.min(axis=1).max())
    device_us = np.where(fit, problem.work_us * problem.sp[None, :], np.iinfo(np.int64).max).min(axis=1).sum()
    spread = int((device_us + problem.num_devices * int(problem.base_us.min())) // problem.num_devices)
    return max(single, spread)


@dataclasses.dataclass
class _Model:
    model: cp_model.CpModel
    x: dict  # (c, s, j) -> IntVar: documents of class c on slot (s, j)
    slots: list  # (s, j)
    classes: list  # rows per class


def _cp_model(problem: FlexSPProblem, classes: list, hint: Optional[list], upper_us: Optional[int]) -> _Model:
    """Model step over document classes (see the module docstring; a class of one document is the
    per-document MILP). A class's documents are priced at their mean work and tokens."""
    t = problem.table
    n_s = len(problem.sp)
    size = [len(c) for c in classes]
    work = np.array(
        [
            [problem.work_us[c, s].mean() if (problem.work_us[c, s] >= 0).all() else -1 for s in range(n_s)]
            for c in classes
        ]
    )
    work = np.round(work).astype(np.int64)
    tokens = np.array([int(round(t.tokens[c].mean())) for c in classes], dtype=np.int64)
    short = np.array([[bool(t.short[c, s].all()) for s in range(n_s)] for c in classes])
    eligible = work >= 0
    if upper_us is not None:  # a class member whose group alone exceeds the hint's makespan never helps
        eligible &= work + problem.base_us[None, :] <= upper_us
    model = cp_model.CpModel()
    slots = [
        (s, j)
        for s in range(n_s)
        for j in range(min(problem.num_devices // int(problem.sp[s]), int(np.dot(eligible[:, s], size))))
    ]
    x = {}
    for s, j in slots:
        for c in range(len(classes)):
            if eligible[c, s]:
                x[c, s, j] = model.new_int_var(0, size[c], f"x{c},{s},{j}")
    horizon = (
        upper_us
        if upper_us is not None
        else int(problem.base_us.max() + problem.work_us.max(axis=1).sum() + problem.mbc_us.max() * problem.n_docs)
    )
    z = model.new_int_var(0, int(horizon), "z")
    total_tokens = int(t.tokens.sum())
    loads, ys, ms = {}, {}, {}
    for s, j in slots:
        y = ys[s, j] = model.new_bool_var(f"y{s},{j}")
        xs = [(c, x[c, s, j]) for c in range(len(classes)) if (c, s, j) in x]
        for c, v in xs:
            model.add(v <= size[c] * y)
        model.add(sum(v for _, v in xs) >= y)
        cap = max(1, int(t.cap[s]))
        m = ms[s, j] = model.new_int_var(0, -(-total_tokens // cap), f"m{s},{j}")
        shorts = [(int(tokens[c]), v) for c, v in xs if short[c, s]]
        if shorts:
            model.add(cap * m >= cp_model.LinearExpr.weighted_sum([v for _, v in shorts], [a for a, _ in shorts]))
        else:
            model.add(m == 0)
        loads[s, j] = cp_model.LinearExpr.weighted_sum(
            [v for _, v in xs] + [m, y],
            [int(work[c, s]) for c, _ in xs] + [int(problem.mbc_us[s]), int(problem.base_us[s])],
        )
        model.add(loads[s, j] <= z)
    for c in range(len(classes)):
        model.add(sum(x[c, s, j] for (s, j) in slots if (c, s, j) in x) == size[c])
    model.add(
        cp_model.LinearExpr.weighted_sum([ys[g] for g in slots], [int(problem.sp[g[0]]) for g in slots])
        <= problem.num_devices
    )
    for s, j in slots:  # symmetry: slots of one size used in order, loads non-increasing
        if (s, j + 1) in ys:
            model.add_implication(ys[s, j + 1], ys[s, j])
            model.add(loads[s, j] >= loads[s, j + 1])
    model.add(sum(int(problem.sp[s]) * loads[s, j] for s, j in slots) <= problem.num_devices * z)  # device time
    model.add(z >= lower_bound_us(problem))
    model.minimize(z)
    if hint is not None:
        _add_hint(model, problem, classes, hint, slots, x, ys, ms, z, work, tokens, short)
    return _Model(model, x, slots, classes)


def _add_hint(model, problem, classes, groups, slots, x, ys, ms, z, work, tokens, short) -> None:
    """Hints every variable from groups ``[(s, rows)]``: per size, groups by model load descending."""
    cls_of = {i: c for c, rows in enumerate(classes) for i in rows}
    by_slot, span = {}, 0
    for s in range(len(problem.sp)):
        mine = []
        for _, rows in ((ss, r) for ss, r in groups if ss == s):
            counts: dict[int, int] = {}
            for i in rows:
                counts[cls_of[i]] = counts.get(cls_of[i], 0) + 1
            tok = sum(int(tokens[c]) * n for c, n in counts.items() if short[c, s])
            m = -(-tok // max(1, int(problem.table.cap[s])))
            load = int(problem.base_us[s] + sum(int(work[c, s]) * n for c, n in counts.items()) + problem.mbc_us[s] * m)
            mine.append((-load, min(rows), counts, m))
        for j, (neg, _, counts, m) in enumerate(sorted(mine)):
            by_slot[s, j] = (counts, m)
            span = max(span, -neg)
    for g in slots:
        counts, m = by_slot.get(g, ({}, 0))
        model.add_hint(ys[g], g in by_slot)
        model.add_hint(ms[g], m)
        for c in range(len(classes)):
            if (c, *g) in x:
                model.add_hint(x[c, *g], counts.get(c, 0))
    model.add_hint(z, span)


# --------------------------------------------------------------------------- solve


def solve(
    problem: FlexSPProblem, options: FlexSPOptions, hint: Optional[list], classes: Optional[list] = None
) -> tuple[Optional[list], str, list]:
    """Solve step: CP-SAT over ``classes`` (default: one per document) with ``hint`` (groups
    ``[(s, rows)]``) under the options' limits, status checked. Returns (groups ``[(s, rows)]`` or
    None, status name, events); the solution's documents are placed class by class
    (:func:`_place`) and re-checked."""
    classes = classes if classes is not None else [[i] for i in range(problem.n_docs)]
    events = []
    upper = None
    if hint is not None and len(classes) == problem.n_docs:
        value = problem.makespan_us(hint)
        upper = int(value) if math.isfinite(value) else None
    m = _cp_model(problem, classes, hint, upper)
    solver = cpsat.solver(options.time_limit_s, options.deterministic_time, options.workers, options.seed)
    # Presolve, probing and the LP relaxation cost more than they find here (measured on GPT-7B /
    # github iterations: with them CP-SAT spent a 0.1-0.3 deterministic budget before even taking
    # the hint, status UNKNOWN; without, it starts from the hint and proves it optimal or improves it).
    solver.parameters.cp_model_presolve = False
    solver.parameters.cp_model_probing_level = 0
    solver.parameters.linearization_level = int(options.milp_linearization)
    status = solver.solve(m.model)
    name = solver.status_name(status)
    if status != cp_model.OPTIMAL and status != cp_model.INFEASIBLE:
        if solver.deterministic_time < 0.999 * options.deterministic_time:
            events.append(
                f"flexsp: MILP stopped by the wall-clock limit ({options.time_limit_s} s, status {name}); "
                "the plan may differ between runs"
            )
        else:
            events.append(
                f"flexsp: MILP stopped by its deterministic time limit ({options.deterministic_time}, {name})"
            )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, name, events
    counts: dict = {g: {} for g in m.slots}
    for (c, s, j), v in m.x.items():
        n = solver.value(v)
        if n:
            counts[s, j][c] = n

    groups = _place(problem, classes, [(s, counts[s, j]) for s, j in m.slots if counts[s, j]])
    if not math.isfinite(problem.makespan_us(groups)):
        events.append(f"flexsp: MILP solution ({name}) failed the re-check; heuristic used")
        return None, name, events
    return groups, name, events


def _place(problem: FlexSPProblem, classes: list, slots: list) -> list[tuple[int, list[int]]]:
    """Documents onto the MILP's slots ``[(s, {class: count})]``: class by class (longest first),
    each document, longest first, to the slot with room for its class where the group is least
    loaded so far (exact for classes of one document)."""
    t = problem.table
    members: list[list[int]] = [[] for _ in slots]
    loads = [float(t.base[s]) for s, _ in slots]
    left = [dict(c) for _, c in slots]
    for c, rows in enumerate(classes):
        for i in sorted(rows, key=lambda i: (-int(t.tokens[i]), i)):
            room = [g for g in range(len(slots)) if left[g].get(c, 0) > 0]
            g = min(room, key=lambda g: (loads[g], g))
            left[g][c] -= 1
            members[g].append(i)
            loads[g] += float(t.work[i, slots[g][0]])
    return [(s, m) for (s, _), m in zip(slots, members) if m]


def n_assignment_vars(problem: FlexSPProblem, classes: list) -> int:
    """Assignment variables of the model over ``classes`` (before pruning by the hint's makespan)."""
    eligible = np.array([[(problem.work_us[c, s] >= 0).all() for s in range(len(problem.sp))] for c in classes])
    size = np.array([len(c) for c in classes])
    total = 0
    for s in range(len(problem.sp)):
        slots = min(problem.num_devices // int(problem.sp[s]), int(np.dot(eligible[:, s], size)))
        total += slots * int(eligible[:, s].sum())
    return total


# --------------------------------------------------------------------------- extract + policy


def extract(lengths: Sequence[int], gc: GroupCosts, problem: FlexSPProblem, groups: list) -> list[GroupChoice]:
    """Extract step: groups ``[(s, rows)]`` as :class:`GroupChoice` with Eq. 23-24 micro-batches."""
    t = problem.table
    return [gc.flex_group(lengths, t.schemes[s], [t.docs[i] for i in rows]) for s, rows in groups]


@register_policy("flexsp", FlexSPOptions)
def plan(lengths: Sequence[int], costs: SchemeCosts, options: Optional[FlexSPOptions] = None) -> StrategyPlan:
    """FlexSP's strategy for one iteration of ``lengths`` (see the module docstring)."""
    t0 = time.perf_counter()
    options = options or FlexSPOptions()
    lengths = document_lengths(lengths)
    gc = group_costs_for(costs, options)
    bad = infeasible_documents(lengths, gc)
    if bad:
        raise PlanningError(too_long_message("flexsp", lengths, gc, bad))
    problem = FlexSPProblem.build(lengths, gc)
    events: list[str] = []
    greedy = heuristic(problem, options.patience, options.local_search)
    t_heur = time.perf_counter() - t0
    finalists = {"heuristic": greedy}
    classes = document_classes(problem, options.milp_classes)
    status, n_vars = "skipped", n_assignment_vars(problem, classes)
    if problem.makespan_us(greedy) <= lower_bound_us(problem):
        status = "heuristic at the lower bound"
    elif (
        options.milp and n_vars <= options.milp_max_vars and options.deterministic_time > 0 and options.time_limit_s > 0
    ):
        groups, status, solve_events = solve(problem, options, greedy, classes)
        events.extend(solve_events)
        if groups is not None:
            if len(classes) < problem.n_docs and options.local_search:  # repair the class averaging
                sizes = [s for s, _ in groups]
                groups = list(zip(sizes, problem.table.improve(sizes, [r for _, r in groups])))
                groups = [(s, r) for s, r in groups if r]
            finalists["milp"] = groups
    elif options.milp and n_vars > options.milp_max_vars:
        events.append(f"flexsp: MILP skipped ({n_vars} assignment variables > milp_max_vars={options.milp_max_vars})")

    def exact_time(groups) -> float:  # the group model with the executor's padding (where simulated so)
        return gc.strategy_time(lengths, extract(lengths, gc, problem, groups))

    finalists.update(homogeneous_finalists(problem, options.homogeneous_top, options.local_search, exact_time))
    candidates, options_of = [], []
    for name, groups in finalists.items():
        choices = extract(lengths, gc, problem, groups)
        record = candidate_record(lengths, gc, choices, source=name, model_makespan_s=problem.makespan_us(groups) / _US)
        candidates.append(record)
        options_of.append((choices, record))
    if options.local_search:  # the fastest by the exact group model, documents moved where padding makes that pay
        first = min(range(len(candidates)), key=lambda i: (candidates[i]["iteration_time_s"], i))
        refined = refine_groups(lengths, gc, options_of[first][0])
        if gc.strategy_time(lengths, refined) < candidates[first]["iteration_time_s"]:
            t, row = problem.table, {d: i for i, d in enumerate(problem.table.docs)}
            rows = [(t.schemes.index(c.scheme), [row[d] for d in c.documents]) for c in refined]
            record = candidate_record(
                lengths,
                gc,
                refined,
                source="refined",
                refined_from=candidates[first]["source"],
                model_makespan_s=problem.makespan_us(rows) / _US,
            )
            candidates.append(record)
            options_of.append((refined, record))
    searched = [c["model_makespan_s"] for c in candidates if c["source"] in ("heuristic", "milp")]
    stats = {
        "milp_status": status,
        "milp_vars": n_vars,
        "heuristic_seconds": t_heur,
        "candidates": candidates,
        "heuristic_gap": searched[0] / min(searched) - 1.0,
    }
    best, plan = assemble_fastest("flexsp", lengths, gc, options_of, options.simulation, t0, stats, events)
    plan.stats["source"] = candidates[best]["source"]
    return plan


__all__ = ["FlexSPOptions", "FlexSPProblem", "heuristic", "homogeneous_finalists", "plan", "solve"]
