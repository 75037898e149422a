"""``python -m jvarlen.plan --lengths FILE --config CONFIG --policy epp [--json OUT] [--gantt OUT.png]``.

FILE holds one document length per line: one global batch, or (with
``--batch-size N --iterations K``) a corpus from which K batches of N documents
are sampled (seeded). See :class:`jvarlen.plan.cli.PlanCli` for every option.
"""

from __future__ import annotations

import sys
from typing import Optional

import draccus

from jvarlen.plan.cli import PlanCli, run


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Accept --batch-size as well as draccus' --batch_size.
    args = ["--" + a[2:].replace("-", "_") if a.startswith("--") else a for a in argv]
    return run(draccus.parse(PlanCli, args=args))


if __name__ == "__main__":
    sys.exit(main())
