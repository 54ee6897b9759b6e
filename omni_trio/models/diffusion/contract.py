"""The step contract between the ``diffusion`` backend and a denoising model.

The backend owns scheduling (which requests share a step, cancellation between steps,
previews); a model owns the numbers. A model turns a request into a state
(:meth:`DenoiseModel.prepare`: the prompt encoded, the seeded initial latents, its own
scheduler with its timesteps), advances a batch of states by one denoise step each
(:meth:`DenoiseModel.step`: one forward over every state's rows, classifier-free guidance
included), and decodes states to images (:meth:`DenoiseModel.decode`). A state belongs to
one request: a request's result depends only on its own request (its seed), never on which
other states shared its steps (up to float rounding).

Images are ``numpy.uint8`` arrays of shape ``(num_images, height, width, 3)`` (RGB): pixels,
so a downstream stage gets what it computes on and no stage spends its thread encoding a
file format; the edges (the CLI, the images endpoint) encode PNG.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["DenoiseModel", "ImageRequest", "image_request"]

#: what a request's sampling params may carry (diffusers' pipeline-call names)
SAMPLING_KEYS = (
    "num_inference_steps",
    "guidance_scale",
    "seed",
    "negative_prompt",
    "height",
    "width",
    "num_images_per_prompt",
)


@dataclass(frozen=True, slots=True)
class ImageRequest:
    """One image request, as a model prepares it."""

    prompt: str
    negative_prompt: str | None
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    seed: int | None
    num_images: int = 1

    @property
    def key(self) -> tuple[int, int, int, float, int]:
        """What requests sharing a step must have in common (resolution, steps, guidance,
        output count): their latents stack into one batch."""
        return (
            self.height,
            self.width,
            self.num_inference_steps,
            self.guidance_scale,
            self.num_images,
        )


def image_request(
    prompt: str, sampling_params: Mapping[str, object], *, default_size: tuple[int, int]
) -> ImageRequest:
    """A request from a prompt and its sampling params (``num_inference_steps`` 20,
    ``guidance_scale`` 7.5, ``seed`` none, ``negative_prompt`` none, ``height``/``width``
    the model's default size, ``num_images_per_prompt`` 1). Pure. Raises ValueError naming
    an unknown key or a bad value."""
    unknown = sorted(set(sampling_params) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(
            f"unknown sampling param(s) {unknown} for a diffusion stage; it takes "
            f"{list(SAMPLING_KEYS)}"
        )
    if not isinstance(prompt, str):
        raise ValueError(f"the prompt must be text, not {type(prompt).__name__}")

    def integer(name: str, default: int, low: int) -> int:
        value = sampling_params.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, not {value!r}")
        return value

    height = integer("height", default_size[0], 8)
    width = integer("width", default_size[1], 8)
    if height % 8 or width % 8:
        raise ValueError(f"height and width must be multiples of 8, not {height}x{width}")
    guidance = sampling_params.get("guidance_scale", 7.5)
    if not isinstance(guidance, (int, float)) or isinstance(guidance, bool) or guidance < 0:
        raise ValueError(f"guidance_scale must be a number >= 0, not {guidance!r}")
    seed = sampling_params.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ValueError(f"seed must be an integer >= 0, not {seed!r}")
    negative = sampling_params.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise ValueError(f"negative_prompt must be text, not {negative!r}")
    return ImageRequest(
        prompt=prompt,
        negative_prompt=negative,
        height=height,
        width=width,
        num_inference_steps=integer("num_inference_steps", 20, 1),
        guidance_scale=float(guidance),
        seed=seed,
        num_images=integer("num_images_per_prompt", 1, 1),
    )


class DenoiseModel(Protocol):
    """A denoising model, stepped by the ``diffusion`` backend. ``prepare``, ``step`` and
    ``decode`` block (the backend runs them in a worker thread unless ``inline``); they are
    never called concurrently on one model."""

    #: True: cheap calls the backend makes on trio's thread (a model-free scripted model)
    inline: bool
    #: (height, width) when a request names none
    default_size: tuple[int, int]

    def prepare(self, request: ImageRequest) -> Any:
        """A new state for ``request``: its prompt encoded, its seeded initial latents, its
        scheduler's timesteps. Raises ValueError for a request the model cannot take."""

    def step(self, states: Sequence[Any]) -> None:
        """Advance each state by one denoise step, in one batched forward. Every state has
        steps left and the same :attr:`ImageRequest.key`."""

    def steps_done(self, state: Any) -> int:
        """How many denoise steps ``state`` has taken."""

    def decode(self, states: Sequence[Any]) -> list[Any]:
        """Each state's current latents as images: ``numpy.uint8`` arrays of shape
        ``(num_images, height, width, 3)``. A state decoded before its last step is a
        preview."""

    def describe(self) -> Mapping[str, object]:
        """What the model is (for ``collective_rpc("describe")``)."""
