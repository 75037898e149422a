"""How much one-stage SP groups gain from running their micro-batches in bucket parts
(docs/design/bucket-parts.md), in the group model (what the group plans simulate to).

A ``pp = 1`` group's step pads every micro-batch to the bucket of its largest, and the executor's
memory fit raises every micro-batch's recomputation to what that bucket needs. In parts, the
group's micro-batches, largest first, run as up to ``K`` consecutive steps in one program, each
padded to its own largest micro-batch's bucket with the recomputation that bucket needs.

For each setting of ``scripts/bench_flexsp_dcp.py`` without ZeRO-3 and two seeded batches, the best
homogeneous SP layout (every degree tried, LPT dispatch as :func:`best_static_sp`) is timed with
:class:`GroupCosts` at ``max_parts = 1`` (one bucket per group, its groups cut at their bucket),
at ``max_parts = K`` for each ``--parts K`` (what the planners use; default 2), and with one bucket
per micro-batch (``K = inf``: a bound no number of parts beats, with FlexSP's plain Eq. 23-24
cut). What the model leaves out: a part's program launch, the compile of more signatures.

``--pipelines``: the same question for ``epp-pipelines`` (pipelines keep one bucket per step): on
each setting of ``scripts/bench_strategies.py`` and its first ``--seeds`` batches, the slowest
pipeline's simulated time with every chunk padded to the step's bucket against the same plans with
no padding at all (``CostModel.padded(1)``). That ratio bounds what any number of buckets per
pipeline step could gain, before the pipeline drains they would add.

    python scripts/bucket_parts_potential.py [--parts 2 3] [--seeds 2] [--pipelines]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_flexsp_dcp import sample_tokens, settings  # noqa: E402

from jvarlen.plan.homogeneous import homogeneous_groups  # noqa: E402
from jvarlen.plan.sp_groups import GroupChoice, GroupCosts  # noqa: E402


class PerMicroBatch(GroupCosts):
    """The group model with every micro-batch its own step (its own bucket), FlexSP's plain cut."""

    def group_time(self, lengths, choice: GroupChoice) -> float:
        docs, scheme = choice.documents, choice.scheme
        mbs = [[int(lengths[docs[i]]) for i in mb] for mb in choice.micro_batches]
        least = [self.least_recompute(scheme, sum(m)) for m in mbs]
        return sum(self._part_time(scheme, [m], [sum(m)], [r]) for m, r in zip(mbs, least)) + self.base(scheme)

    def fastest_cut(self, lengths, scheme, documents, micro_batches, min_batches=1, max_batches=None, ckpt=None):
        docs = tuple(int(d) for d in documents)
        return GroupChoice(scheme, docs, tuple(tuple(m) for m in micro_batches), tuple(0 for _ in micro_batches))


def best_layout_time(lengths, gc: GroupCosts) -> tuple[float, int]:
    out = []
    for scheme in gc.schemes:
        groups = homogeneous_groups(lengths, gc, scheme.sp)
        out.append((math.inf if groups is None else gc.strategy_time(lengths, groups), scheme.sp))
    return min(out)


def pipeline_padding(seeds: int) -> None:
    """``--pipelines``: padded / unpadded slowest-pipeline time of ``epp-pipelines`` plans."""
    from bench_strategies import corpus, costs_for, token_batch
    from bench_strategies import settings as strategy_settings

    from jvarlen.plan.assemble import simulate
    from jvarlen.plan.auto import EPPPipelinesOptions
    from jvarlen.plan.strategy import plan_strategy

    print("| setting | strategy (first batch) | padded / unpadded per batch |\n|---|---|---|")
    ratios = []
    for s in strategy_settings(False):
        costs, pool = costs_for(s), corpus(s.workload, s.context)
        cells, first = [], None
        for i in range(seeds):
            plan = plan_strategy("epp-pipelines", token_batch(pool, s.tokens, 1000 + i), costs, EPPPipelinesOptions())
            first = first or plan.describe()
            padded = max(simulate(g.plan, costs.cost(g.scheme), "paired").iteration_time for g in plan.groups)
            bare = max(simulate(g.plan, costs.cost(g.scheme).padded(1), "paired").iteration_time for g in plan.groups)
            ratios.append(padded / bare)
            cells.append(f"{padded / bare:.3f}")
        print(f"| {s.name} | {first} | {', '.join(cells)} |", flush=True)
    print(f"padded / unpadded: {min(ratios):.3f}-{max(ratios):.3f}, median {statistics.median(ratios):.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", type=int, nargs="+", default=[2, 3], help="values of max_parts besides 1")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--pipelines", action="store_true", help="EPP pipelines' padding instead (see the docstring)")
    args = ap.parse_args()
    if args.pipelines:
        pipeline_padding(args.seeds)
        return 0
    names = [f"K={k}" for k in args.parts] + ["K=inf"]
    ratios: dict[str, list[float]] = {n: [] for n in names}
    print("| setting | batch | K=1 s (sp) | " + " | ".join(f"{n} s (sp), gain" for n in names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for s in settings(False):
        if s.zero3:
            continue
        costs = s.costs()
        one = GroupCosts(costs, max_parts=1)
        variants = {f"K={k}": GroupCosts(costs, max_parts=k) for k in args.parts}
        variants["K=inf"] = PerMicroBatch(costs, max_parts=1)
        for seed in range(args.seeds):
            lengths = sample_tokens(s.workload, s.tokens, s.context, seed=7000 + seed)
            t0, sp0 = best_layout_time(lengths, one)
            cells = []
            for name, gc in variants.items():
                t, sp = best_layout_time(lengths, gc)
                ratios[name].append(t0 / t)
                cells.append(f"{t:.2f} ({sp}), {t0 / t:.3f}×")
            print(
                f"| {s.model} {s.workload} | {7000 + seed} | {t0:.2f} ({sp0}) | " + " | ".join(cells) + " |", flush=True
            )
    for name, r in ratios.items():
        print(f"{name}: K=1 / {name} {min(r):.3f}-{max(r):.3f}×, median {statistics.median(r):.3f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
