"""Measured Ulysses all-to-all links (Eq. 2/3) for sp in {2, 4} on this backend, held-out check.

Times ``seq_to_heads`` alone (:func:`jvarlen.profile.measure.measure_alltoall`) for fit sizes
and held-out sizes, fits ``Link(bandwidth, latency)`` per sp on the fit sizes
(:func:`jvarlen.plan.cost_fit.fit_link`), prints predicted vs measured on the held-out sizes and,
with ``--profile``, stores the links in the profile (``alltoall_intra`` and ``alltoall_inter``:
one process has no node boundary). Also runs one sp = 2 forward+backward layer program of the
profiler's harness as a smoke test of the Ulysses path. CPU: fake devices are threads of one
process on this 2-core machine; per-device seconds = process CPU time / sp (a memcpy between
threads, not an interconnect).

A profile with measured per-sp layer coefficients (``python -m jvarlen.profile --sp '[1,2]'``)
already includes the all-to-all in them; links are not stored for those degrees (Eq. 3 would
count the all-to-all twice).

Usage: ``python scripts/validate_alltoall.py [--profile PATH]`` (~1 min here).
"""

from __future__ import annotations

import argparse
import os


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="profile JSON to store the fitted links in")
    args = ap.parse_args(argv)
    from jvarlen.profile import SINGLE_THREAD_XLA_FLAGS

    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 " + SINGLE_THREAD_XLA_FLAGS
    ).strip()
    import jax.numpy as jnp

    from jvarlen.config import ModelConfig
    from jvarlen.plan.chunk import ChunkShape
    from jvarlen.plan.cost import CostCoefficients, ModelShape
    from jvarlen.plan.cost_fit import fit_link
    from jvarlen.profile.harness import ChunkHarness, time_call
    from jvarlen.profile.measure import measure_alltoall

    cfg = ModelConfig()
    shape = ModelShape.from_config(cfg)
    dtype = jnp.float32
    links = {}
    for sp in (2, 4):
        fit_rows = measure_alltoall(sp, (1024, 4096, 16384, 65536), shape.num_heads, shape.head_dim, dtype)
        held = measure_alltoall(sp, (2048, 8192, 32768), shape.num_heads, shape.head_dim, dtype)
        link = fit_link(*zip(*fit_rows))
        links[sp] = link
        errs = [(link.time(b) - s) / s for b, s in held]
        print(
            f"sp={sp}: bandwidth {link.bandwidth / 1e9:.2f} GB/s per device, latency {link.latency * 1e6:.0f} us; held-out "
            + ", ".join(
                f"{b / 1e6:.2f} MB: meas {s * 1e6:.0f} us pred {link.time(b) * 1e6:.0f} us ({100 * e:+.0f} %)"
                for (b, s), e in zip(held, errs)
            )
        )
    harness = ChunkHarness(cfg, token_buckets=(512,), context_buckets=(0,), sp=2)
    batch = harness.layer_inputs(ChunkShape(0, (300, 212)))
    sec = time_call(harness.layers_program(2, "fwdbwd", False), harness.params, batch, repeats=3)
    print(f"sp=2 harness: 2-layer fwd+bwd of a 512-token chunk ran, {sec * 1e3:.1f} ms process CPU (both devices)")
    if args.profile:
        c = CostCoefficients.load(args.profile)
        skipped = sorted(sp for sp in links if sp in c.per_sp)
        links = {sp: v for sp, v in links.items() if sp not in c.per_sp}
        c = c.replace(alltoall_intra={**c.alltoall_intra, **links}, alltoall_inter={**c.alltoall_inter, **links})
        c.save(args.profile)
        print(
            f"links for sp {sorted(links)} stored in {args.profile}"
            + (f"; not for sp {skipped}: measured per_sp coefficients include the all-to-all" if skipped else "")
        )
    return links


if __name__ == "__main__":
    main()
