"""The loop tests' tiny decoder as command-line flags: 2 layers of width 32, fp32 compute; the
attention is the config's default unless REFERENCE_ATTENTION is added. Constants only, so that a
test module run as a worker script (tests/test_multihost.py) can import them without conftest's
device flags."""

TINY_MODEL_ARGS = [
    "--model.vocab_size=320",
    "--model.d_model=32",
    "--model.num_layers=2",
    "--model.num_heads=4",
    "--model.num_kv_heads=2",
    "--model.mlp_dim=64",
    "--model.compute_dtype=float32",
]
REFERENCE_ATTENTION = "--model.attention=reference"
