"""Pipeline configs shipped inside the package.

``tiny-omni`` is the default: a tiny thinker LLM and talker LLM on real vLLM engines, then the
tiny torch vocoder, all built locally on first use. ``tiny-omni-scripted`` has the same graph
with scripted (model-free) thinker and talker stages, for fast tests and demos without vLLM.
``qwen3-omni`` and ``qwen2.5-omni`` are the Qwen-Omni families' stages. ``tiny-image`` is one
diffusion stage (text to image), ``tiny-llm-image`` an LLM stage whose text a diffusion stage
renders. ``tiny-pd`` is the tiny thinker LLM split into a prefill and a decode engine that
hand the prompt's KV cache over through vLLM's ``ExampleConnector``. Pass a path from here to
``omni_trio.open_engine`` or ``load_config``.

:mod:`~omni_trio.pipelines.diffusers_dir` makes the one-stage pipeline of a diffusers
pipeline directory (``omni-trio serve DIR``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..errors import ConfigError

__all__ = ["DEFAULT_PIPELINE", "PIPELINES", "default_pipeline_path", "pipeline_path"]

#: names of the shipped pipeline configs (``<name>.yaml`` in this package)
PIPELINES: tuple[str, ...] = (
    "tiny-omni",
    "tiny-omni-scripted",
    "qwen3-omni",
    "qwen2.5-omni",
    "tiny-image",
    "tiny-llm-image",
    "tiny-pd",
)
DEFAULT_PIPELINE = "tiny-omni"


def pipeline_path(name: str) -> Path:
    """The file of shipped pipeline ``name``. Pure (no checkpoint); raises
    :class:`ConfigError` for a name not in :data:`PIPELINES`."""
    if name not in PIPELINES:
        raise ConfigError(f"no shipped pipeline {name!r}; shipped pipelines are {list(PIPELINES)}")
    # The package is installed as plain files (setuptools package-data), so the resource
    # is a real path that stays valid after this call.
    return Path(str(resources.files(__package__).joinpath(f"{name}.yaml")))


def default_pipeline_path() -> Path:
    """The file of the default embedded pipeline (``tiny-omni``)."""
    return pipeline_path(DEFAULT_PIPELINE)
