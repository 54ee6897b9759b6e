"""A model-free :class:`~omni_trio.models.diffusion.contract.DenoiseModel` for deterministic
tests (``model: scripted`` on a ``diffusion`` stage).

It keeps the contract's shape and semantics with arithmetic instead of networks: a request's
latents start as seeded noise (``numpy.random.default_rng(seed)``), each step moves them a
fixed fraction towards a target made from the prompt (and, with guidance, away from the
negative prompt), and decoding maps latents to pixels. Rows never mix, so a request's image
is the same alone or in any batch, bit for bit. ``inline``: the backend calls it on trio's
thread, so a test under ``MockClock`` stays deterministic (the stage option
``scripted_step_s`` makes each step take trio-clock time). ``fail_at_step`` makes the step
that would be a request's ``fail_at_step``-th (counting from 1) raise.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .contract import ImageRequest

__all__ = ["ScriptedDenoise"]

#: latent channels and the pixel size of one latent cell (as Stable Diffusion's VAE)
CHANNELS = 4
CELL = 8


def _prompt_vector(text: str | None) -> Any:
    digest = hashlib.sha256((text or "").encode("utf-8")).digest()
    return np.frombuffer(digest[:CHANNELS], dtype=np.uint8).astype(np.float32) / 64.0 - 2.0


class _State:
    __slots__ = ("latents", "request", "steps", "target")

    def __init__(self, request: ImageRequest, latents: Any, target: Any) -> None:
        self.request = request
        self.latents = latents
        self.target = target
        self.steps = 0


class ScriptedDenoise:
    """See the module docstring."""

    inline = True
    default_size = (32, 32)

    def __init__(self, *, fail_at_step: int | None = None) -> None:
        self.fail_at_step = fail_at_step
        self.steps_run = 0  # denoise steps taken, over every request
        self.states_made = 0

    def prepare(self, request: ImageRequest) -> _State:
        seed = secrets.randbits(63) if request.seed is None else request.seed
        shape = (request.num_images, request.height // CELL, request.width // CELL, CHANNELS)
        latents = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
        cond = _prompt_vector(request.prompt)
        target = cond
        if request.guidance_scale > 1:
            uncond = _prompt_vector(request.negative_prompt)
            target = uncond + request.guidance_scale * (cond - uncond) / 4.0
        self.states_made += 1
        return _State(request, latents, target)

    def step(self, states: Sequence[_State]) -> None:
        for state in states:
            if state.steps >= state.request.num_inference_steps:
                raise ValueError("a state with no step left was stepped")
            if self.fail_at_step is not None and state.steps + 1 == self.fail_at_step:
                raise RuntimeError(f"scripted failure at step {self.fail_at_step}")
        for state in states:
            state.latents = state.latents * 0.75 + state.target * 0.25
            state.steps += 1
        self.steps_run += 1

    def steps_done(self, state: _State) -> int:
        return state.steps

    def decode(self, states: Sequence[_State]) -> list[Any]:
        images = []
        for state in states:
            pixels = (np.tanh(state.latents[..., :3]) + 1.0) * 127.5
            pixels = np.repeat(np.repeat(pixels, CELL, axis=1), CELL, axis=2)
            images.append(np.clip(np.rint(pixels), 0, 255).astype(np.uint8))
        return images

    def describe(self) -> Mapping[str, object]:
        return {
            "model": "scripted",
            "default_size": list(self.default_size),
            "steps_run": self.steps_run,
            "states_made": self.states_made,
        }

    def __repr__(self) -> str:
        return f"<ScriptedDenoise steps_run={self.steps_run} states_made={self.states_made}>"
