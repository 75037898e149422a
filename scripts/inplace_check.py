"""Does XLA update a loop-carried buffer in place when the update sits inside a conditional?

The pipeline executor's tick loop carries stage-sized buffers (residual slots, gradient
accumulators). This compiles four small loops of the same shape and prints, per backend, the
temporaries and the whole-buffer copies XLA inserts:

* ``nocond``: a scan over the rows updates the buffer every tick;
* ``cond_param``: the scan inside ``lax.cond(flag, scan, identity)``, the buffer its operand;
* ``cond_tuple``: the same with a second, small operand;
* ``pass_percond``: the scan outside, a conditional around each row's update.

XLA:CPU copies none of them (it does once two branches write the buffer); the deviceless H100
compile (``../shared/gpu-aot.md``) copies the buffer three times in both ``cond_*`` variants and
never in ``pass_percond`` (docs/benchmarks.md, GPU). So on GPUs a buffer that an op updates in place must
not cross the op's conditional; the conditionals belong inside the pass, around one layer.

    python scripts/inplace_check.py                 # XLA:CPU
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python scripts/inplace_check.py --target h100   # needs the gpu-aot extra
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp

ROWS, SHAPE = 8, (8, 1024, 1024)
VARIANTS = ("nocond", "cond_param", "cond_tuple", "pass_percond")


def _scan(acc):
    def body(a, j):
        row = jax.lax.dynamic_index_in_dim(a, j, 0, False) * 1.5 + 1.0
        return jax.lax.dynamic_update_index_in_dim(a, row, j, 0), None

    return jax.lax.scan(body, acc, jnp.arange(ROWS))[0]


def loop(kind: str):
    def f(x, flags):
        def tick(t, carry):
            acc, other = carry
            on = flags[t] > 0
            if kind == "nocond":
                acc = _scan(acc)
            elif kind == "cond_param":
                acc = jax.lax.cond(on, _scan, lambda a: a, acc)
            elif kind == "cond_tuple":
                acc, other = jax.lax.cond(on, lambda a, o: (_scan(a), o + 1), lambda a, o: (a, o), acc, other)
            else:

                def body(a, j):
                    row = jax.lax.dynamic_index_in_dim(a, j, 0, False)
                    row = jax.lax.cond(on, lambda r: r * 1.5 + 1.0, lambda r: r, row)
                    return jax.lax.dynamic_update_index_in_dim(a, row, j, 0), None

                acc = jax.lax.scan(body, acc, jnp.arange(ROWS))[0]
            return acc, other

        return jax.lax.fori_loop(0, 5, tick, (jnp.zeros(SHAPE) + x, jnp.zeros(16)))[0].sum()

    return f


def check(kind: str, device=None) -> tuple[float, int]:
    """(temporaries MiB, whole-buffer copies) of variant ``kind`` compiled for ``device``."""
    args = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((5,), jnp.int32))
    shardings = {}
    if device is not None:
        s = jax.sharding.SingleDeviceSharding(device)
        shardings = dict(in_shardings=(s, s))
    compiled = jax.jit(loop(kind), **shardings).lower(*args).compile()
    dims = ",".join(map(str, SHAPE))
    copies = [
        line for line in compiled.as_text().splitlines() if re.search(rf"= f32\[{dims}\]\{{[^}}]*\}} copy\(", line)
    ]
    return compiled.memory_analysis().temp_size_in_bytes / 2**20, len(copies)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="an abstract GPU (h100, a100) instead of this machine's backend")
    args = ap.parse_args(argv)
    device, name = None, jax.default_backend()
    if args.target:
        from jvarlen import gpu_aot

        device, name = gpu_aot.abstract_devices(args.target, 1)[0], args.target
    mib = SHAPE[0] * SHAPE[1] * SHAPE[2] * 4 / 2**20
    print(f"{name}: a {mib:.0f} MiB f32 buffer carried by a 5-tick loop")
    for kind in VARIANTS:
        temp, copies = check(kind, device)
        print(f"  {kind:13s} temporaries {temp:7.2f} MiB, {copies} whole-buffer copies")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
