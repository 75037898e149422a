"""How well ``pipeline_cut.bucket_cut``'s ranking finds a pipeline group's fastest cut: on the
strategies benchmark's batches (seeds 1000, 1001, ... as ``bench_strategies.py --parts compare``),
every ``pp > 1`` group of the ``homogeneous`` plan is cut every way ``bucket_cut`` considers (the
packing's own cut, first-fit decreasing into each of ``bin_caps``), each cut built and simulated
(``build_group_plan``), and the fastest compared with what building only the first k of the
ranking reaches. Prints a markdown table.

    python scripts/pipeline_cut_ranking.py --only '32B|13B a800-ib200 16 dev|7B a800 64 dev 200K tok 32K ctx$|github 7B h100 64 dev 200K tok 32K ctx$'
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import strategy_settings  # noqa: E402

from jvarlen.plan.chunking import packed_group  # noqa: E402
from jvarlen.plan.hydraulis_costs import scheme_tables  # noqa: E402
from jvarlen.plan.hydraulis_pack import pack  # noqa: E402
from jvarlen.plan.pipeline_cut import bin_caps, bucket_cut, padded_time  # noqa: E402
from jvarlen.plan.strategy import build_group_plan, plan_strategy, strategy_policies  # noqa: E402


def group_cuts(local, table, options):
    """``[(bin size or 0, micro-batches, recomputation)]``: the packing's cut and every bin size's."""
    packed = pack(local, table, options.pack)
    cuts, seen = [], set()
    for cap, mbs in [(0, [list(m) for m in packed.micro_batches])] + [
        (c, packed_group(local, c)) for c in bin_caps(max(local), table)
    ]:
        key = tuple(sorted(tuple(sorted(m)) for m in mbs))
        if key in seen:
            continue
        seen.add(key)
        need = [int(r) for r in table.recompute_layers([sum(local[i] for i in m) for m in mbs])]
        cuts.append((cap, mbs, need))
        if cap and len(mbs) == 1:
            break
    return cuts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="32B", help="settings whose name matches this regex")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--top", default="1,2,3", help="ranking depths to report")
    args = ap.parse_args()
    tops = [int(k) for k in args.top.split(",")]
    _, options_type = strategy_policies()["homogeneous"]
    rows = []  # per group: fastest of every cut, the packing's cut, {k: the first k}, {k: and the packing's}, bucket_cut's
    for setting in [s for s in strategy_settings.settings(False) if re.search(args.only, s.name)]:
        costs = strategy_settings.costs_for(setting)
        pool = strategy_settings.corpus(setting.workload, setting.context)
        options, _ = strategy_settings.prepare(options_type, pool, costs, setting.context)
        for i in range(args.iterations):
            lengths = strategy_settings.token_batch(pool, setting.tokens, 1000 + i)
            for g in plan_strategy("homogeneous", lengths, costs, options).groups:
                if g.scheme.pp == 1:
                    continue
                table = scheme_tables(costs, [g.scheme], True, options.util_threshold, "paired")[g.scheme]
                local = [lengths[d] for d in g.documents]
                cuts = group_cuts(local, table, options)
                built = [
                    build_group_plan("rank", g.scheme, local, m, costs, n).stats["iteration_time_s"] for _, m, n in cuts
                ]
                order = sorted(
                    range(len(cuts)), key=lambda k: (padded_time(local, cuts[k][1], table, costs), cuts[k][0])
                )
                chosen = bucket_cut("rank", local, cuts[0][1], cuts[0][2], table, costs).stats["iteration_time_s"]
                first = {k: min(built[j] for j in order[:k]) for k in tops}
                rows.append((min(built), built[0], first, {k: min(first[k], built[0]) for k in tops}, chosen))
    if not rows:
        print("no pp > 1 group in the chosen settings' plans")
        return 1

    def line(name, times):
        hits = sum(t <= best * (1 + 1e-9) for t, (best, *_) in zip(times, rows))
        loss = [t / best - 1 for t, (best, *_) in zip(times, rows)]
        return f"| {name} | {hits} / {len(rows)} | {100 * sum(loss) / len(loss):.2f} % | {100 * max(loss):.2f} % |"

    print("| built | fastest cut in | mean loss | largest loss |")
    print("|---|---|---|---|")
    print(line("the packing's cut only", [r[1] for r in rows]))
    for k in tops:
        print(line(f"the first {k} ranked", [r[2][k] for r in rows]))
        print(line(f"the first {k} ranked and the packing's cut", [r[3][k] for r in rows]))
    print(line("`bucket_cut` (default)", [r[4] for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
