"""The group policies' plans against the pipeline executor's memory account (planner only, no run).

    python scripts/group_memory_check.py [--config configs/llama-7b.yaml] [--devices 16] [--batches 3]
    python scripts/group_memory_check.py --seed 1 --batches 10 --policies flexsp,hydraulis --compiles

Plans long-tailed batches (a shipped workload's lengths, ``--tokens`` per batch) with each strategy
policy on the analytic ``--gpu`` cost model of ``--config``'s model, the stored bytes per layer
being what the executor keeps (``stage.stored_token_bytes``), and prints per (batch, policy) the
predicted iteration time and, per group, its scheme, the executor account
(``jvarlen.plan.executor_memory``) against the budget, and the time line's peak. A group whose
account exceeds the budget would not fit the compiled step its plan says fits. ``--compiles``:
also the executables the batches' group steps compile, per policy, when each reuses a compiled
signature that covers it (``prepare_plans(known=...)``, as the step cache does).
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from jvarlen.config import load_config
from jvarlen.layout import Layout
from jvarlen.parallel.pipeline.stage import stored_token_bytes
from jvarlen.plan.api import make_cost
from jvarlen.plan.cost import CostModel, ModelShape
from jvarlen.plan.executor_memory import executor_memory
from jvarlen.plan.strategy import SchemeCosts, plan_strategy
from jvarlen.plan.workloads import MIXTURES

GiB = 2**30


def executor_costs(model, gpu: str, devices: int) -> SchemeCosts:
    """The analytic ``gpu`` model of ``model`` on ``devices`` devices, a stored layer charged what
    the executor keeps (``stage.stored_token_bytes`` under ``dots_and_attention``)."""
    base = make_cost(ModelShape.from_config(model), gpu, Layout(devices, 1, 1))
    stored = stored_token_bytes(model, "dots_and_attention")
    return SchemeCosts(CostModel(base.model, base.layout, base.coeffs.replace(m_stored_token=stored)), devices)


def token_batch(rng, workload: str, tokens: int, longest: int) -> list[int]:
    """Document lengths of ``workload`` (clipped to [64, ``longest``]) drawn until ``tokens``."""
    lengths, total = [], 0
    while total < tokens:
        n = int(np.clip(MIXTURES[workload].sample(1, rng)[0], 64, longest))
        lengths.append(n)
        total += n
    return lengths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/llama-7b.yaml")
    ap.add_argument("--gpu", default="a800", help="analytic cost model (jvarlen.plan.api.make_cost)")
    ap.add_argument("--devices", type=int, default=16)
    ap.add_argument("--workload", default="github")
    ap.add_argument("--tokens", type=int, default=256 * 1024, help="tokens per batch")
    ap.add_argument("--longest", type=int, default=65536, help="documents are truncated to this")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="hydraulis,flexsp,dcp,homogeneous")
    ap.add_argument("--compiles", action="store_true", help="count the executables the group steps compile")
    args = ap.parse_args(argv)
    model = load_config(args.config).model
    compiled = collections.defaultdict(lambda: collections.defaultdict(list))  # policy -> scheme -> signatures
    steps, times = collections.Counter(), collections.defaultdict(list)
    costs = executor_costs(model, args.gpu, args.devices)
    c = costs.coeffs
    print(
        f"m_token {c.m_token:.0f} B, m_stored_token {c.m_stored_token:.0f} B, "
        f"budget {costs.base.memory_budget / GiB:.1f} GiB"
    )
    print(
        "| batch | policy | predicted s | plan s | groups over budget | groups: (pp, sp) account / time-line peak GiB |"
    )
    print("|---|---|---|---|---|---|")
    rng = np.random.default_rng(args.seed)
    for b in range(args.batches):
        lengths = token_batch(rng, args.workload, args.tokens, args.longest)
        for policy in [p for p in args.policies.split(",") if p]:
            t0 = time.perf_counter()
            plan = plan_strategy(policy, lengths, costs)
            elapsed = time.perf_counter() - t0
            times[policy].append(plan.stats.get("iteration_time_s", float("nan")))
            if args.compiles:
                for g in plan.groups:
                    steps[policy] += 1
                    compile_count(compiled[policy][g.scheme], g, lengths, model.num_layers)
            rows, over = [], 0
            for g in plan.groups:
                account = executor_memory(g.plan, costs.cost(g.scheme)).total
                budget = g.plan.stats["memory_budget_bytes"]
                over += account > budget
                peak = max(g.plan.stats["peak_memory_bytes"])
                rows.append(f"({g.scheme.pp}, {g.scheme.sp}) {account / GiB:.1f} / {peak / GiB:.1f}")
            print(
                f"| {b} | {policy} | {plan.stats.get('iteration_time_s', float('nan')):.3f} | {elapsed:.2f} | "
                f"{over} of {len(rows)} | {', '.join(rows)} |",
                flush=True,
            )
    for policy in compiled:
        n = sum(len(sigs) for sigs in compiled[policy].values())
        print(
            f"{policy}: {steps[policy]} group steps compiled {n} executables; "
            f"mean predicted iteration {np.mean(times[policy]):.3f} s"
        )
    return 0


def compile_count(known: list, group, lengths, num_layers: int) -> None:
    """Adds to ``known`` (the signatures compiled for ``group``'s layout so far) the one its step
    compiles, unless a compiled one covers it."""
    from jvarlen.parallel import pipeline as pl

    docs = [np.zeros(lengths[d], np.int32) for d in group.documents]
    sig, _ = pl.prepare_plans([group.plan], [docs], num_layers, known, chunk_multiple=1)
    if sig not in known:
        known.append(sig)


if __name__ == "__main__":
    raise SystemExit(main())
