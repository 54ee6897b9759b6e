"""The built-in stage backends, each an implementation of the contract in
:mod:`omni_trio.stages` (configs name them by name: ``config.backends`` lists them):

- :mod:`~omni_trio.backends.scripted`: a deterministic, model-free stage that behaves like a
  real one (what the fast tests and the demos run);
- :mod:`omni_trio.backends.vllm`: one real vLLM ``AsyncLLM`` per replica, in a worker thread;
- :mod:`omni_trio.backends.torch`: a torch module (a vocoder, a decoder) with dynamic batching;
- :mod:`omni_trio.backends.talker`: a Qwen-Omni talker decoded step by step in worker threads;
- :mod:`omni_trio.backends.diffusion`: a denoising model (text to image), batched by step and
  cancelled between steps;
- :mod:`omni_trio.backends.ray`: any of the others, placed in a Ray actor.

A backend imports the contract (:mod:`omni_trio.stages`), the floor below it and the
transport; never another backend, the request core or the engine. ``vllm``, ``torch`` and
``ray`` are imported only here (and by the config's vLLM field list), on first use.
"""
