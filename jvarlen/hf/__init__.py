"""Hugging Face Llama-family checkpoints in and out.

* :mod:`jvarlen.hf.hf_config`: config.json <-> jvarlen's model fields; supported architectures
  and RoPE rules (pure Python; ``model.init_from`` reads it while the config is parsed).
* :mod:`jvarlen.hf.weights`: which HF tensor each parameter is and how its layout differs.
* :mod:`jvarlen.hf.safetensors_dir`: reading blocks of memory-mapped tensors, writing shards.
* :mod:`jvarlen.hf.load`: the streaming import into the canonical sharding (JAX).
* :mod:`jvarlen.hf.export`: a run's checkpoint -> a Hugging Face directory
  (``python -m jvarlen.export``).

This package imports no JAX itself: the config path must not start JAX before the train entry
point has set up the host devices. See docs/design/hf-interop.md.
"""

from jvarlen.hf.hf_config import ARCHITECTURES, ROPE_RULES, HFCheckpointError, hf_config_dict, read_model_fields

__all__ = ["ARCHITECTURES", "ROPE_RULES", "HFCheckpointError", "hf_config_dict", "read_model_fields"]
