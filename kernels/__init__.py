"""Varlen attention kernels, installed as ``jvarlen.kernels``."""

from jvarlen.kernels.api import block_info_for, varlen_attention
from jvarlen.kernels.block_ranges import BlockInfo, compute_block_info
from jvarlen.kernels.common import EMPTY_ROW_LSE, BlockSizes
from jvarlen.kernels.reference import reference_attention

__all__ = [
    "EMPTY_ROW_LSE",
    "BlockInfo",
    "BlockSizes",
    "block_info_for",
    "compute_block_info",
    "reference_attention",
    "varlen_attention",
]
