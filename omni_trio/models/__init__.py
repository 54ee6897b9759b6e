"""Local models for demos, tests and benchmarks (no model hub).

Importing this package is light: the builders import torch/transformers only when they run.

- :mod:`~omni_trio.models.tiny`: tiny random-weight Llama models with a trained BPE
  tokenizer, built into a local cache;
- :mod:`~omni_trio.models.vocoder`: a tiny seeded vocoder (talker codes to 16 kHz audio);
- :mod:`~omni_trio.models.progress`: where the builders report their steps;
- :mod:`~omni_trio.models.building`: what the builders share (corpus, quiet saving);
- :mod:`~omni_trio.models.qwen_omni`: the Qwen-Omni family (tiny presets, the talker and
  code2wav that the `talker` and `torch` backends run);
- :mod:`~omni_trio.models.diffusion`: diffusion models stepped by the ``diffusion`` backend.
"""

from __future__ import annotations

from .tiny import TINY_PRESETS, TinySpec, ensure_tiny_model, model_fingerprint, resolve_model

__all__ = ["TINY_PRESETS", "TinySpec", "ensure_tiny_model", "model_fingerprint", "resolve_model"]
