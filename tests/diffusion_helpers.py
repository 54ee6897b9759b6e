"""Test helpers for the diffusion edges (the command line's PNGs, ``POST
/v1/images/generations``, the LLM -> image route): pipelines of ``backend: diffusion`` stages
on ``model: scripted`` (the model-free step model), the pixels that model makes, and a stage
that breaks the image stage contract.

The image stage contract (the issue's note on diffusion stages): outputs of ``output_type:
image`` whose ``data`` is a ``numpy.uint8`` array ``(num_images, height, width, 3)``,
non-final previews with metrics ``{"preview": True, "step": k}``, the final images
``finished=True``. :func:`scripted_images` is what the scripted model emits after ``steps``
steps, computed with the model itself, so a test compares the pixels an edge wrote with the
pixels a request with those sampling params must make: every param that reaches the stage
changes them.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
import trio

from omni_trio import StageOutput, load_config
from omni_trio.config import PipelineConfig
from omni_trio.models.diffusion.contract import image_request
from omni_trio.models.diffusion.scripted import ScriptedDenoise
from omni_trio.stages import StageBackend, collect_input

HANDOFF = "omni_trio.models.diffusion.handoff:image_prompt"
NOT_IMAGES = "tests.diffusion_helpers:NotImages"
#: the scripted model's (height, width) when a request names none
SIZE = ScriptedDenoise.default_size
#: the test pipelines' image stage defaults
DEFAULTS: dict[str, object] = {"num_inference_steps": 4, "guidance_scale": 7.5}

needs_tiny_diffusion = pytest.mark.skipif(
    importlib.util.find_spec("omni_trio.models.diffusion.diffusers_model") is None,
    reason="the tiny:diffusion model (omni_trio.models.diffusion.diffusers_model) is not here",
)


def scripted_images(prompt: str, *, steps: int | None = None, **params: object) -> np.ndarray:
    """The images the scripted model makes of ``prompt`` with sampling ``params`` (over
    :data:`DEFAULTS`; a ``seed`` is needed for a repeatable image) after ``steps`` denoise
    steps (default: all of them). Pure."""
    request = image_request(prompt, {**DEFAULTS, **params}, default_size=SIZE)
    model = ScriptedDenoise()
    state = model.prepare(request)
    for _ in range(request.num_inference_steps if steps is None else steps):
        model.step([state])
    (images,) = model.decode([state])
    return np.asarray(images)


def image_stage(**options: object) -> dict[str, object]:
    """A diffusion stage ``image`` on the scripted model (``options`` over it)."""
    return {
        "id": "image",
        "backend": "diffusion",
        "options": {"model": "scripted", **options},
        "output_type": "image",
        "final_output": True,
        "default_sampling_params": dict(DEFAULTS),
    }


def image_pipeline(name: str = "images", **options: object) -> PipelineConfig:
    """``tiny-image``'s shape on the scripted model."""
    return load_config({"name": name, "stages": [image_stage(**options)]})


def text_to_image_pipeline(
    prompt_source: str = "original",
    *,
    text_outputs: int = 3,
    name: str = "text-image",
    **options: object,
) -> PipelineConfig:
    """``tiny-llm-image``'s shape: a scripted text stage ``llm`` (``text_outputs`` outputs),
    then the scripted diffusion stage behind the diffusion handoff with ``prompt_source``."""
    llm = {
        "id": "llm",
        "backend": "scripted",
        "options": {"outputs": text_outputs},
        "output_type": "text",
        "final_output": True,
    }
    image = {
        **image_stage(**options),
        "inputs": ["llm"],
        "input_processor": HANDOFF,
        "processor_options": {"prompt_source": prompt_source},
    }
    return load_config({"name": name, "stages": [llm, image]})


def not_images_pipeline() -> PipelineConfig:
    """One image stage that emits text as its ``data``: a stage breaking the contract."""
    stage = {"id": "image", "backend": NOT_IMAGES, "output_type": "image", "final_output": True}
    return load_config({"name": "images", "stages": [stage]})


class NotImages(StageBackend):
    """An ``output_type: image`` stage whose final output's data is a string."""

    async def _start(self) -> None:
        await trio.lowlevel.checkpoint()

    async def _stop(self) -> None:
        await trio.lowlevel.checkpoint()

    async def _run(self, request_id: str, inputs: Any, sampling_params: Any, emit: Any) -> None:
        chunk = await collect_input(inputs)
        await emit(StageOutput(data=f"an image of {chunk.prompt}", finished=True))


async def describe(engine: Any, stage: str = "image") -> dict[str, Any]:
    """The diffusion stage's ``describe`` (requests running and waiting, images made...)."""
    (answer,) = await engine.collective_rpc("describe", stage_ids=[stage])
    assert isinstance(answer, dict)
    return answer
