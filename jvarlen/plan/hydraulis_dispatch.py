"""Dispatching documents across pipelines (Hydraulis §6.2): Eq. 2 bound, Eq. 3 ILP, App. D Alg. 1.

A strategy's ``D`` pipelines (schemes ``P_j``) share the ``B`` documents of an iteration. The
load of pipeline ``j`` is Eq. 2's lower bound of its packed time (App. D.1)::

    κ_j (Σ_i m_ij w(l_i, P_j)  +  c_j · V_min)  +  T(max_i m_ij l_i, P_j) · (PP(P_j) - 1)  +  F_j

where ``w`` is a document's work with the recomputation it needs alone and ``c_j`` the
per-micro-batch constant (:mod:`jvarlen.plan.hydraulis_costs`): Hydraulis' ``Σ T(l_i, P_j)``
charges ``c`` once per document, we charge it once per micro-batch the pipeline needs at
least (``V_min`` = documents above the packing capacity + ``⌈other tokens / capacity⌉``).
It is still a lower bound of Eq. 1 (D.1's argument: ``V · max ≥ Σ over micro-batches``); κ_j is
the lock-step executor's factor (1 in the paper, :mod:`jvarlen.plan.hydraulis_costs`) and F_j the
group's step overhead (optimizer update and its stage's parameter/gradient sync), which
``predicted_time`` charges per group and an empty pipeline does not pay.
Eq. 3 minimises the largest load; a document may go to pipeline ``j`` only if
``l_i ≤ MaxLen(P_j)``.

* :func:`greedy_dispatch` — App. D Alg. 1, all trials at once: the state of every trial is a
  row of ``[T, D]`` arrays and one step places the k-th document of every trial's permutation.
  A document goes to the pipeline that minimises the largest load after placing it (line 11);
  **ties** (common: the largest load usually sits elsewhere) go to the pipeline whose own load
  stays smallest, not to the first index as in line 12 — first-index ties pile short documents
  onto one pipeline until it becomes the slowest. Trial 0 visits documents longest first (an
  LPT order; ``lpt_trial=False`` for the paper's all-random trials), the rest in seeded random
  orders.
* :func:`exact_dispatch` — Eq. 3 as a CP-SAT model (small instances, to measure the gap).

Pure numpy + OR-Tools: nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np
from ortools.sat.python import cp_model

from jvarlen.plan import cpsat
from jvarlen.plan.hydraulis_costs import SchemeTable
from jvarlen.plan.hydraulis_pack import v_upper


@dataclasses.dataclass(frozen=True)
class DispatchProblem:
    """Data of Eq. 2/3 for ``B`` documents and ``D`` pipelines (seconds, tokens).

    ``work [B, D]``: w(l_i, P_j) with recomputation (inf where ``l_i > MaxLen(P_j)``);
    ``extra [B, D]``: T(l_i, P_j)·(PP(P_j) − 1); ``short_tokens [B, D]``: l_i where it packs
    (``l_i ≤ cap_j``) else 0; ``long [B, D]``: 1 where it is a micro-batch of its own;
    ``const [D]``: c_j; ``cap [D]``: packing capacity (tokens); ``lengths [B]``; ``pp [D]``;
    ``util [D]``: UtilLen (App. C); ``steady [D]``: κ, the executor's cost of a micro-batch in the
    pipeline's steady state in units of T (:mod:`jvarlen.plan.hydraulis_costs`; 1 in the paper);
    ``fixed [D]``: the group's step overhead, paid once it has a document (optimizer update and its
    stage's parameter/gradient sync: ``predicted_time`` charges it per group).
    """

    lengths: np.ndarray
    work: np.ndarray
    extra: np.ndarray
    short_tokens: np.ndarray
    long: np.ndarray
    const: np.ndarray
    cap: np.ndarray
    pp: np.ndarray
    util: np.ndarray
    steady: np.ndarray
    fixed: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.work.shape

    @classmethod
    def build(cls, lengths: Sequence[int], tables: Sequence[SchemeTable]) -> "DispatchProblem":
        """One column per pipeline (``tables[j]`` of its scheme; pipelines of one scheme share the math)."""
        l = np.asarray(lengths, dtype=np.int64)
        cols: dict[int, tuple] = {}
        for t in tables:
            if id(t) not in cols:
                short = l <= t.cap0
                work = t.doc_work(l)
                cols[id(t)] = (
                    work,
                    np.where(np.isfinite(work), t.doc_time(l) * (t.pp - 1) if t.pp > 1 else 0.0, 0.0),
                    np.where(short, l, 0),
                    (~short).astype(np.int64),
                )
        pick = [cols[id(t)] for t in tables]
        return cls(
            lengths=l,
            work=np.stack([p[0] for p in pick], axis=1),
            extra=np.stack([p[1] for p in pick], axis=1),
            short_tokens=np.stack([p[2] for p in pick], axis=1),
            long=np.stack([p[3] for p in pick], axis=1),
            const=np.array([t.c for t in tables], dtype=np.float64),
            cap=np.array([max(1, t.cap0) for t in tables], dtype=np.float64),
            pp=np.array([t.pp for t in tables], dtype=np.float64),
            util=np.array([t.util_len for t in tables], dtype=np.float64),
            steady=np.array([t.steady for t in tables], dtype=np.float64),
            fixed=np.array([t.overhead_s for t in tables], dtype=np.float64),
        )

    def feasible(self) -> np.ndarray:
        """``[B, D]`` bool: document i fits on pipeline j."""
        return np.isfinite(self.work)

    def loads(self, assign: np.ndarray) -> np.ndarray:
        """``[D]`` Eq. 2 of every pipeline for ``assign [B]`` (pipeline of each document)."""
        B, D = self.shape
        assign = np.asarray(assign, dtype=np.int64)
        rows = np.arange(B)
        work = np.bincount(assign, weights=self.work[rows, assign], minlength=D)
        tok = np.bincount(assign, weights=self.short_tokens[rows, assign], minlength=D)
        nl = np.bincount(assign, weights=self.long[rows, assign], minlength=D)
        extra = np.zeros(D)
        np.maximum.at(extra, assign, self.extra[rows, assign])
        count = np.bincount(assign, minlength=D)
        v = nl + np.ceil(tok / self.cap)
        return np.where(count > 0, self.steady * (work + self.const * v) + extra + self.fixed, 0.0)

    def pack_bounds(self, assign: np.ndarray, prune: bool = True, objective: str = "sum") -> np.ndarray:
        """``[D]`` the least packing objective (:mod:`jvarlen.plan.hydraulis_pack`) any packing of each
        pipeline's documents can reach: the minimum over V' of the objective with the slowest packed
        micro-batch at its bound ``c + max(w_max, W / V')`` (``W``, ``w_max``: the packable documents'
        work; long documents, above the capacity, alone). ``"eq1"``: ``(PP - 1 + κ (n_long + V')) ·
        max(t_long, ·)``; ``"sum"``: ``(PP - 1) · max(t_long, ·) + κ (W + Σ t_long + V' c)``. Both are
        convex in V', so the integers around their breakpoints hold the minimum."""
        B, D = self.shape
        assign = np.asarray(assign, dtype=np.int64)
        rows = np.arange(B)
        w = self.work[rows, assign]
        is_long = self.long[rows, assign] > 0
        n_long = np.bincount(assign, weights=is_long, minlength=D)
        t_long = np.zeros(D)
        long_t = np.where(is_long, w + self.const[assign], 0.0)
        np.maximum.at(t_long, assign, long_t)
        long_sum = np.bincount(assign, weights=long_t, minlength=D)
        short_w = np.where(is_long, 0.0, w)
        W = np.bincount(assign, weights=short_w, minlength=D)
        w_max = np.zeros(D)
        np.maximum.at(w_max, assign, short_w)
        n_short = np.bincount(assign, weights=~is_long, minlength=D)
        tok = np.bincount(assign, weights=self.short_tokens[rows, assign], minlength=D)
        lo = np.where(n_short > 0, np.maximum(1, np.ceil(tok / self.cap)), 0)
        hi = np.minimum(n_short, np.floor(tok / self.util)) if prune else n_short
        hi = np.maximum(np.maximum(lo, hi), v_upper(tok, self.cap, n_short))  # (the packing's range)
        k, c, pp1 = self.steady, self.const, self.pp - 1
        with np.errstate(divide="ignore", invalid="ignore"):
            if objective == "eq1":
                balance = np.sqrt((pp1 + k * n_long) * W / (k * c))
            else:
                balance = np.sqrt(pp1 * W / (k * c))
            points = [lo, hi, balance, W / w_max, W / (t_long - c)]
        best = np.full(D, np.inf)
        for x in points:
            for v in (np.floor(x), np.ceil(x)):
                v = np.clip(np.where(np.isfinite(v), v, 0.0), lo, hi)
                with np.errstate(divide="ignore", invalid="ignore"):
                    top = np.maximum(t_long, np.where(v > 0, c + np.maximum(w_max, W / v), 0.0))
                if objective == "eq1":
                    value = (pp1 + k * (n_long + v)) * top
                else:
                    value = pp1 * top + k * (W + long_sum + v * c)
                best = np.minimum(best, value)
        return np.where(n_short + n_long > 0, best, 0.0)

    def objective(self, assign: np.ndarray) -> float:
        """Eq. 3's objective: the largest Eq. 2 load."""
        return float(self.loads(assign).max(initial=0.0))


@dataclasses.dataclass(frozen=True)
class DispatchResult:
    """``assign [B]``: pipeline of each document; ``loads [D]``: Eq. 2 per pipeline."""

    assign: np.ndarray
    loads: np.ndarray
    objective_s: float
    source: str  # "greedy", "cp-sat", "cp-sat-limit", "greedy-fallback"
    trial_objectives: Optional[np.ndarray] = None  # [T] greedy: every trial's objective


def trial_orders(lengths: Sequence[int], trials: int, seed, lpt_trial: bool = True) -> np.ndarray:
    """``[T, B]`` document orders (Alg. 1 line 3): trial 0 longest first (when ``lpt_trial``), the
    others seeded permutations. They depend on the lengths only, so every candidate strategy of an
    iteration sees the same orders (common random numbers)."""
    B = len(lengths)
    rng = np.random.default_rng(seed)
    orders = rng.permuted(np.tile(np.arange(B), (max(1, trials), 1)), axis=1)
    if lpt_trial:
        orders[0] = np.lexsort((np.arange(B), -np.asarray(lengths, dtype=np.int64)))
    return orders


def greedy_dispatch(problem: DispatchProblem, trials: int = 32, seed=0, lpt_trial: bool = True) -> DispatchResult:
    """App. D Alg. 1 for one strategy (see :func:`greedy_dispatch_many`)."""
    order = trial_orders(problem.lengths, trials, seed, lpt_trial)
    return greedy_dispatch_many([problem], order)[0]


def greedy_dispatch_many(problems: Sequence[DispatchProblem], orders: np.ndarray) -> list[DispatchResult]:
    """App. D Alg. 1 for several strategies of one batch and all their trials at once, strategies with
    similar numbers of pipelines batched together (:func:`_greedy_batch`)."""
    buckets: dict[bool, list[int]] = {}  # two batches: few pipelines and many (less padding, few numpy calls)
    for c, p in enumerate(problems):
        buckets.setdefault(p.shape[1] > 16, []).append(c)
    out: list[Optional[DispatchResult]] = [None] * len(problems)
    for members in buckets.values():
        for c, res in zip(members, _greedy_batch([problems[c] for c in members], orders)):
            out[c] = res
    return out  # type: ignore[return-value]


def _greedy_batch(problems: Sequence[DispatchProblem], orders: np.ndarray) -> list[DispatchResult]:
    """App. D Alg. 1 for several strategies of one batch and all their trials at once.

    ``orders [T, B]`` (:func:`trial_orders`) is shared by the ``C`` strategies; the state of
    (strategy c, trial t) is row ``c·T + t`` of ``[C·T, D]`` arrays (D = the most pipelines, the
    others padded with pipelines nothing fits on); step k places document ``orders[t, k]`` of every
    row (lines 5-14), and each strategy keeps its best trial (lines 15-17)."""
    C = len(problems)
    if C == 0:
        return []
    B = problems[0].shape[0]
    D = max(p.shape[1] for p in problems)
    T = orders.shape[0]
    if B == 0:
        return [
            DispatchResult(np.zeros(0, np.int64), np.zeros(p.shape[1]), 0.0, "greedy", np.zeros(T)) for p in problems
        ]
    for p in problems:
        if p.shape[0] != B:
            raise ValueError("all strategies must dispatch the same documents")
        if not np.all(p.feasible().any(axis=1)):
            raise ValueError("a document fits on no pipeline of the strategy")

    def pad(name: str, fill: float) -> np.ndarray:  # [C, B, D] or [C, D]
        out = []
        for p in problems:
            x = getattr(p, name)
            width = [(0, 0)] * (x.ndim - 1) + [(0, D - x.shape[-1])]
            out.append(np.pad(x.astype(np.float64), width, constant_values=fill))
        return np.stack(out)

    cap = pad("cap", 1.0)  # [C, D]
    # tokens that count towards V_min: a packable document its length, a long one a whole micro-batch
    vtok = pad("short_tokens", 0.0) + pad("long", 0.0) * cap[:, None, :]
    per_doc = np.stack([pad("work", np.inf), pad("extra", 0.0), vtok], axis=-1)  # [C, B, D, 3]
    const = np.repeat(pad("const", 0.0), T, axis=0)  # [C·T, D]
    steady = np.repeat(pad("steady", 1.0), T, axis=0)
    fixed = np.repeat(pad("fixed", 0.0), T, axis=0)
    cap = np.repeat(cap, T, axis=0)
    R = C * T
    rows = np.arange(R)
    work_c, ext, tok, load = (np.zeros((R, D)) for _ in range(4))  # C_j, E_j of Alg. 1, tokens, load
    assign = np.empty((C, T, B), dtype=np.int64)
    trial = np.arange(T)
    for k in range(B):
        i = orders[:, k]
        step = per_doc[:, i].reshape(R, D, 3)
        new_c = work_c + step[..., 0]
        new_e = np.maximum(ext, step[..., 1])
        new_tok = tok + step[..., 2]
        new = steady * (new_c + const * np.ceil(new_tok / cap)) + new_e + fixed
        # O_max of line 11: max(new_j, max_{k≠j} load_k) = max(new_j, max_k load_k) since new_j ≥ load_j
        worst = np.maximum(new, load.max(axis=1, keepdims=True))  # inf where the document does not fit
        best = worst.min(axis=1, keepdims=True)
        j = np.where(worst <= best * (1 + 1e-12), new, np.inf).argmin(axis=1)  # ties: least own load
        work_c[rows, j] = new_c[rows, j]
        ext[rows, j] = new_e[rows, j]
        tok[rows, j] = new_tok[rows, j]
        load[rows, j] = new[rows, j]
        assign[:, trial, i] = j.reshape(C, T)
    objectives = load.max(axis=1).reshape(C, T)
    out = []
    for c, p in enumerate(problems):
        t = int(objectives[c].argmin())
        a = assign[c, t]
        out.append(DispatchResult(a, p.loads(a), float(objectives[c, t]), "greedy", objectives[c]))
    return out


def _pipe_load(kappa, const, cap, fixed, work, tok, extra, count):
    """Eq. 2 from a pipeline's aggregates (numpy-broadcasting): κ (Σw + c ⌈tokens / cap⌉) + max extra
    + the group's step overhead."""
    return np.where(count > 0, kappa * (work + const * np.ceil(tok / cap)) + extra + fixed, 0.0)


def local_search(problem: DispatchProblem, assign: np.ndarray, rounds: int = 64) -> DispatchResult:
    """Improves a dispatch while that lowers the largest Eq. 2 load: each round moves one document off
    the slowest pipeline j, or swaps one of j's documents with a document of another pipeline,
    whichever gives the smallest largest load; every move and swap of a round is priced at once from
    per-pipeline aggregates. Not in the paper: Alg. 1's trials alone were up to 11 % above Eq. 3's
    optimum on small instances (``scripts/bench_strategies.py --parts gap``)."""
    B, D = problem.shape
    assign = np.asarray(assign, dtype=np.int64).copy()
    if D < 2 or B == 0:
        return DispatchResult(assign, problem.loads(assign), problem.objective(assign), "greedy")
    rows = np.arange(B)
    vt = problem.short_tokens + problem.long * problem.cap[None, :]
    kappa, const, cap, fixed = problem.steady, problem.const, problem.cap, problem.fixed
    for _ in range(rounds):
        w, ext = problem.work[rows, assign], problem.extra[rows, assign]
        work = np.bincount(assign, weights=w, minlength=D)
        tok = np.bincount(assign, weights=vt[rows, assign], minlength=D)
        count = np.bincount(assign, minlength=D)
        loads = _pipe_load(kappa, const, cap, fixed, work, tok, _max_at(ext, assign, D), count)
        j = int(loads.argmax())
        top = float(loads[j])
        mine, others = np.flatnonzero(assign == j), np.flatnonzero(assign != j)
        # the largest load outside pipelines j and k, for every k
        order = np.argsort(-loads)
        outside = np.where(np.arange(D) == order[1], loads[order[2]] if D > 2 else 0.0, loads[order[1]])
        e_left = _without_each(ext, assign, mine)  # j's largest extra once each of its documents leaves
        l_j = _pipe_load(
            kappa[j], const[j], cap[j], fixed[j], work[j] - w[mine], tok[j] - vt[mine, j], e_left, count[j] - 1
        )
        # moves: document mine[a] to pipeline k  -> [m, D]
        l_k = _pipe_load(
            kappa, const, cap, fixed, work + problem.work[mine], tok + vt[mine],
            np.maximum(_max_at(ext, assign, D), problem.extra[mine]), count + 1,
        )  # fmt: skip
        move = np.maximum(np.maximum(l_j[:, None], l_k), outside[None, :])
        move[:, j] = np.inf
        move[~np.isfinite(move)] = np.inf
        best = (float(move.min(initial=np.inf)), "move")
        if others.size:  # swaps: mine[a] with others[b] (in pipeline k = assign[others[b]])  -> [m, n]
            k = assign[others]
            lj2 = _pipe_load(
                kappa[j], const[j], cap[j], fixed[j],
                (work[j] - w[mine])[:, None] + problem.work[others, j][None, :],
                (tok[j] - vt[mine, j])[:, None] + vt[others, j][None, :],
                np.maximum(e_left[:, None], problem.extra[others, j][None, :]), count[j],
            )  # fmt: skip
            lk2 = _pipe_load(
                kappa[k], const[k], cap[k], fixed[k],
                (work[k] - w[others])[None, :] + problem.work[mine[:, None], k[None, :]],
                (tok[k] - vt[others, k])[None, :] + vt[mine[:, None], k[None, :]],
                np.maximum(_without_each(ext, assign, others)[None, :], problem.extra[mine[:, None], k[None, :]]),
                count[k],
            )  # fmt: skip
            swap = np.maximum(np.maximum(lj2, lk2), outside[k][None, :])
            swap[~np.isfinite(swap)] = np.inf
            if swap.min(initial=np.inf) < best[0]:
                best = (float(swap.min()), "swap")
        if best[0] >= top * (1 - 1e-9):
            break
        if best[1] == "move":
            a, kk = np.unravel_index(int(move.argmin()), move.shape)
            assign[mine[a]] = kk
        else:
            a, b = np.unravel_index(int(swap.argmin()), swap.shape)
            assign[mine[a]], assign[others[b]] = assign[others[b]], j
    return DispatchResult(assign, problem.loads(assign), problem.objective(assign), "greedy+ls")


def _max_at(values: np.ndarray, assign: np.ndarray, D: int) -> np.ndarray:
    out = np.zeros(D)
    np.maximum.at(out, assign, values)
    return out


def _without_each(values: np.ndarray, assign: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """``[len(docs)]``: the largest value in each document's pipeline once that document leaves it."""
    same = (assign[docs][:, None] == assign[None, :]) & (docs[:, None] != np.arange(assign.size)[None, :])
    return np.where(same, values[None, :], 0.0).max(axis=1, initial=0.0)


def _cp_model(problem: DispatchProblem, hint: Optional[np.ndarray]):
    """Eq. 3 (with Eq. 2's per-micro-batch constant): booleans ``m_ij`` on feasible pairs."""
    B, D = problem.shape
    feas = problem.feasible()
    finite = np.concatenate([problem.work[feas] * 2, problem.extra[feas], problem.const * 2, problem.fixed])  # κ ≤ 2
    unit = max(float(finite.max(initial=0.0)), 1e-30) / 1e6

    def q(x: float) -> int:
        return int(round(x / unit))

    model = cp_model.CpModel()
    m = {(i, j): model.new_bool_var(f"m{i}_{j}") for i in range(B) for j in range(D) if feas[i, j]}
    for i in range(B):
        model.add_exactly_one([m[i, j] for j in range(D) if feas[i, j]])
    big = 2 * (sum(q(problem.work[i, j]) + q(problem.extra[i, j]) for (i, j) in m) + q(problem.const.max()) * (B + 1))
    big += q(problem.fixed.max(initial=0.0))
    top = model.new_int_var(0, big, "M")
    for j in range(D):
        items = [(i, x) for (i, jj), x in m.items() if jj == j]
        if not items:
            continue
        xs = [x for _, x in items]
        work = cp_model.LinearExpr.weighted_sum(xs, [q(problem.steady[j] * problem.work[i, j]) for i, _ in items])
        e = model.new_int_var(0, max(q(problem.extra[i, j]) for i, _ in items), f"E{j}")
        for i, x in items:
            model.add(e >= q(problem.extra[i, j])).only_enforce_if(x)
        used = model.new_bool_var(f"y{j}")
        for x in xs:
            model.add_implication(x, used)
        v = model.new_int_var(0, B, f"V{j}")
        nl = cp_model.LinearExpr.weighted_sum(xs, [int(problem.long[i, j]) for i, _ in items])
        tok = cp_model.LinearExpr.weighted_sum(xs, [int(problem.short_tokens[i, j]) for i, _ in items])
        model.add(int(problem.cap[j]) * (v - nl) >= tok)
        model.add(v >= nl)
        model.add(top >= work + q(problem.steady[j] * problem.const[j]) * v + e + q(problem.fixed[j]) * used)
    model.minimize(top)
    if hint is not None:
        for (i, j), x in m.items():
            model.add_hint(x, int(hint[i] == j))
    return model, m


def exact_dispatch(
    problem: DispatchProblem,
    time_limit_s: float = 10.0,
    deterministic_time: float = 20.0,
    seed: int = 0,
    hint: Optional[np.ndarray] = None,
) -> DispatchResult:
    """Eq. 3 solved by CP-SAT (greedy hint unless given; one worker; status checked; greedy fallback)."""
    B, D = problem.shape
    if hint is None:
        hint = greedy_dispatch(problem, trials=8, seed=seed).assign
    model, m = _cp_model(problem, hint)
    solver = cpsat.solver(time_limit_s, deterministic_time, 1, seed)
    status = solver.solve(model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        assign = np.full(B, -1, dtype=np.int64)
        for (i, j), x in m.items():
            if solver.value(x):
                assign[i] = j
        if np.all(assign >= 0):
            obj = problem.objective(assign)
            if obj <= problem.objective(hint) * (1 + 1e-6):
                src = "cp-sat" if status == cp_model.OPTIMAL else "cp-sat-limit"
                return DispatchResult(assign, problem.loads(assign), obj, src)
    return DispatchResult(hint, problem.loads(hint), problem.objective(hint), "greedy-fallback")


def brute_force_dispatch(problem: DispatchProblem, chunk: int = 8192) -> tuple[float, np.ndarray]:
    """Eq. 3 by enumerating all ``D^B`` assignments, vectorised (tests; keep ``D^B`` ≤ ~1e6)."""
    B, D = problem.shape
    if D**B > 2_000_000:
        raise ValueError(f"{D}^{B} assignments is too many to enumerate")
    work = np.where(np.isfinite(problem.work), problem.work, 0.0)
    vtok = problem.short_tokens + problem.long * problem.cap[None, :]
    best, arg = math.inf, None
    for start in range(0, D**B, chunk):
        codes = np.arange(start, min(D**B, start + chunk))
        grid = np.stack(np.unravel_index(codes, (D,) * B), axis=1) if B else np.zeros((codes.size, 0), np.int64)
        ok = np.all(np.isfinite(problem.work[np.arange(B), grid]), axis=1)
        onehot = grid[:, :, None] == np.arange(D)[None, None, :]  # [m, B, D]
        total = (onehot * work[None]).sum(axis=1)
        extra = (onehot * problem.extra[None]).max(axis=1, initial=0.0)
        v = np.ceil((onehot * vtok[None]).sum(axis=1) / problem.cap[None, :])
        loads = np.where(
            onehot.any(axis=1), problem.steady * (total + problem.const[None, :] * v) + extra + problem.fixed, 0.0
        )
        obj = np.where(ok, loads.max(axis=1, initial=0.0), np.inf)
        k = int(obj.argmin())
        if obj[k] < best:
            best, arg = float(obj[k]), grid[k].copy()
    return best, arg


__all__ = [
    "DispatchProblem",
    "DispatchResult",
    "brute_force_dispatch",
    "exact_dispatch",
    "greedy_dispatch",
    "greedy_dispatch_many",
    "trial_orders",
]
