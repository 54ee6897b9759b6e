"""A test helper: a model-free image stage that emits what a ``diffusion`` stage emits.

The edges (the command line's PNGs, ``POST /v1/images/generations``, the LLM -> image
route's input processor) consume the image stage output contract (the issue's note on
diffusion stages): outputs of ``output_type: image`` whose ``data`` is a ``numpy.uint8``
array ``(num_images, height, width, 3)``, non-final previews with metrics ``{"preview":
True, "step": k}`` every ``preview_every`` steps, the final images ``finished=True``,
``finish_reason="stop"``, metrics ``{"steps": n, "compute_s": ...}``. :class:`ImageStandIn`
is such a stage, on the trio clock: it reads the request's sampling params as the
``diffusion`` backend does (``omni_trio.models.diffusion.contract.image_request``: a bad one
is an InvalidRequestError), takes ``step_s`` per denoise step, and its pixels are a pure
function of (prompt, seed, step, image index): :func:`expected_images`.

Its pipelines (:func:`image_pipeline`, :func:`text_to_image_pipeline`) have the shape of
the shipped ``tiny-image`` and ``tiny-llm-image`` with this stage in place of the
``diffusion`` backend; :data:`needs_diffusion_backend` marks the tests that load the shipped
ones, which need that backend registered.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
import numpy as np
import pytest
import trio

from omni_trio import InvalidRequestError, StageConfig, StageError, StageOutput, load_config
from omni_trio.config import BUILTIN_BACKENDS, PipelineConfig
from omni_trio.config.options import parse_options
from omni_trio.models.diffusion.contract import image_request
from omni_trio.stages import StageBackend, collect_input

STANDIN = "tests.image_standin:ImageStandIn"
HANDOFF = "omni_trio.models.diffusion.handoff:image_prompt"
#: the default (height, width) of the stand-in's images
SIZE = (16, 24)

needs_diffusion_backend = pytest.mark.skipif(
    "diffusion" not in BUILTIN_BACKENDS,
    reason="the shipped image pipelines need the diffusion backend registered",
)


def expected_images(
    prompt: str, *, seed: int | None = None, step: int, height: int, width: int, n: int = 1
) -> np.ndarray:
    """The pixels :class:`ImageStandIn` emits after ``step`` steps. Pure."""
    images = [
        np.random.default_rng([seed or 0, zlib.crc32(prompt.encode()), step, i]).integers(
            0, 256, (height, width, 3), dtype=np.uint8
        )
        for i in range(n)
    ]
    return np.stack(images)


class ImageStandIn(StageBackend):
    """The image stage of these tests (see the module docstring). Records per request the
    prompt and sampling params it ran with (``ran``), and which requests finished
    (``completed``) or were cancelled (``aborted``)."""

    backend_name = "image-stand-in"

    class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        #: trio-clock seconds per denoise step
        step_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
        #: a preview every N steps (0: none)
        preview_every: Annotated[int, msgspec.Meta(ge=0)] = 0
        #: fail the request (StageError) at this step
        fail_at_step: int | None = None
        #: emit this instead of images (a stage that breaks the contract)
        bad_data: str | None = None

    def __init__(self, config: StageConfig, *, stage_index: int, replica: int = 0) -> None:
        super().__init__(config, stage_index=stage_index, replica=replica)
        where = f"$.stages[{stage_index}].options"
        self.options = parse_options(self.Options, config.options, where=where, backend="stand-in")
        self.ran: dict[str, tuple[str, dict[str, Any]]] = {}
        self.completed: list[str] = []
        self.aborted: list[str] = []

    async def _start(self) -> None:
        await trio.lowlevel.checkpoint()

    async def _stop(self) -> None:
        await trio.lowlevel.checkpoint()

    async def _run(self, request_id: str, inputs: Any, sampling_params: Any, emit: Any) -> None:
        chunk = await collect_input(inputs)
        params = dict(sampling_params) if isinstance(sampling_params, Mapping) else {}
        try:
            req = image_request(chunk.prompt or "", params, default_size=SIZE)
        except ValueError as exc:
            raise InvalidRequestError(f"stage {self.stage_id!r}: {exc}") from exc
        self.ran[request_id] = (req.prompt, params)
        opts = self.options

        def pixels(step: int) -> object:
            if opts.bad_data is not None:
                return opts.bad_data
            return expected_images(
                req.prompt,
                seed=req.seed,
                step=step,
                height=req.height,
                width=req.width,
                n=req.num_images,
            )

        steps = req.num_inference_steps
        try:
            for step in range(1, steps + 1):
                await trio.sleep(opts.step_s)
                if opts.fail_at_step == step:
                    raise StageError(f"stand-in failed at step {step}", stage_id=self.stage_id)
                if opts.preview_every and step % opts.preview_every == 0 and step < steps:
                    await emit(
                        StageOutput(data=pixels(step), metrics={"preview": True, "step": step})
                    )
            await emit(
                StageOutput(
                    data=pixels(steps),
                    finished=True,
                    finish_reason="stop",
                    metrics={"steps": steps, "compute_s": 0.0},
                )
            )
        except trio.Cancelled:
            self.aborted.append(request_id)
            raise
        self.completed.append(request_id)


def image_pipeline(name: str = "images", **options: object) -> PipelineConfig:
    """``tiny-image``'s shape: one image stage (the stand-in, ``options``)."""
    stage = {
        "id": "image",
        "backend": STANDIN,
        "options": options,
        "output_type": "image",
        "final_output": True,
        "default_sampling_params": {"num_inference_steps": 4, "guidance_scale": 7.5},
    }
    return load_config({"name": name, "stages": [stage]})


def text_to_image_pipeline(
    prompt_source: str = "original",
    *,
    text_outputs: int = 3,
    name: str = "text-image",
    **options: object,
) -> PipelineConfig:
    """``tiny-llm-image``'s shape: a scripted text stage ``llm`` (``text_outputs`` outputs),
    then the stand-in image stage behind the diffusion handoff with ``prompt_source``."""
    return load_config(
        {
            "name": name,
            "stages": [
                {
                    "id": "llm",
                    "backend": "scripted",
                    "options": {"outputs": text_outputs},
                    "output_type": "text",
                    "final_output": True,
                },
                {
                    "id": "image",
                    "backend": STANDIN,
                    "inputs": ["llm"],
                    "input_processor": HANDOFF,
                    "processor_options": {"prompt_source": prompt_source},
                    "options": options,
                    "output_type": "image",
                    "final_output": True,
                    "default_sampling_params": {"num_inference_steps": 4},
                },
            ],
        }
    )


def standins(engine: Any, stage: str = "image") -> list[ImageStandIn]:
    """The stand-in replicas of ``stage``."""
    replicas = list(engine.pools[stage].replicas)
    assert all(isinstance(r, ImageStandIn) for r in replicas)
    return replicas
