"""jvarlen: training LLMs on variable-length, long-context corpora with JAX."""

__version__ = "0.1.0"
