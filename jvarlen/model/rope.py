"""Rotary position embeddings: the frequencies (plain, or rescaled for a longer context) and
their application in the rotate-half form.

Rotate-half: a head vector ``x [D]`` is split into halves ``(x1, x2)`` and the pair
``(x1[i], x2[i])`` is rotated by ``position * inv_freq[i]``. This is the layout of Hugging Face
Llama/Qwen2 checkpoints (their q/k projection rows are stored for it), so their weights load
without a permutation (docs/design/hf-interop.md; checked against transformers' logits in
tests/test_hf_fixtures.py).
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from jvarlen.config import RopeScalingConfig


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[RopeScalingConfig] = None) -> jax.Array:
    """``inv_freq [D/2]`` (float32): ``theta ** (-2i / D)``, then ``scaling``'s rule.

    * ``linear``: every frequency divided by ``factor``.
    * ``llama3``: wavelengths ``2 pi / f`` longer than ``original_max_position_embeddings /
      low_freq_factor`` are divided by ``factor``, those shorter than ``original / high_freq_factor``
      are kept, and in between the frequency is the blend ``(1 - s) f / factor + s f`` with
      ``s = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    """
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        original = float(scaling.original_max_position_embeddings)
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        long_waves = wavelength > original / low
        scaled = jnp.where(long_waves, inv_freq / scaling.factor, inv_freq)
        s = (original / wavelength - low) / (high - low)
        blended = (1 - s) * scaled / scaling.factor + s * scaled
        middle = ~long_waves & ~(wavelength < original / high)
        return jnp.where(middle, blended, scaled)
    raise ValueError(f"unknown rope_scaling.rope_type {scaling.rope_type!r}")


def rotary(x_bthd: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding by the per-document position of each token (rotate-half form)."""
    angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    sin = jnp.sin(angles)[:, :, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x_bthd.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_bthd.dtype)
