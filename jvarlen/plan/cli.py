"""The planner command line (``python -m jvarlen.plan``): options, batches, summary, JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Optional

import numpy as np

from jvarlen.plan.api import (
    EPP_POLICIES,
    POLICIES,
    SIMULATIONS,
    PlannerOptions,
    PlanningError,
    make_cost,
    plan_iteration,
)
from jvarlen.plan.checkpointing import SolverOptions

PROGRESS_AFTER_S = 2.0  # planning that takes longer than this reports its progress on stderr

SUMMARY_FIELDS = (
    "policy",
    "solve_seconds",
    "iteration_time_s",
    "bubble_ratio",
    "peak_memory_bytes",
    "memory_budget_bytes",
    "tokens_in",
    "tokens_planned",
)


@dataclasses.dataclass
class PlanCli:
    """Options of ``python -m jvarlen.plan`` (``--batch-size`` and ``--batch_size`` both work).

    ``--policy`` is an elastic-pipeline policy (:data:`jvarlen.plan.api.POLICIES`, one layout from the
    config) or a strategy policy (:func:`jvarlen.plan.strategy.strategy_policies`: ``hydraulis``,
    ``homogeneous``, ...: device groups of different schemes on ``--devices`` devices)."""

    lengths: str  # file: one document length (tokens) per line
    config: str  # jvarlen YAML config: model shape and parallel.pp / parallel.sp / parallel.dp
    policy: str = "epp"  # one of jvarlen.plan.api.POLICIES or a strategy policy
    json: Optional[str] = None  # write the summary + per-iteration records here
    plan: Optional[str] = None  # write the last plan (JSON) here
    gantt: Optional[str] = None  # PNG Gantt chart of the first iteration planned
    batch_size: Optional[int] = None  # sample batches of this many documents from the file
    iterations: int = 1  # number of sampled batches (with --batch_size)
    seed: int = 0  # the batches sampled (with --batch_size) and the seed of a strategy policy that has one
    context: int = 0  # truncate documents to this many tokens (0: no truncation)
    cluster: str = "a800"  # analytic hardware profile (jvarlen.plan.hardware.CLUSTERS)
    zero3_sp: bool = True  # shard stage parameters/gradients over the SP group (InfiniPipe's ZeRO-3)
    time_limit: float = 0.05  # seconds per checkpointing MILP
    n_slices: int = 0  # fix Alg. 1's N (0: tune)
    # execution model: "async" (InfiniPipe's simulator), "ticks" (one op per stage and tick) or "paired"
    # (jvarlen's pipeline executor: a backward and a forward per tick); default: "async" for
    # the elastic-pipeline policies, the policy's own default ("paired") for strategy policies
    simulation: Optional[str] = None
    devices: int = 0  # strategy policies: devices of the run (0: the config's dp * pp * sp)

    def __post_init__(self):
        from jvarlen.plan.strategy import strategy_policies

        if self.policy not in POLICIES and self.policy not in strategy_policies():
            names = ", ".join(list(POLICIES) + sorted(strategy_policies()))
            raise InputError(f"--policy must be one of {names}, got {self.policy!r}")
        if self.iterations < 1:
            raise InputError(f"--iterations must be >= 1, got {self.iterations}")
        if self.simulation is not None and self.simulation not in SIMULATIONS:
            raise InputError(f"--simulation must be one of {', '.join(SIMULATIONS)}, got {self.simulation!r}")
        if self.devices < 0:
            raise InputError(f"--devices must be >= 0, got {self.devices}")
        # flags the chosen path would not read: refused, not ignored
        if self.iterations > 1 and self.batch_size is None:
            raise InputError("--iterations samples batches of --batch_size documents; without it the file is one batch")
        if self.devices and self.policy not in strategy_policies():
            raise InputError(f"--devices applies to the strategy policies; {self.policy} plans the config's dp*pp*sp")
        if self.simulation is not None and self.policy in strategy_policies():
            fields = {f.name for f in dataclasses.fields(strategy_policies()[self.policy][1])}
            if "simulation" not in fields:
                raise InputError(f"--simulation: {self.policy} plans with its own execution model")
        if self.batch_size is not None and self.batch_size < 1:
            raise InputError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.time_limit < 0 or self.n_slices < 0 or self.context < 0:
            raise InputError("--time_limit, --n_slices and --context must be >= 0")
        defaults = {f.name: f.default for f in dataclasses.fields(PlanCli)}
        ignored = [f"--{k}" for k in ("n_slices", "time_limit", "zero3_sp") if getattr(self, k) != defaults[k]]
        if self.policy in strategy_policies() and ignored:
            raise InputError(
                f"{', '.join(ignored)} apply to the elastic-pipeline policies; {self.policy} does not read them"
            )
        if self.n_slices and self.policy in POLICIES and self.policy not in EPP_POLICIES:
            raise InputError(f"--n_slices fixes EPP's N ({', '.join(EPP_POLICIES)}); {self.policy} does not read it")
        for flag in ("json", "plan", "gantt"):  # checked now, not after the planning they would keep
            path = getattr(self, flag)
            parent = os.path.dirname(os.path.abspath(path)) if path else None
            if parent is not None and not (os.path.isdir(parent) and os.access(parent, os.W_OK)):
                raise InputError(f"--{flag} {path}: its directory {parent!r} does not exist or is not writable")
        outputs = [os.path.abspath(p) for p in (self.json, self.plan, self.gantt) if p]
        if len(set(outputs)) < len(outputs):
            raise InputError("--json, --plan and --gantt name the same file: one would replace the other")
        # matplotlib's formats, by the chart's suffix: checked now, not after the planning (its results lost)
        if self.gantt and os.path.splitext(self.gantt)[1].lower() not in (".png", ".pdf", ".svg", ".jpg", ".jpeg"):
            raise InputError(f"--gantt {self.gantt}: name a .png, .pdf, .svg or .jpg file")


class InputError(ValueError):
    """A bad command-line value or input file; the message names the flag or file:line."""


def read_lengths(path: str) -> list[int]:
    """Document lengths, one per line (first field; ``#`` comments and blank lines skipped)."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise InputError(f"--lengths {path}: cannot read it ({reason})") from None
    for i, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        field = line.split()[0]
        try:
            value = int(field)
        except ValueError:
            raise InputError(f"{path}:{i}: document length must be a whole number of tokens, got {field!r}") from None
        if value < 1:
            raise InputError(f"{path}:{i}: document length must be >= 1, got {value}")
        out.append(value)
    if not out:
        raise InputError(f"{path}: no document lengths (one per line)")
    return out


def batches(lengths: list[int], batch_size: Optional[int], iterations: int, seed: int, context: int) -> list[list[int]]:
    """The batches to plan: the whole file, or ``iterations`` seeded samples of ``batch_size`` documents."""
    if context > 0:
        lengths = [min(x, context) for x in lengths]
    if batch_size is None:
        return [lengths]
    pool = np.asarray(lengths)
    return [
        [int(x) for x in pool[np.random.default_rng(seed + i).integers(0, pool.size, batch_size)]]
        for i in range(iterations)
    ]


def cost_from_config(path: str, cluster: str, zero3_sp: bool):
    """The analytic cost model of the config's model on ``cluster``, for the layout a training run of
    the config asks for (:func:`jvarlen.layout.resolve_layout`; auto pp: the stages it gets)."""
    from jvarlen.config import ConfigError, load_config
    from jvarlen.layout import resolve_layout
    from jvarlen.plan.hardware import CLUSTERS

    if cluster not in CLUSTERS:
        raise InputError(f"--cluster must be one of {', '.join(sorted(CLUSTERS))}, got {cluster!r}")
    try:
        cfg = load_config(path)
        layout = resolve_layout(cfg)
    except ConfigError as error:
        raise InputError(f"--config {path}: {error}") from None
    return make_cost(cfg.model, cluster, layout, zero3_sp=zero3_sp)


def run(cli: PlanCli) -> int:
    if cli.policy not in POLICIES:
        return run_strategy(cli)
    cost = cost_from_config(cli.config, cli.cluster, cli.zero3_sp)
    options = PlannerOptions(
        n_slices=cli.n_slices or None,
        solver=SolverOptions(time_limit_s=cli.time_limit),
        simulation=cli.simulation or "async",
    )
    records, last = [], None
    t_start = time.perf_counter()
    todo = batches(read_lengths(cli.lengths), cli.batch_size, cli.iterations, cli.seed, cli.context)
    for i, batch in enumerate(todo):
        t_iter = time.perf_counter()

        def progress(message: str, i=i, t_iter=t_iter) -> None:
            if time.perf_counter() - t_iter > PROGRESS_AFTER_S:  # quiet unless planning takes a while
                elapsed = time.perf_counter() - t_iter
                print(f"[plan] iteration {i + 1}/{len(todo)}: {message} ({elapsed:.0f} s)", file=sys.stderr, flush=True)

        if i and time.perf_counter() - t_start > PROGRESS_AFTER_S:
            print(
                f"[plan] iteration {i + 1}/{len(todo)} ({time.perf_counter() - t_start:.0f} s so far)",
                file=sys.stderr,
                flush=True,
            )
        try:
            plan = plan_iteration(batch, cost=cost, policy=cli.policy, options=options, progress=progress)
        except PlanningError as e:
            records.append({"iteration": i, "policy": cli.policy, "error": str(e), "tokens_in": sum(batch)})
            continue
        rec = {"iteration": i, **{k: plan.stats.get(k) for k in SUMMARY_FIELDS}}
        rec.update(
            fits_memory=plan.stats.get("fits_memory"),
            n_chunks=plan.n_chunks,
            n_units=len(plan.unit_sizes),
            events=plan.events,
        )
        records.append(rec)
        if last is None and cli.gantt:  # the first iteration planned
            from jvarlen.plan.assemble import simulate
            from jvarlen.plan.gantt import draw_gantt

            docs = tuple(tuple(piece[0] for piece in chunk) for chunk in plan.chunks)  # (doc, start, tokens)
            schedule = dataclasses.replace(plan.schedule, chunk_docs=docs)  # labelled by document, not chunk chain
            draw_gantt(simulate(plan, cost), schedule, cli.gantt, title=f"{cli.policy}: iteration {i}")
        last = plan
    summary = summarize(cli.policy, records)
    print(format_table(cli.policy, records, summary))
    _no_chart(cli, last)
    return _save(cli, summary, records, last)


def _no_chart(cli, planned) -> None:
    """Says on stderr that ``--gantt`` wrote nothing when no iteration was planned."""
    if cli.gantt and planned is None:
        print(f"[plan] --gantt {cli.gantt}: no iteration was planned, no chart written", file=sys.stderr)


def _save(cli, summary: dict, records: list[dict], last) -> int:
    """Writes ``--json`` (summary and every iteration's record) and ``--plan`` (the last plan);
    the exit code: 1 when an iteration could not be planned."""
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump({**summary, "iterations": records}, f, indent=1)
            f.write("\n")
    if cli.plan and last is not None:
        last.save(cli.plan)
    return 0 if all("error" not in r for r in records) else 1


def summarize(policy: str, records: list[dict]) -> dict:
    ok = [r for r in records if "error" not in r]
    out = {"policy": policy, "iterations_planned": len(ok), "iterations_failed": len(records) - len(ok)}
    if ok:
        for key in ("solve_seconds", "iteration_time_s", "bubble_ratio"):
            out[key] = statistics.median(r[key] for r in ok)
        out["peak_memory_bytes"] = [
            max(r["peak_memory_bytes"][p] for r in ok) for p in range(len(ok[0]["peak_memory_bytes"]))
        ]
        out["memory_budget_bytes"] = ok[0]["memory_budget_bytes"]
        out["tokens_in"] = sum(r["tokens_in"] for r in ok)
        out["tokens_planned"] = sum(r["tokens_planned"] for r in ok)
        out["fits_memory"] = all(r["fits_memory"] for r in ok)
    return out


def format_table(policy: str, records: list[dict], summary: dict) -> str:
    head = (
        f"{'iter':>4} {'solve s':>8} {'iter s':>9} {'bubble':>7} {'peak GB/stage':>28} {'chunks':>6} {'units':>5} fits"
    )
    lines = [f"policy {policy}", head]
    for r in records:
        if "error" in r:
            lines.append(f"{r['iteration']:>4} error: {r['error']}")
            continue
        peaks = " ".join(f"{x / 1e9:5.1f}" for x in r["peak_memory_bytes"])
        lines.append(
            f"{r['iteration']:>4} {r['solve_seconds']:8.3f} {r['iteration_time_s']:9.3f} {r['bubble_ratio']:7.1%} "
            f"{peaks:>28} {r['n_chunks']:>6} {r['n_units']:>5} {r['fits_memory']}"
        )
    if "solve_seconds" in summary:
        lines.append(
            f"median solve {summary['solve_seconds']:.3f} s, iteration {summary['iteration_time_s']:.3f} s, "
            f"bubble {summary['bubble_ratio']:.1%}; budget {summary['memory_budget_bytes'] / 1e9:.1f} GB; "
            f"tokens {summary['tokens_planned']}/{summary['tokens_in']}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- strategy policies (device groups)

STRATEGY_FIELDS = (
    "policy",
    "strategy",
    "solve_seconds",
    "iteration_time_s",
    "propagation_s",
    "overhead_s",
    "bubble_ratio",
    "imbalance",
    "peak_memory_fraction",
    "fits_memory",
    "tokens_in",
)


def scheme_costs_from_config(path: str, cluster: str, devices: int, policy: str):
    """(:class:`~jvarlen.plan.strategy.SchemeCosts` of the config's model on ``devices`` devices of
    ``cluster`` (0: the config's dp * pp * sp) with the analytic profile, the config's
    ``parallel.stage_weights``); ``auto`` and ``per_iteration`` plan replicated (:func:`run_strategy`
    chooses). The config is read as run with ``policy`` (``--policy``), which they need."""
    from jvarlen.config import ConfigError, load_config
    from jvarlen.layout import Layout, resolve_layout
    from jvarlen.plan.hardware import CLUSTERS
    from jvarlen.plan.strategy import SchemeCosts

    if cluster not in CLUSTERS:
        raise InputError(f"--cluster must be one of {', '.join(sorted(CLUSTERS))}, got {cluster!r}")
    try:
        cfg = load_config(path, **{"plan.policy": policy})
        n = devices or resolve_layout(cfg).num_devices
    except ConfigError as error:
        raise InputError(f"--config {path}: {error}") from None
    base = make_cost(cfg.model, cluster, Layout(n, 1, 1))  # n devices: the node count of the profile
    return SchemeCosts(base.with_stage_weights(cfg.parallel.stage_weights == "sharded"), n), cfg.parallel.stage_weights


def strategy_options(cli: PlanCli, corpus: list[int], costs):
    """The policy's default options with the CLI's seed and simulation; a policy whose options type has
    ``for_corpus(corpus, costs)`` (hydraulis: the Eq. 4 proposal) prepares them on the lengths file."""
    from jvarlen.plan.strategy import strategy_policies

    _, options_type = strategy_policies()[cli.policy]
    names = {f.name for f in dataclasses.fields(options_type)}
    changes = {"seed": cli.seed} if "seed" in names else {}
    if cli.simulation is not None and "simulation" in names:
        changes["simulation"] = cli.simulation
    options = options_type(**changes)
    if hasattr(options, "for_corpus"):
        options = options.for_corpus(corpus, costs)
    return options


def run_strategy(cli: PlanCli) -> int:
    from jvarlen.plan.strategy import SchemeCosts, plan_strategy

    costs, stage_weights = scheme_costs_from_config(cli.config, cli.cluster, cli.devices, cli.policy)
    corpus = read_lengths(cli.lengths)
    if cli.context > 0:
        corpus = [min(x, cli.context) for x in corpus]
    planned = list(batches(corpus, cli.batch_size, cli.iterations, cli.seed, 0))
    solve = None
    if stage_weights not in ("auto", "per_iteration"):
        options = strategy_options(cli, corpus, costs)
    else:  # as the run chooses, on the batches planned here
        import functools

        from jvarlen.plan.stage_weights import CHOICES, choose, plan_each

        @functools.cache  # the chosen one is used again below (Hydraulis' proposal: once per choice)
        def variant(choice):
            chosen = SchemeCosts(costs.base.with_stage_weights(choice == "sharded"), costs.num_devices)
            return chosen, strategy_options(cli, corpus, chosen)

        if stage_weights == "auto":
            choice, why = choose(cli.policy, planned[:4], variant)
            print(f"parallel.stage_weights=auto: {why}")
            costs, options = variant(choice)
        else:  # each batch as the faster of both
            solve = functools.partial(plan_each, cli.policy, variants={c: variant(c) for c in CHOICES})
    records, last, first = [], None, None
    for i, batch in enumerate(planned):
        try:
            plan = solve(batch) if solve else plan_strategy(cli.policy, batch, costs, options)
        except PlanningError as e:
            records.append({"iteration": i, "policy": cli.policy, "error": str(e), "tokens_in": sum(batch)})
            continue
        rec = {"iteration": i, **{k: plan.stats.get(k) for k in STRATEGY_FIELDS}}
        rec.update(n_groups=len(plan.groups), devices=costs.num_devices, events=plan.events)
        rec.update(stage_weights=plan.stage_weights)
        records.append(rec)
        first = first or plan
        last = plan
    summary = summarize_strategy(cli.policy, records)
    print(format_strategy_table(cli.policy, records, summary))
    _save(cli, summary, records, last)
    _no_chart(cli, first)
    if cli.gantt and first is not None:
        from jvarlen.plan.gantt import draw_strategy_gantt

        draw_strategy_gantt(first, variant(first.stage_weights)[0] if solve else costs, cli.gantt)
    return 0 if all("error" not in r for r in records) else 1


def summarize_strategy(policy: str, records: list[dict]) -> dict:
    ok = [r for r in records if "error" not in r]
    out = {"policy": policy, "iterations_planned": len(ok), "iterations_failed": len(records) - len(ok)}
    if ok:
        for key in ("solve_seconds", "iteration_time_s", "propagation_s", "bubble_ratio", "imbalance"):
            out[key] = statistics.median(r[key] for r in ok)
        out["peak_memory_fraction"] = max(r["peak_memory_fraction"] for r in ok)
        out["fits_memory"] = all(r["fits_memory"] for r in ok)
        out["tokens_in"] = sum(r["tokens_in"] for r in ok)
        out["strategies"] = sorted({r["strategy"] for r in ok})
    return out


def format_strategy_table(policy: str, records: list[dict], summary: dict) -> str:
    lines = [
        f"policy {policy}",
        f"{'iter':>4} {'solve s':>8} {'iter s':>9} {'prop s':>8} {'bubble':>7} {'mem':>5}  strategy",
    ]
    for r in records:
        if "error" in r:
            lines.append(f"{r['iteration']:>4} error: {r['error']}")
            continue
        lines.append(
            f"{r['iteration']:>4} {r['solve_seconds']:8.3f} {r['iteration_time_s']:9.3f} {r['propagation_s']:8.3f} "
            f"{r['bubble_ratio']:7.1%} {r['peak_memory_fraction']:5.0%}  {r['strategy']}"
            + (", stage weights sharded" if r.get("stage_weights") == "sharded" else "")
        )
    if "solve_seconds" in summary:
        lines.append(
            f"median solve {summary['solve_seconds']:.3f} s, iteration {summary['iteration_time_s']:.3f} s "
            f"(propagation {summary['propagation_s']:.3f} s); {len(summary['strategies'])} distinct strategies"
        )
    return "\n".join(lines)
