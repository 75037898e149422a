"""Peak host memory of the streaming import (jvarlen.hf.load) on a made-up Llama checkpoint.

    python scripts/measure_hf_import.py --config configs/llama-7b.yaml --dir /tmp/llama7b-synthetic \
        --num_layers 32 --param_dtype bfloat16 --devices 8

Writes (once; reused while the directory exists) a Hugging Face directory with the model's shape:
config.json and bfloat16 safetensors shards of at most 5 GB, each tensor made only when its shard is
written (values: a 1M-value random block tiled, cheap to make). Then a fresh process builds the
abstract parameters, streams them into the canonical FSDP sharding over ``--devices`` fake CPU
devices and reports, sampled every 5 ms from /proc/self/status: peak RSS, its anonymous part (copies
this process made) and its file-backed part (mapped pages of the safetensors files, which the kernel
may drop), against the size of the placed parameters. On CPU the devices' buffers are host memory, so
the placed parameters are part of RSS: the import's own cost is peak RSS minus them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak: dict[str, int] = {}
        self.running = True

    def run(self):
        while self.running:
            for k, v in _status().items():
                self.peak[k] = max(self.peak.get(k, 0), v)
            time.sleep(0.005)


def model_config(args):
    from jvarlen.config import load_config

    cfg = load_config(args.config).model
    return dataclasses.replace(cfg, num_layers=args.num_layers or cfg.num_layers, param_dtype=args.param_dtype)


def write(args) -> None:
    import numpy as np

    from jvarlen.hf.export import DTYPES
    from jvarlen.hf.hf_config import hf_config_dict
    from jvarlen.hf.safetensors_dir import write_sharded
    from jvarlen.hf.weights import tensor_maps

    cfg = model_config(args)
    os.makedirs(args.dir, exist_ok=True)
    block = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32) * 0.02
    dtype = np.dtype(DTYPES["bfloat16"])

    def tensors():
        for m in tensor_maps(cfg):
            for layer in range(cfg.num_layers) if m.stacked else [None]:
                yield m.hf_name(layer), m.hf_shape, dtype, lambda m=m: np.resize(block, m.hf_shape).astype(dtype)

    start = time.perf_counter()
    files = write_sharded(args.dir, tensors(), max_shard_bytes=5 << 30)
    with open(os.path.join(args.dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(dataclasses.replace(cfg, init_from=None), "bfloat16"), f)
    size = sum(os.path.getsize(os.path.join(args.dir, f)) for f in files)
    print(f"wrote {len(files)} files, {size / 1e9:.2f} GB in {time.perf_counter() - start:.0f}s -> {args.dir}")


def measure(args) -> dict:
    import dataclasses as dc

    import jax
    from flax import nnx

    from jvarlen.hf.load import load_params
    from jvarlen.model import abstract_model
    from jvarlen.parallel.layouts import state_mesh
    from jvarlen.parallel.sharding import param_shardings

    cfg = dc.replace(model_config(args), init_from=args.dir)  # architecture fields from config.json
    sampler = Sampler()
    base = _status()
    sampler.start()
    start = time.perf_counter()
    _, abstract = nnx.split(abstract_model(cfg), nnx.Param)
    params = load_params(args.dir, cfg, abstract, param_shardings(abstract, state_mesh()))
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    sampler.running = False
    sampler.join()
    placed = sum(x.nbytes for x in jax.tree.leaves(params))
    largest = max(x.nbytes for x in jax.tree.leaves(params)) // len(jax.devices())
    result = {
        "parameters": sum(x.size for x in jax.tree.leaves(params)),
        "param_dtype": cfg.param_dtype,
        "devices": len(jax.devices()),
        "placed_gb": placed / 1e9,
        "rss_before_gb": base["VmRSS"] / 1e9,
        "peak_rss_gb": sampler.peak["VmRSS"] / 1e9,
        "peak_anon_gb": sampler.peak["RssAnon"] / 1e9,
        "peak_file_gb": sampler.peak["RssFile"] / 1e9,
        "vm_hwm_gb": _status()["VmHWM"] / 1e9,
        "peak_minus_placed_minus_before_gb": (sampler.peak["VmRSS"] - placed - base["VmRSS"]) / 1e9,
        "largest_shard_gb": largest / 1e9,
        "seconds": seconds,
    }
    print(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/llama-7b.yaml")
    parser.add_argument("--dir", default="/tmp/jvarlen-synthetic-llama")
    parser.add_argument("--num_layers", type=int, default=None)
    parser.add_argument("--param_dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--measure", action="store_true", help="(internal) measure in this process")
    args = parser.parse_args()
    if args.measure:
        measure(args)
        return
    if not os.path.isfile(os.path.join(args.dir, "config.json")):
        write(args)
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}", "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, __file__, *sys.argv[1:], "--measure"], env=env, check=True)


if __name__ == "__main__":
    main()
