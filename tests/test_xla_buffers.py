"""scripts/xla_buffers.py reads back what XLA dumped of a compiled program's temporaries."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from xla_buffers import live_ranges, temp_values  # noqa: E402


def test_the_temporaries_are_xlas_and_each_has_its_live_range(tmp_path):
    """The temporary allocation's size is the compiled program's ``temp_size_in_bytes``, its
    values fit inside it, each has a live range, and the peak's values are listed."""
    # the sort keeps the [256, 256] product in a temporary (JAX 0.12's XLA:CPU fuses a product that
    # is only reduced into one library call, with no temporary of XLA's)
    fn = jax.jit(lambda x: jnp.sort(jnp.sin(x @ x.T), axis=0).sum(0) * 2)
    compiled = fn.lower(jax.ShapeDtypeStruct((256, 128), jnp.float32)).compile(
        compiler_options={"xla_dump_to": str(tmp_path)}
    )
    (assignment,) = tmp_path.glob("*after_optimizations-buffer-assignment.txt")
    module = str(assignment).removesuffix("-buffer-assignment.txt")
    total, values = temp_values(assignment.read_text())
    ranges, peak = live_ranges(Path(module + "-live-range.txt").read_text())
    assert total == compiled.memory_analysis().temp_size_in_bytes
    assert values and all(offset + size <= total for _, size, offset, _ in values)
    assert all(name in ranges or name + "{}" in ranges for name, *_ in values)
    assert any(size == 256 * 256 * 4 for _, size in peak)  # the [256, 256] product, live at the peak


def test_a_program_without_temporaries_has_none_to_list(tmp_path):
    compiled = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((8,), jnp.float32))
    compiled = compiled.compile(compiler_options={"xla_dump_to": str(tmp_path)})
    (assignment,) = tmp_path.glob("*after_optimizations-buffer-assignment.txt")
    assert compiled.memory_analysis().temp_size_in_bytes == 0
    assert temp_values(assignment.read_text()) == (0, [])
