"""Where a compiled program's temporaries go: XLA's buffer assignment and live ranges, read back.

For a module dumped by XLA (``XLA_FLAGS=--xla_dump_to=DIR`` on CPU; ``JVARLEN_AOT_DUMP=DIR`` for the
deviceless GPU compiles of ``scripts/gpu_compile_check.py``), prints the temporary allocation's
values of at least ``--min-mib`` by offset, each with its shape and live range (positions in the
flattened schedule), and the values XLA lists as live at its own peak point, largest first. Values
at the same offset with disjoint live ranges share memory. A loop's carry is listed with the range
of its update in the body, while its buffer is held across the iterations: read the address space
(offsets), not a sum of the printed ranges (docs/design/executor-memory.md has what the pipeline
step's values are).

Usage: ``python scripts/xla_buffers.py DIR/module_0001.jit_train_step[...]_after_optimizations
[--min-mib 100]`` (the path without ``-buffer-assignment.txt``).
"""

from __future__ import annotations

import argparse
import re

MIB = 2**20


def temp_values(assignment: str) -> tuple[int, list[tuple[str, int, int, str]]]:
    """(size of the temporary allocation, its values as (name, size, offset, shape))."""
    # "size N, page P, preallocated-temp" since JAX 0.12's XLA; a program without temporaries has none
    m = re.search(r"allocation \d+: size (\d+),(?: page \d+,)? preallocated-temp:\n((?: value:.*\n)+)", assignment)
    if m is None:
        return 0, []
    values = re.findall(r" value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)", m.group(2))
    return int(m.group(1)), [(n, int(s), int(o), sh) for n, s, o, sh in values]


def live_ranges(text: str) -> tuple[dict[str, str], list[tuple[str, int]]]:
    """(value -> "start-end", the values XLA lists at its peak point with their bytes)."""
    ranges_part, _, peak_part = text.partition("BufferLiveRange:")[2].partition("Live ranges at")
    ranges = dict(re.findall(r"^\s+(\S+?)(?: \(phi\))?:(\d+-\d+)$", ranges_part, re.M))
    peak = [(n, int(b)) for n, b in re.findall(r"^\s+(\S+): (\d+) bytes", peak_part, re.M)]
    return ranges, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module", help="a dumped module's path, without -buffer-assignment.txt")
    ap.add_argument("--min-mib", type=float, default=100.0)
    args = ap.parse_args()
    with open(args.module + "-buffer-assignment.txt", encoding="utf-8") as f:
        total, values = temp_values(f.read())
    with open(args.module + "-live-range.txt", encoding="utf-8") as f:
        ranges, peak = live_ranges(f.read())
    shapes = {n: sh for n, _, _, sh in values}
    print(
        f"temporaries: {total / MIB:,.1f} MiB in {len(values)} values; those of {args.min_mib:g} MiB or more by offset:"
    )
    for name, size, offset, shape in sorted(values, key=lambda v: (v[2], v[0])):
        if size >= args.min_mib * MIB:
            span = ranges.get(name) or ranges.get(name + "{}", "?")
            print(f"  {offset / MIB:10,.1f} +{size / MIB:9,.1f} MiB  live {span:>11}  {name}  {shape[:60]}")
    print(f"live at XLA's peak point ({sum(b for _, b in peak) / MIB:,.1f} MiB, arguments included):")
    for name, size in sorted(peak, key=lambda v: -v[1]):
        if size >= args.min_mib * MIB:
            print(f"  {size / MIB:9,.1f} MiB  {name}  {shapes.get(name.removesuffix('{}'), '')[:60]}")


if __name__ == "__main__":
    main()
