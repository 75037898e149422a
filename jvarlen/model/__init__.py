"""The Flax NNX decoder and its attention entry point."""

from jvarlen.model.attention import AttentionInputs, attention, make_attention_fn
from jvarlen.model.loss import cross_entropy_sums
from jvarlen.model.transformer import Transformer, abstract_model, build_model, parameter_count

__all__ = [
    "AttentionInputs",
    "Transformer",
    "abstract_model",
    "attention",
    "build_model",
    "cross_entropy_sums",
    "make_attention_fn",
    "parameter_count",
]
