"""``python -m jvarlen.export --run_dir RUN_DIR --out_dir OUT_DIR [--dtype bfloat16|float16|float32]
[--overwrite true]``: a run's newest checkpoint as a Hugging Face model directory (see :mod:`jvarlen.hf.export`)."""

from __future__ import annotations

import argparse
import sys

import draccus


def main(argv: list[str] | None = None) -> int:
    from jvarlen.hf.export import ExportConfig, export_run

    try:
        cfg = draccus.parse(ExportConfig, args=sys.argv[1:] if argv is None else argv, exit_on_error=False)
        export_run(cfg)
    except (ValueError, OSError, argparse.ArgumentError, draccus.utils.DraccusException) as error:
        print(f"jvarlen.export: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
