"""The Qwen-Omni family (Qwen3-Omni, Qwen2.5-Omni): tiny presets and the parts that run as
stages.

The thinker runs on the ``vllm`` backend (vLLM serves Qwen-Omni thinkers); this package holds
what vLLM does not: the talker and the vocoder, loaded from the same checkpoint.

- :mod:`~omni_trio.models.qwen_omni.qwen3`: the ``tiny:qwen3-omni`` preset's recipe (the whole
  architecture shrunk, seeded weights, a checked forward pass);
- :mod:`~omni_trio.models.qwen_omni.qwen25`: the ``tiny:qwen2.5-omni`` preset's recipe (the
  whole architecture shrunk, seeded weights and voices, a checked forward pass);
- :mod:`~omni_trio.models.qwen_omni.recipe`: the build both recipes share (tokenizer, config,
  seeded init, forward check, save);
- :mod:`~omni_trio.models.qwen_omni.tokenizer`: tiny tokenizers with the family's special
  tokens;
- :mod:`~omni_trio.models.qwen_omni.checkpoint`: loading one part of a checkpoint (the talker,
  the vocoder) without the rest;
- :mod:`~omni_trio.models.qwen_omni.handoff`: the input processor from the thinker stage to
  the talker stage (token ids only);
- :mod:`~omni_trio.models.qwen_omni.talker`: the Qwen3-Omni talker, one decode step (one
  16-code frame) at a time, as the ``talker`` backend runs it, and ``load_talker`` (a
  checkpoint's talker, for its family);
- :mod:`~omni_trio.models.qwen_omni.sampling`: how a talker picks its codes (a request's
  sampling params, generate()'s logits processors);
- :mod:`~omni_trio.models.qwen_omni.qwen25_talker`: the Qwen2.5-Omni talker, one code per
  decode step, with the thinker's hidden states recomputed in the talker stage;
- :mod:`~omni_trio.models.qwen_omni.code2wav`: code2wav as a ``torch`` backend module
  (16-code frames in, 24 kHz audio out, streamed with left context);
- :mod:`~omni_trio.models.qwen_omni.token2wav`: Qwen2.5-Omni's token2wav as a ``torch``
  backend module (a whole utterance of codes in, 24 kHz audio out, seeded noise).

Importing this package is light: torch and transformers are imported when a part is built or
loaded (:mod:`~omni_trio.models.qwen_omni.code2wav` and
:mod:`~omni_trio.models.qwen_omni.token2wav` import torch, as the torch backend's modules do).
"""
