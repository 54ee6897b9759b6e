"""Diffusion models as the ``diffusion`` backend steps them.

- :mod:`~omni_trio.models.diffusion.contract`: the step contract (a request, a model's
  prepare / step / decode) and the request's sampling params;
- :mod:`~omni_trio.models.diffusion.scripted`: a model-free model for deterministic tests;
- :mod:`~omni_trio.models.diffusion.diffusers_model`: the contract on a diffusers
  text-to-image pipeline (UNet), and loading one from a stage's options;
- :mod:`~omni_trio.models.diffusion.tiny`: the ``tiny:diffusion`` preset, a tiny seeded
  Stable-Diffusion-shaped pipeline built locally;
- :mod:`~omni_trio.models.diffusion.handoff`: the input processor of a diffusion stage behind
  an LLM stage (the user's prompt or the LLM's text).
"""
