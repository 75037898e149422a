"""Model FLOPs of a step and the utilization they give (MFU), from the step's documents.

On variable-length batches a step's work is not its token count: attention grows with the square
of each document's length, so tokens/s alone cannot compare a step of short documents with one of
long ones. A step's **model FLOPs** are those of its documents' forward and backward as the model
defines them, whatever the execution does on top (recomputation, padding to a bucket, pipeline
bubbles), the convention of MFU (PaLM, App. B):

* matmuls: per token, every decoder layer's projections and MLP plus the LM head, 2 FLOPs per
  multiply-add (:attr:`ModelShape.layer_linear_flops_per_token`, ``head_flops_per_token``);
* attention: per document of ``l`` tokens, ``l²`` units of ``attention_flops_per_pair`` per layer
  (the causal query-key pairs, QKᵀ and PV), the count the cost model uses (Eq. 1);
* training = 3 × forward (the backward's two products per forward product).

Each piece of the batch is one attention sequence (a document longer than ``data.max_doc_tokens`` is
split into pieces that do not attend to each other), so the pieces' lengths give the count; how a
strategy cuts a piece into chunks does not change it. ``mfu`` divides the achieved FLOP/s per
device by the device's dense bf16 peak: ``logging.peak_tflops``, else the datasheet figure of a
known GPU (:data:`PEAK_TFLOPS`), else no ``mfu`` is logged.
"""

from __future__ import annotations

from typing import Optional, Sequence

from jvarlen.config import ModelConfig
from jvarlen.plan.coefficients import ModelShape

# dense bf16 TFLOP/s per device by a substring of its device kind, the more specific first (datasheets)
PEAK_TFLOPS = (
    ("H100 PCIE", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
)


def peak_tflops(device_kind: str, configured: float = 0.0) -> Optional[float]:
    """``configured`` where > 0, else the dense bf16 peak of ``device_kind`` (a JAX device's
    ``device_kind``) where :data:`PEAK_TFLOPS` knows it; None otherwise (a CPU, an unknown GPU)."""
    if configured > 0:
        return configured
    kind = device_kind.upper()
    return next((peak for name, peak in PEAK_TFLOPS if name in kind), None)


class StepFlops:
    """Per step: ``model_tflops`` (the step's model FLOPs / 1e12), ``tflops_per_device`` (achieved,
    over the step's own seconds and every device of the run) and ``mfu`` (that / the peak, where
    one is known)."""

    def __init__(self, model: ModelConfig, num_devices: int, peak: Optional[float]):
        shape = ModelShape.from_config(model)
        self.per_token = 3.0 * (shape.num_layers * shape.layer_linear_flops_per_token + shape.head_flops_per_token)
        self.per_square = 3.0 * shape.num_layers * shape.attention_flops_per_pair
        self.num_devices, self.peak = num_devices, peak
        self.total_flops = self.total_seconds = 0.0

    def model_flops(self, lengths: Sequence[int]) -> float:
        """Training FLOPs of attention sequences of these lengths (see the module docstring)."""
        return self.per_token * sum(lengths) + self.per_square * sum(n * n for n in lengths)

    def record(self, lengths: Sequence[int], step_seconds: float) -> dict:
        """The step's fields of the metrics record; the step counts towards :meth:`summary`."""
        flops = self.model_flops(lengths)
        self.total_flops += flops
        self.total_seconds += step_seconds
        return {"model_tflops": flops / 1e12, **self._rates(flops, step_seconds)}

    def _rates(self, flops: float, seconds: float) -> dict:
        per_device = flops / max(seconds, 1e-9) / self.num_devices / 1e12
        return {"tflops_per_device": per_device, **({} if self.peak is None else {"mfu": per_device / self.peak})}

    def summary(self) -> str:
        """The steps so far, in words: achieved TFLOP/s per device and the MFU where a peak is known."""
        if self.total_seconds <= 0:
            return ""
        rates = self._rates(self.total_flops, self.total_seconds)
        mfu = f", MFU {100 * rates['mfu']:.1f} %" if "mfu" in rates else ""
        return f"{rates['tflops_per_device']:.3g} model TFLOP/s per device{mfu}"
