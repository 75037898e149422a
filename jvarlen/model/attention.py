"""The one attention entry point of the model.

Every attention call of the decoder goes through :func:`attention`, whose contract is
docs/architecture.md's "Packed attention inputs": a query sees a key iff both carry the same
non-zero segment id and ``kv_position <= q_position``. The work is done by
``jvarlen.kernels.varlen_attention`` (Pallas on GPU, blockwise XLA elsewhere).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax

from jvarlen import kernels


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """Per-token metadata shared by every layer of one forward pass.

    segment_ids, positions: int32 ``[B, T]`` for the queries; the ``kv_*`` fields default
    to the same arrays (self-attention) and are longer (``[B, S]``, S ≥ T) when a slice
    attends to the cached K/V of earlier slices of its document.
    """

    segment_ids: jax.Array
    positions: jax.Array
    kv_segment_ids: jax.Array | None = None
    kv_positions: jax.Array | None = None
    # Tile schedule of the kernel (kernels.block_info_for), computed once per forward
    # pass and shared by every layer; None lets each call compute its own.
    block_info: Any = None

    def with_block_info(self, implementation: str) -> "AttentionInputs":
        """These inputs with the kernel's tile schedule attached (not needed by "reference")."""
        if implementation == "reference" or self.block_info is not None:
            return self
        kv_segment_ids, kv_positions = self.keys()
        info = kernels.block_info_for(self.segment_ids, kv_segment_ids, self.positions, kv_positions, causal=True)
        return dataclasses.replace(self, block_info=info)

    def keys(self) -> tuple[jax.Array, jax.Array]:
        """(kv_segment_ids, kv_positions), defaulting to the queries' own (self-attention)."""
        kv_segment_ids = self.segment_ids if self.kv_segment_ids is None else self.kv_segment_ids
        kv_positions = self.positions if self.kv_positions is None else self.kv_positions
        return kv_segment_ids, kv_positions


class AttentionFn(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, inputs: AttentionInputs) -> jax.Array:
        """q [B, T, H, D], k/v [B, S, Hkv, D] -> [B, T, H, D]."""


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    inputs: AttentionInputs,
    *,
    implementation: str = "auto",
) -> jax.Array:
    """Causal packed attention. q [B, T, H, D], k/v [B, S, Hkv, D] -> [B, T, H, D]."""
    kv_segment_ids, kv_positions = inputs.keys()
    return kernels.varlen_attention(
        q,
        k,
        v,
        q_segment_ids=inputs.segment_ids,
        kv_segment_ids=kv_segment_ids,
        q_positions=inputs.positions,
        kv_positions=kv_positions,
        causal=True,
        implementation=implementation,
        block_info=None if implementation == "reference" else inputs.block_info,
    )


def make_attention_fn(implementation: str = "auto") -> Callable[..., jax.Array]:
    """The default attention of the model for a given implementation name."""

    def attention_fn(q, k, v, inputs):
        return attention(q, k, v, inputs, implementation=implementation)

    return attention_fn
