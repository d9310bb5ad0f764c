"""wingspan: multi-layer EAGLE-3 draft models for any Hugging Face causal LM."""

__version__ = "0.1.0"
