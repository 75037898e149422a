"""Ulysses sequence parallelism: attention with tokens sharded over the ``sp`` mesh axis.

Outside attention every ``[B, T, ...]`` activation is split rows-over-``dp`` and
tokens-over-``sp`` (``P('dp', 'sp')``). Attention needs whole documents, so inside one
``jax.shard_map`` each device trades its token slice of all heads for all tokens of a
slice of the heads (``all_to_all``), runs the ordinary varlen kernel on that, and trades
back. Segment ids and positions are small and all-gathered.

GQA: kv heads are split over ``sp`` too. When ``Hkv`` is not a multiple of ``sp`` each kv
head is repeated ``r = sp / gcd(Hkv, sp)`` times first (``lcm(Hkv, sp)`` heads), so that a
device's query heads find their kv heads locally. Cost: the K and V all-to-alls (forward)
and the dK/dV all-to-alls (backward) move ``r``× the bytes, and each device's kernel
reads ``r``× more K/V than with enough kv heads; the repeat's transpose sums the
gradients of the copies, so dK/dV stay exact.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jvarlen import kernels
from jvarlen.model.attention import AttentionInputs
from jvarlen.parallel.layouts import DP, SP


def kv_repeats(num_kv_heads: int, sp: int) -> int:
    """How many times each kv head is repeated so that ``sp`` divides the kv heads."""
    return sp // math.gcd(num_kv_heads, sp)


def check_ulysses_shapes(mesh: Mesh, q_shape, k_shape) -> None:
    """Raises ValueError naming the constraint a (dp, sp) split of q/k would break."""
    dp, sp = mesh.shape[DP], mesh.shape[SP]
    b, t, h, _ = q_shape
    s, hkv = k_shape[1], k_shape[2]
    if b % dp:
        raise ValueError(f"Ulysses: batch rows ({b}) must be divisible by dp ({dp})")
    if t % sp or s % sp:
        raise ValueError(f"Ulysses: query tokens ({t}) and key tokens ({s}) must be divisible by sp ({sp})")
    if h % sp:
        raise ValueError(f"Ulysses: query heads ({h}) must be divisible by sp ({sp})")
    if h % hkv:
        raise ValueError(f"Ulysses: query heads ({h}) must be a multiple of kv heads ({hkv})")


def seq_to_heads(x: jax.Array, axis_name: str = SP) -> jax.Array:
    """[b, T/sp, H, D] -> [b, T, H/sp, D] (inside shard_map over ``axis_name``)."""
    sp = jax.lax.axis_size(axis_name)
    if x.shape[2] % sp:
        raise ValueError(f"seq_to_heads: heads ({x.shape[2]}) must be divisible by {axis_name} ({sp})")
    if sp == 1:
        return x
    return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x: jax.Array, axis_name: str = SP) -> jax.Array:
    """[b, T, H/sp, D] -> [b, T/sp, H, D] (inside shard_map over ``axis_name``)."""
    sp = jax.lax.axis_size(axis_name)
    if x.shape[1] % sp:
        raise ValueError(f"heads_to_seq: tokens ({x.shape[1]}) must be divisible by {axis_name} ({sp})")
    if sp == 1:
        return x
    return jax.lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def gather_seq(x: jax.Array, axis_name: str = SP) -> jax.Array:
    """[b, T/sp] -> [b, T] (inside shard_map over ``axis_name``): ids and positions."""
    if jax.lax.axis_size(axis_name) == 1:
        return x
    return jax.lax.all_gather(x, axis_name, axis=1, tiled=True)


def repeat_kv_heads(x: jax.Array, repeats: int) -> jax.Array:
    """[b, S, Hkv, D] -> [b, S, Hkv*repeats, D]; copy j of head i is head i*repeats + j."""
    return x if repeats == 1 else jnp.repeat(x, repeats, axis=2)


def ulysses_attention_fn(mesh: Mesh, implementation: str = "auto") -> Callable[..., jax.Array]:
    """An ``attention_fn`` for the model that runs attention Ulysses-style on ``mesh``.

    Global q [B, T, H, D], k/v [B, S, Hkv, D] split P('dp', 'sp') -> [B, T, H, D] split the
    same way. With sp = 1 it is plain data-parallel attention (each device its rows).
    """
    sp = mesh.shape[SP]
    x_spec, id_spec = P(DP, SP, None, None), P(DP, SP)
    # The blockwise kernels (XLA loops with zero-initialised carries, interpret-mode
    # Pallas) are not written for varying-manual-axes checking; every input and output
    # here is split over both dp and sp, so nothing relies on the check.
    check_vma = implementation == "reference"

    def local(q, k, v, q_seg, q_pos, kv_seg, kv_pos):
        repeats = kv_repeats(k.shape[2], sp)
        k, v = repeat_kv_heads(k, repeats), repeat_kv_heads(v, repeats)
        q, k, v = seq_to_heads(q), seq_to_heads(k), seq_to_heads(v)
        out = kernels.varlen_attention(
            q,
            k,
            v,
            q_segment_ids=gather_seq(q_seg),
            kv_segment_ids=gather_seq(kv_seg),
            q_positions=gather_seq(q_pos),
            kv_positions=gather_seq(kv_pos),
            causal=True,
            implementation=implementation,
        )
        return heads_to_seq(out)

    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(x_spec, x_spec, x_spec, id_spec, id_spec, id_spec, id_spec),
        out_specs=x_spec,
        check_vma=check_vma,
    )

    def attention_fn(q, k, v, inputs: AttentionInputs) -> jax.Array:
        check_ulysses_shapes(mesh, q.shape, k.shape)
        kv_seg = inputs.segment_ids if inputs.kv_segment_ids is None else inputs.kv_segment_ids
        kv_pos = inputs.positions if inputs.kv_positions is None else inputs.kv_positions
        return sharded(q, k, v, inputs.segment_ids, inputs.positions, kv_seg, kv_pos)

    return attention_fn
