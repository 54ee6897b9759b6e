"""Diffusion models as the ``diffusion`` backend steps them.

- :mod:`~omni_trio.models.diffusion.contract`: the step contract (a request, a model's
  prepare / step / decode) and the request's sampling params;
- :mod:`~omni_trio.models.diffusion.scripted`: a model-free model for deterministic tests;
- :mod:`~omni_trio.models.diffusion.handoff`: the input processor of a diffusion stage behind
  an LLM stage (the user's prompt or the LLM's text).
"""
