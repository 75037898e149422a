"""Analytic cost coefficients for clusters we cannot run on (labelled ``analytic=True``).

Compute times come from FLOP counts (:class:`~jvarlen.plan.cost.ModelShape`) divided by peak
bf16 TFLOP/s times an efficiency; memory from an activation estimate per token; links from
NVLink / network bandwidth times an efficiency. These are planning estimates, not
measurements: measure with ``python -m jvarlen.profile`` on the real machine when you can.

Shipped specs (public datasheets, dense bf16 without sparsity):

* ``a800``: 8 x A800-SXM4-80GB per node, 312 TFLOP/s, 2.0 TB/s HBM, NVLink 400 GB/s,
  InfiniBand 400 Gb/s per node (the InfiniPipe / Hydraulis testbed).
* ``h100``: 8 x H100-SXM5-80GB per node, 989 TFLOP/s, 3.35 TB/s HBM, NVLink 900 GB/s,
  8 x 400 Gb/s InfiniBand NDR per node (DGX H100).
* ``h200``: 8 x H200-SXM-141GB per node, 989 TFLOP/s, 4.8 TB/s HBM, NVLink 900 GB/s,
  8 x 400 Gb/s InfiniBand per node.

Small-chunk efficiency (``ClusterSpec.gemm_half_rows``, default 0 = off). A GEMM whose
row count ``m`` (tokens per device, i.e. chunk tokens / sp under Ulysses) is small
reaches only part of the large-GEMM throughput (InfiniPipe App. B, Fig. 13: finer
chunks are slower per token). We model this with Hockney's half-performance length
(R. Hockney, C. Jesshope, *Parallel Computers 2*, 1988, §1.3: ``r(m) = r_inf·m/(m + m_half)``),
which is exact for "a fixed start-up cost plus a per-row cost": the layer's matmul time
becomes ``alpha2·(m + m_half)``, i.e. ``alpha2·m_half`` more per chunk and layer
(``LayerTime.beta1``; twice that in the backward, which runs two GEMMs per forward GEMM).
We ship no value: none of our measurements covers an A800/H100 GEMM sweep, so the
benchmark reports the speedups as a function of ``m_half`` instead (a sensitivity
analysis, still analytic) rather than pick a number.
"""

from __future__ import annotations

import dataclasses
import datetime

from jvarlen.plan.cost import CostCoefficients, LayerTime, Link, ModelShape, ProfileMeta


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Hardware figures of one node type. Bandwidths in bytes/s, memory in bytes."""

    name: str
    device_kind: str
    gpus_per_node: int
    peak_flops: float  # dense bf16 FLOP/s per GPU
    hbm_bytes: float
    hbm_bandwidth: float
    nvlink_bandwidth: float  # per GPU, bytes/s (the datasheet's bidirectional figure)
    network_bandwidth_per_node: float  # bytes/s leaving a node, shared by its GPUs
    matmul_efficiency: float = 0.5  # fraction of peak reached by the layer matmuls
    attention_efficiency: float = 0.4  # fraction of peak reached by flash attention forward
    attention_bwd_factor: float = 2.5  # flash attention backward / forward time
    link_efficiency: float = 0.7  # fraction of link bandwidth collectives reach
    layer_overhead_s: float = 40e-6  # launch/framework overhead per layer per chunk (forward)
    intra_latency_s: float = 10e-6
    inter_latency_s: float = 20e-6
    memory_margin: float = 0.9  # usable fraction of HBM (Hydraulis B.1 "safety margin")
    workspace_bytes: float = 2e9  # runtime context, collective buffers, allocator slack
    gemm_half_rows: float = 0.0  # Hockney m_half of the layer GEMMs, rows per device (0: no small-GEMM penalty)


A800 = ClusterSpec(
    name="a800",
    device_kind="NVIDIA A800-SXM4-80GB",
    gpus_per_node=8,
    peak_flops=312e12,
    hbm_bytes=80e9,
    hbm_bandwidth=2.0e12,
    nvlink_bandwidth=400e9,
    network_bandwidth_per_node=400e9 / 8,
    matmul_efficiency=0.55,
    attention_efficiency=0.45,
)
H100 = ClusterSpec(
    name="h100",
    device_kind="NVIDIA H100-SXM5-80GB",
    gpus_per_node=8,
    peak_flops=989e12,
    hbm_bytes=80e9,
    hbm_bandwidth=3.35e12,
    nvlink_bandwidth=900e9,
    network_bandwidth_per_node=8 * 400e9 / 8,
    matmul_efficiency=0.45,
    attention_efficiency=0.35,
)
H200 = dataclasses.replace(
    H100, name="h200", device_kind="NVIDIA H200-SXM-141GB", hbm_bytes=141e9, hbm_bandwidth=4.8e12
)
CLUSTERS = {c.name: c for c in (A800, H100, H200)}


def activation_bytes_per_token(model: ModelShape, bytes_per_element: int = 2) -> float:
    """Estimate of ``m_token`` (bytes kept per token per layer for the backward, flash attention):
    norm inputs (2 D), attention input (D), q/k/v (q + 2 kv), attention output (q), MLP input (D),
    gate and up (2 F), activated product (F), in the compute dtype, plus fp32 softmax
    log-sum-exp per head. A layer under the default residual policy (``dots_and_attention``, the
    fused step's and the pipeline's) keeps less: llama-7b's compiled data-parallel step on abstract
    H100s 92,606 B per token and layer against this 131,712 (plain autodiff, which keeps the norms'
    and the MLP activation's fp32 intermediates too, 243,096; docs/design/residuals.md). The
    runtime charges a layer what its policy keeps (``m_stored_token``)."""
    d, f = model.d_model, model.mlp_dim
    elems = 2 * d + d + model.q_dim + 2 * model.kv_dim + model.q_dim + d + 3 * f
    return bytes_per_element * elems + 4 * model.num_heads


def analytic_coefficients(model: ModelShape, cluster: ClusterSpec | str, num_nodes: int = 1) -> CostCoefficients:
    """Cost coefficients of ``model`` on ``num_nodes`` nodes of ``cluster`` from hardware figures."""
    c = CLUSTERS[cluster] if isinstance(cluster, str) else cluster
    mm = c.peak_flops * c.matmul_efficiency
    at = c.peak_flops * c.attention_efficiency
    alpha2 = model.layer_linear_flops_per_token / mm
    head_alpha2 = model.head_flops_per_token / mm
    fwd = LayerTime(
        alpha1=model.attention_flops_per_pair / at,
        alpha2=alpha2,
        beta1=c.layer_overhead_s + c.gemm_half_rows * alpha2,
    )
    bwd = LayerTime(fwd.alpha1 * c.attention_bwd_factor, fwd.alpha2 * 2.0, fwd.beta1 * 2.0)
    head_fwd = LayerTime(0.0, head_alpha2, c.layer_overhead_s + c.gemm_half_rows * head_alpha2)
    nvlink = c.nvlink_bandwidth * c.link_efficiency / 2  # one direction
    net = c.network_bandwidth_per_node / c.gpus_per_node * c.link_efficiency
    intra = Link(nvlink, c.intra_latency_s)
    inter = Link(net, c.inter_latency_s)
    n = num_nodes * c.gpus_per_node
    # Gradient push (fp32) + parameter pull (bf16) of a stage's parameters over the slowest link
    # (CostModel.step_overhead scales it by the layout's largest stage), then the Adam update
    # streaming 16 + 4 bytes per local parameter through HBM.
    link = inter if num_nodes > 1 else intra
    update = model.param_count / n * 20 / c.hbm_bandwidth
    degrees = [d for d in (2, 4, 8, 16, 32, 64) if d <= n]
    return CostCoefficients(
        fwd=fwd,
        bwd=bwd,
        bwd_factor=2.0,
        head_fwd=head_fwd,
        head_bwd=LayerTime(0.0, head_fwd.alpha2 * 2.0, head_fwd.beta1),
        m_token=activation_bytes_per_token(model),
        # a rematerialised layer's backward holds that layer's activations again (llama-7b's fused
        # step on 8 abstract H100s at 64K tokens per device: 8.1-8.5 GiB above the charge without
        # it, 8.04 GiB by this; docs/benchmarks.md, "The head in tiles")
        m_work_remat_token=activation_bytes_per_token(model),
        m_head_token=(4.0 + 2.0) * model.vocab_size,  # a tile's fp32 logits + their bf16 gradient, per row
        bytes_per_element=2,
        dkv_bytes_per_element=2,  # the executor's dK/dV pools are in the compute dtype (docs/design/pipeline.md)
        master_bytes_per_param=12.0,
        stage_bytes_per_param=6.0,
        workspace_bytes=c.workspace_bytes,
        memory_budget=c.hbm_bytes * c.memory_margin,
        gpus_per_node=c.gpus_per_node,
        alltoall_intra={d: intra for d in degrees if d <= c.gpus_per_node},
        alltoall_inter={d: inter for d in degrees if d > c.gpus_per_node},
        alltoall_default=inter,
        p2p_intra=intra,
        p2p_inter=inter,
        step_overhead=update,
        sync_bytes_per_param=4.0 + 2.0,
        sync_link=link,
        meta=ProfileMeta(
            model_key=model.key(),
            backend="analytic",
            device_kind=c.device_kind,
            analytic=True,
            source=f"hardware.analytic_coefficients({c.name}, num_nodes={num_nodes})",
            created=datetime.date.today().isoformat(),
        ),
    )
