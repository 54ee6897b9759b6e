"""``--model DIR`` of ``omni-trio run`` and ``serve``: a pipeline's model, swapped for a
checkpoint directory.

A pipeline's model is the model reference of its first stage that names one: a ``vllm``
stage's ``engine_args.model``, a ``talker``, ``torch`` or ``diffusion`` stage's
``options.model``. Every
stage naming that same reference (``qwen3-omni``: the thinker, the talker and code2wav all
load ``tiny:qwen3-omni``) is pointed at DIR instead, a ``vllm`` stage's
``engine_args.tokenizer`` too when it names the reference; stages naming another model, and
other backends, are left alone. The functions here are pure but :func:`check_model_dir`,
which looks at the directory (so a wrong path fails before any engine starts), and
:func:`load_config_with_model`, which loads the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .args import UsageError, load_config_arg
from .runner import config_source

if TYPE_CHECKING:
    from ..config.pipeline import PipelineConfig

__all__ = [
    "MODEL_KEYS",
    "check_model_dir",
    "load_config_with_model",
    "model_overrides",
    "pipeline_model",
]

#: where each backend's stages name their model: (section, key)
MODEL_KEYS: dict[str, tuple[str, str]] = {
    "vllm": ("engine_args", "model"),
    "talker": ("options", "model"),
    "torch": ("options", "model"),
    "diffusion": ("options", "model"),
}
#: what makes a directory a model: a checkpoint's config, a diffusers pipeline's index
MODEL_FILES = ("config.json", "model_index.json")


def _model_of(stage: object) -> str | None:
    if not isinstance(stage, Mapping):
        return None
    where = MODEL_KEYS.get(str(stage.get("backend", "scripted")))
    if where is None:
        return None
    section = stage.get(where[0])
    model = section.get(where[1]) if isinstance(section, Mapping) else None
    return model if isinstance(model, str) else None


def _stages(config: Mapping[str, object]) -> list[object]:
    stages = config.get("stages")
    return list(stages) if isinstance(stages, list) else []


def pipeline_model(config: Mapping[str, object]) -> str:
    """The model reference of the first stage naming one (see the module docstring). Pure.
    Raises UsageError when no stage names a model."""
    for stage in _stages(config):
        model = _model_of(stage)
        if model is not None:
            return model
    name = config.get("name", "the pipeline")
    raise UsageError(
        f"--model: pipeline {name!r} has no stage naming a model (engine_args.model of a "
        "vllm stage, options.model of a talker, torch or diffusion stage): nothing to point "
        "at DIR"
    )


def model_overrides(config: Mapping[str, object], model_dir: str) -> dict[str, object]:
    """``stage_overrides`` (stage id -> the keys to replace) that point every stage naming
    the pipeline's model at ``model_dir`` (for :func:`omni_trio.config.load_config`). Pure.
    Raises UsageError when no stage names a model."""
    reference = pipeline_model(config)
    overrides: dict[str, object] = {}
    for stage in _stages(config):
        if _model_of(stage) != reference:
            continue
        assert isinstance(stage, Mapping)
        section, key = MODEL_KEYS[str(stage.get("backend", "scripted"))]
        changed = {key: model_dir}
        current = stage.get(section)
        if section == "engine_args" and isinstance(current, Mapping):
            if current.get("tokenizer") == reference:
                changed["tokenizer"] = model_dir
        overrides[str(stage.get("id"))] = {section: changed}
    return overrides


def check_model_dir(path: str) -> str:
    """``path`` as an absolute directory path, once it is a model checkpoint directory (a
    directory with a ``config.json``, or a diffusers pipeline's ``model_index.json``).
    Reads the file system. Raises UsageError naming the
    path and what is missing."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"--model {path}: no such directory")
    if not p.is_dir():
        raise UsageError(f"--model {path}: not a directory (a checkpoint directory is)")
    if not any((p / name).is_file() for name in MODEL_FILES):
        raise UsageError(
            f"--model {path}: not a model checkpoint directory (it has no config.json, nor "
            "the model_index.json of a diffusers pipeline)"
        )
    return str(p.resolve())


def load_config_with_model(arg: str, model: str | None) -> PipelineConfig:
    """The config a CONFIG argument names (:func:`~omni_trio.cli.args.load_config_arg`),
    with every stage naming the pipeline's model pointed at the checkpoint directory
    ``model`` (``--model DIR``; None: the config as it is). Blocking (reads the files,
    imports what the config names). Raises UsageError for a ``model`` that is no checkpoint
    directory or a pipeline naming no model, ConfigError naming the file."""
    from ..config.loading import load_config
    from ..config.reading import read_config_file

    if model is None:
        return load_config_arg(arg)
    model_dir = check_model_dir(model)
    source = config_source(arg)
    raw = source if isinstance(source, Mapping) else read_config_file(Path(source))
    if not isinstance(raw, Mapping):
        return load_config(source)  # not a mapping: load_config says so, naming the file
    return load_config(source, stage_overrides=model_overrides(raw, model_dir))
