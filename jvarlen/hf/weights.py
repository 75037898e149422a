"""Which Hugging Face tensor each jvarlen parameter is, and how its layout differs (pure numpy).

A Hugging Face linear weight is ``[out, in]``; jvarlen stores ``[in, out]`` with the heads split
out (``wq [d, H, D]``, ``wo [H, D, d]``) and the layers stacked (``[L, ...]``). A
:class:`TensorMap` describes one parameter as a *view* of the HF tensor (each HF dimension split
into the sizes of ``groups``) whose dimensions are then permuted by ``perm``:
``jvarlen = hf.reshape(view).transpose(perm)``. :meth:`TensorMap.read` reads any block of the
jvarlen parameter from only the HF rows/columns that hold it, which is what lets the import fill
each device's shard straight from the memory-mapped file. The full table is in
docs/design/hf-interop.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

# (HF tensor name, slices over its dimensions) -> that block of the tensor
Reader = Callable[[str, tuple[slice, ...]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One jvarlen parameter (``path``) <-> one HF tensor per layer (``name``, with ``{layer}``)."""

    path: tuple[str, ...]  # jvarlen parameter path, e.g. ("layers", "attention", "wq")
    name: str  # HF tensor name; "{layer}" is the layer index for stacked parameters
    groups: tuple[tuple[int, ...], ...]  # per HF dimension: the view dimensions it splits into
    perm: tuple[int, ...]  # jvarlen dimension i is view dimension perm[i]

    @property
    def stacked(self) -> bool:
        return "{layer}" in self.name

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.groups)

    @property
    def view(self) -> tuple[int, ...]:
        return tuple(s for g in self.groups for s in g)

    @property
    def shape(self) -> tuple[int, ...]:
        """jvarlen shape of one layer's parameter."""
        return tuple(self.view[p] for p in self.perm)

    def hf_name(self, layer: int | None = None) -> str:
        return self.name.format(layer=layer)

    def to_jvarlen(self, hf: np.ndarray) -> np.ndarray:
        return np.asarray(hf).reshape(self.view).transpose(self.perm)

    def to_hf(self, jv: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(jv).transpose(np.argsort(self.perm)).reshape(self.hf_shape))

    def read(self, read: Reader, layer: int | None, index: tuple[slice, ...]) -> np.ndarray:
        """The block ``index`` (slices over :attr:`shape`) of this parameter, reading from the HF
        tensor only the rows/columns that hold it (whole inner groups: a head's D rows)."""
        view_index = [slice(None)] * len(self.view)
        for dim, s in zip(self.perm, index):
            view_index[dim] = s
        hf_slices, block_shape, inner, k = [], [], [], 0
        for group in self.groups:
            start, stop, _ = view_index[k].indices(group[0])
            size = math.prod(group[1:])
            hf_slices.append(slice(start * size, stop * size))
            block_shape += [stop - start, *group[1:]]
            inner += [slice(None), *view_index[k + 1 : k + len(group)]]
            k += len(group)
        block = read(self.hf_name(layer), tuple(hf_slices)).reshape(block_shape)
        return block[tuple(inner)].transpose(self.perm)


def tensor_maps(cfg) -> list[TensorMap]:
    """The table for jvarlen ModelConfig ``cfg`` (Llama names; Qwen2 and Mistral use the same)."""
    d, h, k, hd, f, v = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
    layer = "model.layers.{layer}."
    maps = [
        TensorMap(("embed",), "model.embed_tokens.weight", ((v,), (d,)), (0, 1)),
        TensorMap(("final_norm", "scale"), "model.norm.weight", ((d,),), (0,)),
        TensorMap(("layers", "attention_norm", "scale"), layer + "input_layernorm.weight", ((d,),), (0,)),
        TensorMap(("layers", "mlp_norm", "scale"), layer + "post_attention_layernorm.weight", ((d,),), (0,)),
        TensorMap(("layers", "attention", "wq"), layer + "self_attn.q_proj.weight", ((h, hd), (d,)), (2, 0, 1)),
        TensorMap(("layers", "attention", "wk"), layer + "self_attn.k_proj.weight", ((k, hd), (d,)), (2, 0, 1)),
        TensorMap(("layers", "attention", "wv"), layer + "self_attn.v_proj.weight", ((k, hd), (d,)), (2, 0, 1)),
        TensorMap(("layers", "attention", "wo"), layer + "self_attn.o_proj.weight", ((d,), (h, hd)), (1, 2, 0)),
        TensorMap(("layers", "mlp", "w_gate"), layer + "mlp.gate_proj.weight", ((f,), (d,)), (1, 0)),
        TensorMap(("layers", "mlp", "w_up"), layer + "mlp.up_proj.weight", ((f,), (d,)), (1, 0)),
        TensorMap(("layers", "mlp", "w_down"), layer + "mlp.down_proj.weight", ((d,), (f,)), (1, 0)),
    ]
    if cfg.qkv_bias:
        maps += [
            TensorMap(("layers", "attention", "q_bias"), layer + "self_attn.q_proj.bias", ((h, hd),), (0, 1)),
            TensorMap(("layers", "attention", "k_bias"), layer + "self_attn.k_proj.bias", ((k, hd),), (0, 1)),
            TensorMap(("layers", "attention", "v_bias"), layer + "self_attn.v_proj.bias", ((k, hd),), (0, 1)),
        ]
    if not cfg.tie_embeddings:
        maps.append(TensorMap(("head",), "lm_head.weight", ((v,), (d,)), (1, 0)))
    return maps


def hf_tensor_names(cfg) -> list[str]:
    """Every HF tensor name the table reads for ``cfg`` (layers expanded)."""
    names = []
    for m in tensor_maps(cfg):
        names += [m.hf_name(i) for i in range(cfg.num_layers)] if m.stacked else [m.hf_name()]
    return names


# Tensors a checkpoint may hold that carry no parameter (older Llama files store RoPE's buffer).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
