"""The ``diffusion`` backend: denoising models as stages, batched by step.

- :mod:`~omni_trio.backends.diffusion.backend`: the stage backend (modes, cancellation
  between steps, previews);
- :mod:`~omni_trio.backends.diffusion.scheduling`: which requests a tick admits and steps
  (pure functions).
"""
