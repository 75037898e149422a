"""Hugging Face ``config.json`` <-> jvarlen's model fields (pure Python: no JAX, and no import of
``jvarlen.config``, which calls :func:`read_model_fields` for ``model.init_from``).

Supported architectures (``architectures[0]`` of config.json, else its ``model_type``; the two
must agree when both are given, as transformers builds the model by ``model_type``):
``LlamaForCausalLM`` (no attention or MLP biases), ``Qwen2ForCausalLM`` (q/k/v biases, no sliding
window) and ``MistralForCausalLM`` without a sliding window (a Llama then). Anything else is refused
by name. RoPE: plain, ``linear`` and ``llama3`` scaling; other rules (``dynamic``, ``yarn``,
``longrope``, ...) are refused. The mapping tables are in docs/design/hf-interop.md.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

# architecture name -> (model_type, q/k/v biases)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False),
    "Qwen2ForCausalLM": ("qwen2", True),
    "MistralForCausalLM": ("mistral", False),
}
_BY_MODEL_TYPE = {model_type: name for name, (model_type, _) in ARCHITECTURES.items()}
ROPE_RULES = ("linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
MISTRAL_DEFAULT_WINDOW = 4096


class HFCheckpointError(ValueError):
    """A Hugging Face model directory that jvarlen cannot read or does not support; the message
    names the file, the field or the architecture."""


def read_hf_config(directory: str | os.PathLike) -> dict:
    """The parsed ``config.json`` of a Hugging Face model directory."""
    directory = os.fspath(directory)
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise HFCheckpointError(
            f"{directory!r} is not a directory; give a Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer.json)"
        )
    if not os.path.isfile(path):
        raise HFCheckpointError(f"{directory!r} has no config.json: not a Hugging Face model directory")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError) as error:
        raise HFCheckpointError(f"{path}: cannot be read as JSON ({error})") from None
    if not isinstance(hf, dict):
        raise HFCheckpointError(f"{path}: expected a JSON object, found {type(hf).__name__}")
    return hf


def architecture(hf: dict, where: str = "config.json") -> str:
    """The supported architecture name of ``hf`` (raises :class:`HFCheckpointError` naming any other)."""
    names = hf.get("architectures") or []
    name = names[0] if names else _BY_MODEL_TYPE.get(hf.get("model_type", ""), hf.get("model_type"))
    if name not in ARCHITECTURES:
        raise HFCheckpointError(
            f"{where}: architecture {name!r} (model_type {hf.get('model_type')!r}) is not supported; jvarlen "
            f"imports {', '.join(ARCHITECTURES)}"
        )
    model_type = hf.get("model_type")
    if model_type is not None and model_type != ARCHITECTURES[name][0]:
        raise HFCheckpointError(
            f"{where}: architectures names {name} but model_type is {model_type!r} (transformers builds a "
            f"{model_type!r} model from it); correct one of the two"
        )
    return name


def _rope(hf: dict, where: str) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling as RopeScalingConfig fields or None) from either spelling:
    transformers 5's ``rope_parameters`` or the older top-level ``rope_theta`` + ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or params)
    theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
    rule = scaling.get("rope_type", scaling.get("type", "default"))
    if rule in (None, "default"):
        if scaling.get("factor") not in (None, 1, 1.0):
            raise HFCheckpointError(f"{where}: RoPE scaling with factor {scaling['factor']} names no rule (rope_type)")
        return float(theta), None
    if rule not in ROPE_RULES:
        raise HFCheckpointError(
            f"{where}: RoPE scaling rule {rule!r} is not supported; jvarlen implements plain RoPE, "
            f"{' and '.join(repr(r) for r in ROPE_RULES)}"
        )
    if rule == "linear":
        return float(theta), {"rope_type": "linear", "factor": float(scaling["factor"])}
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise HFCheckpointError(f"{where}: llama3 rope scaling lacks {missing}")
    fields = {k: float(scaling[k]) for k in _LLAMA3_KEYS}
    fields["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    return float(theta), {"rope_type": "llama3", **fields}


def model_fields(hf: dict, where: str = "config.json") -> dict[str, Any]:
    """jvarlen ModelConfig fields (jvarlen.config.CHECKPOINT_FIELDS) of a Hugging Face config dict;
    ``rope_scaling`` is a dict of RopeScalingConfig fields or None."""
    name = architecture(hf, where)
    qkv_bias = ARCHITECTURES[name][1]
    activation = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if activation != "silu":
        raise HFCheckpointError(f"{where}: hidden_act {activation!r} is not supported (jvarlen's MLP is SwiGLU: silu)")
    if name in ("LlamaForCausalLM", "MistralForCausalLM") and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise HFCheckpointError(
            f"{where}: {name} with attention_bias/mlp_bias is not supported (jvarlen has biases on q/k/v only)"
        )
    if name == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
        raise HFCheckpointError(f"{where}: Qwen2 with use_sliding_window=true is not supported (full attention only)")
    # transformers' MistralConfig defaults to a 4,096-token window: a config without the key has one
    if name == "MistralForCausalLM" and hf.get("sliding_window", MISTRAL_DEFAULT_WINDOW) is not None:
        raise HFCheckpointError(
            f"{where}: MistralForCausalLM with sliding_window={hf.get('sliding_window', MISTRAL_DEFAULT_WINDOW)}"
            f"{'' if 'sliding_window' in hf else ' (the default of an absent key)'} is not supported "
            "(full attention only; sliding_window must be null)"
        )
    try:
        rope_params = hf.get("rope_parameters") or {}
        partial = hf.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))
        if partial is not None and float(partial) != 1.0:
            raise HFCheckpointError(
                f"{where}: partial_rotary_factor={partial} is not supported (jvarlen rotates every head dimension)"
            )
        heads = int(hf["num_attention_heads"])
        d_model = int(hf["hidden_size"])
        theta, scaling = _rope(hf, where)
        return {
            "vocab_size": int(hf["vocab_size"]),
            "d_model": d_model,
            "num_layers": int(hf["num_hidden_layers"]),
            "num_heads": heads,
            "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
            "head_dim": int(hf.get("head_dim") or d_model // heads),
            "mlp_dim": int(hf["intermediate_size"]),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "qkv_bias": qkv_bias,
            "rope_theta": theta,
            "rope_scaling": scaling,
        }
    except HFCheckpointError:
        raise
    except KeyError as missing:
        raise HFCheckpointError(f"{where}: required field {missing} is missing") from None
    except (TypeError, ValueError) as error:
        raise HFCheckpointError(f"{where}: a field has a value of the wrong type ({error})") from None


def read_model_fields(directory: str | os.PathLike) -> dict[str, Any]:
    """:func:`model_fields` of the config.json in ``directory``."""
    return model_fields(read_hf_config(directory), os.path.join(os.fspath(directory), "config.json"))


def _max_position(base_max: int, scaling: Optional[dict], base: Optional[dict]) -> int:
    """``max_position_embeddings`` of an export: the base's, unless the run changed the RoPE scaling
    (a context extension), then what the new scaling reaches: llama3's original length times its
    factor, linear's factor relative to the base's (serving stacks cap the context by this field)."""
    base_scaling = _rope(base or {}, "the base config.json")[1]
    if scaling is None or scaling == base_scaling:
        return int(base_max)
    if scaling["rope_type"] == "llama3":
        return max(int(base_max), int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    base_factor = base_scaling["factor"] if base_scaling and base_scaling["rope_type"] == "linear" else 1.0
    return max(int(base_max), int(base_max * scaling["factor"] / base_factor))


def hf_config_dict(
    model,
    dtype: str,
    base: Optional[dict] = None,
    *,
    token_ids: Optional[dict[str, int]] = None,
    trained_length: Optional[int] = None,
) -> dict:
    """A Hugging Face config.json for jvarlen ModelConfig ``model`` with weights of ``dtype``.

    Qwen2ForCausalLM when the model has q/k/v biases, else LlamaForCausalLM. ``base`` (the config.json
    the run started from, when known) supplies what jvarlen does not model (token ids, maximum
    position, ...); every architecture field is written from ``model``. RoPE is written in the older
    top-level spelling (``rope_theta``, ``rope_scaling``), which transformers 4 and 5 both read.
    ``token_ids`` (``{"bos": id, "eos": id, "pad": id}``, those known) are the special ids of the
    tokenizer the run's data went through: they replace the base's (transformers stops generating at
    ``eos_token_id``; without one it assumes 2), except where the base lists several end ids that
    include the run's. ``trained_length`` (the longest document the run trained on) raises
    ``max_position_embeddings`` to it; without a base that is the value written (else 4096).
    """
    name = "Qwen2ForCausalLM" if model.qkv_bias else "LlamaForCausalLM"
    out = {
        k: v
        for k, v in (base or {}).items()
        if k in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "initializer_range")
    }
    scaling = None
    if model.rope_scaling is not None:
        fields = {k: getattr(model.rope_scaling, k) for k in ("rope_type", "factor", *_LLAMA3_KEYS[1:])}
        scaling = {"rope_type": "linear", "factor": fields["factor"]} if fields["rope_type"] == "linear" else fields
    out.update(
        architectures=[name],
        model_type=ARCHITECTURES[name][0],
        vocab_size=model.vocab_size,
        hidden_size=model.d_model,
        intermediate_size=model.mlp_dim,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        hidden_act="silu",
        rms_norm_eps=model.norm_eps,
        tie_word_embeddings=model.tie_embeddings,
        rope_theta=model.rope_theta,
        rope_scaling=scaling,
        torch_dtype=dtype,
    )
    base_max = out.get("max_position_embeddings", trained_length or 4096)
    out["max_position_embeddings"] = max(_max_position(base_max, scaling, base), trained_length or 0)
    for kind, token in (token_ids or {}).items():
        earlier = out.get(f"{kind}_token_id")
        if not (isinstance(earlier, list) and token in earlier):
            out[f"{kind}_token_id"] = int(token)
    if name == "LlamaForCausalLM":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    return out
