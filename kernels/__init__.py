"""Varlen attention kernels, installed as ``jvarlen.kernels``."""

from jvarlen.kernels.api import ATTENTION_RESIDUALS, block_info_for, kernel_config_for, varlen_attention
from jvarlen.kernels.block_ranges import BlockInfo, compute_block_info
from jvarlen.kernels.common import EMPTY_ROW_LSE, BlockSizes, UnsupportedError
from jvarlen.kernels.gpu_config import GpuTarget, KernelConfig, KernelTiles, compile_for, current_target
from jvarlen.kernels.reference import reference_attention

__all__ = [
    "ATTENTION_RESIDUALS",
    "EMPTY_ROW_LSE",
    "BlockInfo",
    "BlockSizes",
    "GpuTarget",
    "KernelConfig",
    "KernelTiles",
    "UnsupportedError",
    "compile_for",
    "current_target",
    "block_info_for",
    "compute_block_info",
    "kernel_config_for",
    "reference_attention",
    "varlen_attention",
]
