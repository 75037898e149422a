"""``python -m jvarlen.plan --lengths FILE --config CONFIG --policy epp [--json OUT] [--gantt OUT.png]``.

FILE holds one document length per line: one global batch, or (with
``--batch-size N --iterations K``) a corpus from which K batches of N documents
are sampled (seeded). See :class:`jvarlen.plan.cli.PlanCli` for every option.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import draccus

from jvarlen.plan.cli import InputError, PlanCli, run


def _underscored(flag: str) -> str:
    name, eq, value = flag[2:].partition("=")
    return "--" + name.replace("-", "_") + eq + value


def main(argv: Optional[list[str]] = None) -> int:
    """Exit codes: 0 planned, 1 some iteration could not be planned, 2 bad flags or input files."""
    argv = sys.argv[1:] if argv is None else argv
    # Accept --batch-size as well as draccus' --batch_size (the flag's name only: --json=my-out.json
    # keeps its value)
    args = [_underscored(a) if a.startswith("--") else a for a in argv]
    try:
        cli = draccus.parse(PlanCli, args=args, exit_on_error=False)
        return run(cli)
    except (InputError, argparse.ArgumentError) as error:
        print(f"jvarlen.plan: {error}", file=sys.stderr)
        return 2
    except draccus.utils.DraccusException as error:
        cause = error.__cause__
        while cause is not None and not isinstance(cause, InputError):
            cause = cause.__cause__
        print(f"jvarlen.plan: {cause if cause is not None else error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
