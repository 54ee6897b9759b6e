"""A diffusers pipeline directory as a one-stage pipeline (vLLM-Omni's
``_create_default_diffusion_stage_cfg``): ``omni-trio serve DIR`` and ``omni-trio run DIR
PROMPT`` where DIR holds a ``model_index.json``.

The stage is a ``diffusion`` stage loading DIR (``options.model``), stepped with the
backend's default options (``execution: step``), its images the pipeline's answer. For more
(offload flags, a batch size, previews, a dtype) write a pipeline file: the stage below is
its starting point. :func:`is_diffusers_dir` reads the file system; the rest is pure.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "DEFAULT_IMAGE_SAMPLING",
    "DIFFUSION_STAGE_ID",
    "MODEL_INDEX",
    "diffusion_pipeline",
    "is_diffusers_dir",
]

#: the file that makes a directory a diffusers pipeline
MODEL_INDEX = "model_index.json"
#: the id of the default diffusion stage
DIFFUSION_STAGE_ID = "image"
#: the default stage's sampling params (diffusers' pipeline-call names; a request's own
#: sampling params are merged over them)
DEFAULT_IMAGE_SAMPLING: dict[str, object] = {"num_inference_steps": 20, "guidance_scale": 7.5}


def is_diffusers_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a diffusers pipeline (a ``model_index.json``).
    Reads the file system; a path that cannot be read is not one."""
    try:
        return (Path(path).expanduser() / MODEL_INDEX).is_file()
    except OSError:
        return False


def diffusion_pipeline(model_dir: str, *, name: str | None = None) -> dict[str, object]:
    """The config (a mapping for :func:`omni_trio.load_config`) of a pipeline of one
    ``diffusion`` stage loading ``model_dir``: stage id ``image``, ``output_type: image``,
    ``final_output``, :data:`DEFAULT_IMAGE_SAMPLING`. Its ``name`` (the served model id)
    defaults to the directory's name. Pure: ``model_dir`` is used as given (pass an
    absolute path: the stage loads it wherever the engine runs)."""
    return {
        "name": name or Path(model_dir).name or "diffusion",
        "stages": [
            {
                "id": DIFFUSION_STAGE_ID,
                "backend": "diffusion",
                "options": {"model": model_dir},
                "output_type": "image",
                "final_output": True,
                "default_sampling_params": dict(DEFAULT_IMAGE_SAMPLING),
            }
        ],
    }
