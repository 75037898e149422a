"""The planner's account of the pipeline executor against what the compiled step needs.

For every plan of ``scripts/bench_pipeline.py --parts policies`` runs (their ``*.spec.json``) that
fits its budget, compiles (does not run) the train step the benchmark times, on fake CPU devices,
and prints XLA's need per device (arguments + outputs + temporaries − donated,
``runtime.memory_fit.need_bytes``) next to the account the plan was made with (its stats) and
the account of today's code (``jvarlen.plan.executor_memory``) on ``--profile``
(docs/design/executor-memory.md, "What a tick holds").

Usage: ``python scripts/pipeline_memory_check.py --runs docs/data/pipeline/policy/val8k_b60f_s190-192.spec.json,...
[--profile P]`` (default: each spec's own profile). ~10 s of compilation per plan here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_policies import batch_documents  # noqa: E402


def check(spec: dict, profile: str) -> tuple[list[dict], list[str]]:
    """(a row per plan that fits its budget: compiled need against the account; the plans over
    their budget, which are not compiled)."""
    import jax

    from jvarlen.api import Session, as_pieces
    from jvarlen.config import Config, ModelConfig, OptimizerConfig
    from jvarlen.layout import Layout
    from jvarlen.parallel.pipeline.stage import stored_token_bytes
    from jvarlen.plan.cost import CostCoefficients, CostModel, ModelShape
    from jvarlen.plan.executor_memory import executor_memory
    from jvarlen.plan.plan import Plan
    from jvarlen.runtime.feed import Iteration
    from jvarlen.runtime.memory_fit import need_bytes

    cfg = ModelConfig(**spec["model"])
    layout = Layout(1, spec["pp"], 1)
    session = Session.from_config(
        Config(model=cfg, optimizer=OptimizerConfig(warmup_steps=0)), devices=jax.devices()[: layout.pp]
    )
    step = session.plan_step(layout, chunk_multiple=1, residual_policy=spec["residual_policy"])
    step.strategy.paired = True
    cost = CostModel(ModelShape.from_config(cfg), layout, CostCoefficients.load(profile))
    stored = stored_token_bytes(cfg, spec["residual_policy"])  # what a stored layer keeps under the run's policy
    rows, over = [], []
    for b in spec["batches"]:
        pieces = list(as_pieces(batch_documents(b["lengths"], cfg.vocab_size, b["seed"])))
        for policy, plan_json in b["plans"].items():
            plan = Plan.from_json(plan_json)
            if not plan.stats.get("fits_memory", True):  # planned over budget: not compiled, counted apart
                over.append(f"{b['seed']} {policy}")
                continue
            it = Iteration(0, pieces, np.zeros(len(pieces), np.int64), {}, groups=[pieces], plans=[plan])
            prepared = step.strategy.prepare(it, ())  # the plan's own (rounded) signature
            need = need_bytes(step.compiled(prepared).memory_analysis())
            account = executor_memory(plan, cost, stored_bytes=stored)
            rows.append(
                dict(
                    seed=b["seed"],
                    policy=policy,
                    fused=prepared.key.fused,
                    bucket=prepared.key.bucket,
                    context=prepared.key.context,
                    need=need,
                    planned=plan.stats["executor_memory_bytes"],
                    account=account.total,
                    terms=account.terms,
                )
            )
            r = rows[-1]
            print(
                f"| {r['seed']} | {policy} | {'yes' if r['fused'] else 'no'} | {r['bucket']} | {r['context']} "
                f"| {need / 1e6:.2f} | {r['planned'] / 1e6:.2f} ({r['planned'] / need - 1:+.1%}) "
                f"| {r['account'] / 1e6:.2f} ({r['account'] / need - 1:+.1%}) |",
                flush=True,
            )
    return rows, over


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", required=True, help="comma-separated *.spec.json of bench_pipeline policy runs")
    parser.add_argument("--profile", default=None, help="the account's profile (default: each spec's)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    print("| seed | policy | fused op | bucket | context | compiled need MB | planned account MB | account MB |")
    print("|---|---|---|---|---|---|---|---|")
    rows, over = [], []
    for path in args.runs.split(","):
        with open(path) as f:
            spec = json.load(f)
        profile = args.profile or spec["profile"]
        if not os.path.exists(profile):  # specs name the profile they were planned with, often a run's temp file
            parser.error(f"{path} names profile {profile!r}, which does not exist here: pass --profile")
        checked, skipped = check(spec, profile)
        rows += [dict(r, run=os.path.basename(path)) for r in checked]
        over += skipped
    errors = np.array([r["account"] / r["need"] - 1 for r in rows])
    print(f"account / need - 1 over {len(rows)} plans: {errors.min():+.1%} … {errors.max():+.1%}")
    if over:
        print(f"not compiled, planned over their budget ({len(over)}): {', '.join(over)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
