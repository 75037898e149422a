"""What the scripts that read compiled programs' memory share: the ``--config / --devices /
--compute_dtype / --target`` options, the host's fake CPU devices or abstract GPUs of one host
(deviceless CUDA compilation: the ``gpu-aot`` extra, jvarlen.gpu_aot), and the run's step context
with an abstract train state. Import this before JAX: :func:`context` sets the device count.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "llama-7b.yaml"))
    ap.add_argument("--devices", type=int, default=16)
    ap.add_argument("--compute_dtype", default="bfloat16")
    ap.add_argument("--target", help="abstract GPUs of this target (h100, a100) instead of CPU devices")


def context(args):
    """-> (config with ``args.compute_dtype``, its :class:`~jvarlen.runtime.strategy.StepContext` on
    ``args.devices`` CPU devices or abstract ``args.target`` GPUs). Sets ``XLA_FLAGS`` first."""
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # --target: no driver needed to compile
    sys.path.insert(0, ROOT)
    import jax

    from jvarlen.config import load_config
    from jvarlen.gpu_aot import abstract_devices, abstract_step_context

    config = load_config(args.config)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, compute_dtype=args.compute_dtype))
    devices = abstract_devices(args.target, args.devices) if args.target else jax.devices("cpu")[: args.devices]
    return config, abstract_step_context(config, devices)


def compiling_for(args):
    """While tracing, the attention compiled for ``args.target``'s GPU (its Pallas kernels and tiles,
    as :func:`jvarlen.gpu_aot.lower_train_step` asks); on CPU devices nothing changes."""
    if not args.target:
        return contextlib.nullcontext()
    from jvarlen import gpu_aot, kernels

    return kernels.compile_for(gpu_aot.gpu_target(args.target))


def peak(m) -> int:
    """A compiled program's bytes on one device: arguments, outputs and temporaries, less aliasing."""
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
