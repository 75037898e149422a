"""Gantt chart of a simulated pipeline: one lane per stage, memory curves beneath (PNG, Agg); and
of a heterogeneous strategy: the groups side by side (:func:`draw_strategy_gantt`).

Forward boxes are drawn solid, backward boxes hatched, both in the colour of the chunk's
(first) document; recomputation is shaded grey, all-to-all dark, P2P a thin line under the
lane. The lower panel plots every stage's memory (GB per device) against the budget.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg", force=False)
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from jvarlen.plan.schedule import Schedule  # noqa: E402
from jvarlen.plan.simulator import SimResult  # noqa: E402

COMM_COLOURS = {"A2A": "0.25", "AG": "0.5", "V": "0.4"}  # all-to-all, weight gathers, vocabulary collectives


def draw_gantt(
    result: SimResult,
    schedule: Schedule,
    path: str | os.PathLike,
    title: Optional[str] = None,
    doc_names: Optional[Sequence[str]] = None,
    dpi: int = 110,
) -> str:
    """Writes a PNG to ``path`` and returns the path."""
    pp = len(result.peak_memory)
    docs = schedule.docs()
    doc_ids = sorted({ds[0] for ds in docs})
    cmap = plt.get_cmap("tab20")
    colour = {d: cmap(i % 20) for i, d in enumerate(doc_ids)}

    fig, (ax, axm) = plt.subplots(
        2, 1, figsize=(12, 1.0 + 0.6 * pp + 2.2), sharex=True, gridspec_kw={"height_ratios": [0.6 * pp + 0.6, 2.2]}
    )
    t0 = min((e.start for e in result.events), default=0.0)
    scale, unit = _time_unit(result.makespan)
    for e in result.events:
        y = pp - 1 - e.stage
        x, w = (e.start - t0) * scale, e.duration * scale
        if e.kind == "idle" or w <= 0:
            continue
        if e.kind == "P2P":
            ax.plot([x, x + w], [y - 0.42, y - 0.42], color="0.3", lw=1)
            continue
        c = colour[docs[e.chunk][0]]
        if e.kind == "F":
            ax.barh(y, w, left=x, height=0.7, color=c, edgecolor="black", lw=0.4)
        elif e.kind == "B":
            ax.barh(y, w, left=x, height=0.7, color=c, edgecolor="black", lw=0.4, hatch="///")
        elif e.kind == "R":
            ax.barh(y, w, left=x, height=0.7, color="0.75", edgecolor="black", lw=0.4, hatch="..")
        elif e.kind in ("A2A", "AG", "V"):
            ax.barh(y, w, left=x, height=0.7, color=COMM_COLOURS[e.kind], edgecolor="none")
        if e.kind in ("F", "B") and w > 0.025 * result.makespan * scale:
            ax.text(x + w / 2, y, f"{e.kind}{e.chunk}", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"stage {p}" for p in reversed(range(pp))])
    ax.set_ylim(-0.6, pp - 0.4)
    legend = [Patch(color="0.75", label="recompute"), Patch(color="0.25", label="all-to-all")]
    legend += [Patch(color="0.5", label="weight gathers")] if any(e.kind == "AG" for e in result.events) else []
    legend += [Patch(color="0.4", label="vocabulary collectives")] if any(e.kind == "V" for e in result.events) else []
    names = list(doc_names) if doc_names is not None else [f"doc {d}" for d in doc_ids]
    legend += [
        Patch(color=colour[d], label=names[i] if i < len(names) else f"doc {d}") for i, d in enumerate(doc_ids[:12])
    ]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    overhead = result.iteration_time - result.makespan
    ax.set_title(
        title
        or f"iteration {result.iteration_time * scale:.3g} {unit} (pipeline {result.makespan * scale:.3g} + "
        f"step {overhead * scale:.3g}), bubble {100 * result.bubble_ratio:.1f}%"
    )

    for p, (times, values) in enumerate(result.memory):
        xs = list((times - t0) * scale) + [result.makespan * scale]
        ys = list(values / 1e9) + [values[-1] / 1e9]
        axm.step(xs, ys, where="post", label=f"stage {p} (peak {values.max() / 1e9:.3g} GB)")
    axm.axhline(result.memory_budget / 1e9, color="red", ls="--", lw=1, label="budget")
    axm.set_ylabel("GB / device")
    axm.set_xlabel(f"time ({unit})")
    axm.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return str(path)


def draw_strategy_gantt(
    plan,
    costs,
    path: str | os.PathLike,
    title: Optional[str] = None,
    mode: Optional[str] = None,
    dpi: int = 110,
) -> str:
    """A heterogeneous strategy (:class:`~jvarlen.plan.strategy.StrategyPlan`) as one band per group,
    side by side on one time axis: each band has one lane per pipeline stage, labelled with the
    group's scheme and devices; boxes as in :func:`draw_gantt`, coloured by document (one colour
    map over the iteration's documents). A dashed line marks the slowest group's end; the title
    gives the predicted iteration time. Writes a PNG; returns the path."""
    from jvarlen.plan.assemble import simulate

    groups = list(plan.groups)
    lanes = sum(g.scheme.pp for g in groups)
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(13, 1.2 + 0.32 * lanes + 0.25 * len(groups)))
    sims = [simulate(g.plan, costs.cost(g.scheme), mode or g.plan.stats.get("simulation", "ticks")) for g in groups]
    end = max((r.makespan for r in sims), default=0.0)
    scale, unit = _time_unit(end)
    y, ticks, labels = 0.0, [], []
    for gi, (g, r) in enumerate(zip(groups, sims)):
        first_doc = [pieces[0][0] for pieces in g.plan.chunks]  # the group's own document index
        t0 = min((e.start for e in r.events), default=0.0)
        pp = g.scheme.pp
        for e in r.events:
            x, w = (e.start - t0) * scale, e.duration * scale
            if e.kind in ("idle", "P2P") or w <= 0:
                continue
            yy = y + (pp - 1 - e.stage)
            if e.kind in ("F", "B"):
                colour = cmap(g.documents[first_doc[e.chunk]] % 20)
                ax.barh(
                    yy,
                    w,
                    left=x,
                    height=0.8,
                    color=colour,
                    edgecolor="black",
                    lw=0.3,
                    hatch="///" if e.kind == "B" else None,
                )
            elif e.kind == "R":
                ax.barh(yy, w, left=x, height=0.8, color="0.75", edgecolor="black", lw=0.3, hatch="..")
            elif e.kind in ("A2A", "AG", "V"):
                ax.barh(yy, w, left=x, height=0.8, color=COMM_COLOURS[e.kind], edgecolor="none")
        for p in range(pp):
            ticks.append(y + (pp - 1 - p))
            head = f"G{gi} {g.scheme} dev {g.devices[0]}-{g.devices[-1]}"
            labels.append(f"{head}: stage {p}" if pp > 1 else head)
        ax.text(r.makespan * scale, y + (pp - 1) / 2, f" {r.makespan * scale:.3g} {unit}", va="center", fontsize=7)
        y += pp + 0.6
        if gi < len(groups) - 1:
            ax.axhline(y - 0.8, color="0.6", lw=0.6)
    ax.axvline(end * scale, color="red", ls="--", lw=1)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_ylim(y - 0.4, -0.6)
    ax.set_xlabel(f"time ({unit})")
    legend = [Patch(color="0.75", label="recompute"), Patch(color="0.25", label="all-to-all")]
    kinds = {e.kind for r in sims for e in r.events}
    legend += [Patch(color="0.5", label="weight gathers")] if "AG" in kinds else []
    legend += [Patch(color="0.4", label="vocabulary collectives")] if "V" in kinds else []
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    total = plan.stats.get("iteration_time_s", float("nan"))
    ax.set_title(
        title
        or f"{plan.policy}: {plan.describe()}; iteration {total:.3g} s (propagation {end:.3g} s, the rest "
        "each group's step overhead: optimizer update, parameter pull and gradient push)",
        fontsize=9,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return str(path)


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def save_every(
    step: int, every: int, result: SimResult, schedule: Schedule, run_dir: str | os.PathLike
) -> Optional[str]:
    """For the training loop: writes ``run_dir/gantt/step_{step:07d}.png`` when ``step % every == 0``
    (``every <= 0`` disables it). Returns the path written, or None."""
    if every <= 0 or step % every:
        return None
    return draw_gantt(result, schedule, os.path.join(run_dir, "gantt", f"step_{step:07d}.png"), title=f"step {step}")
