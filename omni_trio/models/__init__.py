"""Local models for demos, tests and benchmarks (no model hub).

Importing this package is light: the builders import torch/transformers only when they run.
``tiny`` builds tiny random-weight Llama models with a trained BPE tokenizer.
"""

from __future__ import annotations

from .tiny import TINY_PRESETS, TinySpec, ensure_tiny_model, model_fingerprint, resolve_model

__all__ = ["TINY_PRESETS", "TinySpec", "ensure_tiny_model", "model_fingerprint", "resolve_model"]
