"""Varlen attention kernels, installed as ``jvarlen.kernels``."""
