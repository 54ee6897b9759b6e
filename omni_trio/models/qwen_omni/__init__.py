"""The Qwen-Omni family (Qwen3-Omni): tiny presets and the parts that run as stages.

The thinker runs on the ``vllm`` backend (vLLM serves Qwen-Omni thinkers); this package holds
what vLLM does not: the talker and the vocoder, loaded from the same checkpoint.

- :mod:`~omni_trio.models.qwen_omni.qwen3`: the ``tiny:qwen3-omni`` preset's recipe (the whole
  architecture shrunk, seeded weights, a checked forward pass);
- :mod:`~omni_trio.models.qwen_omni.tokenizer`: tiny tokenizers with the family's special
  tokens;
- :mod:`~omni_trio.models.qwen_omni.checkpoint`: loading one part of a checkpoint (the talker,
  the vocoder) without the rest;
- :mod:`~omni_trio.models.qwen_omni.handoff`: the input processor from the thinker stage to
  the talker stage (token ids only);
- :mod:`~omni_trio.models.qwen_omni.talker`: the talker, one decode step (one 16-code frame) at
  a time, as the ``talker`` backend runs it;
- :mod:`~omni_trio.models.qwen_omni.code2wav`: code2wav as a ``torch`` backend module
  (16-code frames in, 24 kHz audio out, streamed with left context).

Importing this package is light: torch and transformers are imported when a part is built or
loaded (:mod:`~omni_trio.models.qwen_omni.code2wav` imports torch, as the torch backend's
modules do).
"""
