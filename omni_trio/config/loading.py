"""Loading a pipeline config, with overrides, into a checked ``PipelineConfig``.

A config comes from a YAML, TOML or JSON file, a dict, or is built directly (then each
struct's keys, types and ranges are checked when it is built: ``PipelineConfig(stages="x")``
raises :class:`~omni_trio.errors.ConfigError` naming ``$.stages``). Loading checks
everything that can be known without starting an engine: unknown keys, types and ranges,
the stage graph, every backend's ``options`` (:mod:`omni_trio.config.options`), the dotted
paths it names (imported; a backend path must name a backend factory), torch weights
files, and vllm ``engine_args`` and
``default_sampling_params`` when vllm is installed. Every error is a
:class:`~omni_trio.errors.ConfigError` naming the file and the JSON path of the offending
value, e.g. ``tiny.yaml: $.stages[1].inputs[0]: unknown input stage 'x'``.

A loaded :class:`PipelineConfig` is treated as immutable: its graph (index maps, topological
order) is computed once and cached on it. To change one, ``load_config(cfg, **overrides)``
returns a new one.

This module holds the loading (:func:`load_config`: reading, overrides, conversion); the
parts live in their own modules (see :mod:`omni_trio.config`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import msgspec

from ..errors import ConfigError
from .checks import validate
from .graph import some_ids
from .pipeline import PipelineConfig
from .reading import (
    Value,
    check_tree,
    explain_validation_error,
    json_object,
    prechecked,
    read_config_file,
)
from .stage import MAX_REPLICAS, MAX_SLOTS

__all__ = ["load_config"]

_BOUND_HINTS = {
    "replicas": f" (a stage has 1 to MAX_REPLICAS = {MAX_REPLICAS} replicas; run more as "
    "separate pipelines)",
    "max_requests_in_flight": f" (1 to {MAX_SLOTS:,})",
    "output_buffer": f" (1 to {MAX_SLOTS:,})",
}
# Keys of vLLM-Omni's config layout that have a different home here.
_LEGACY_KEYS = {
    "stage_configs_path": "pass the pipeline file itself as `config` (open_engine(path) or "
    "`omni-trio run PATH`); stages are listed under `stages:`",
    "stage_configs": "list the stages under `stages:` in the pipeline config",
}


def _parse_overrides(value: Value, source: str) -> dict[str, dict[str, Value]]:
    if isinstance(value, str):
        try:
            value = json.loads(value, object_pairs_hook=json_object)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ConfigError(
                f"stage_overrides must be JSON (an object keyed by stage id): {exc}",
                path="$.stage_overrides",
                source=source,
            ) from exc
    check_tree({"stage_overrides": value}, source)
    if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
        raise ConfigError(
            "stage_overrides must map stage ids to objects of stage keys",
            path="$.stage_overrides",
            source=source,
        )
    return {str(k): dict(v) for k, v in value.items()}


def _deep_merge(base: dict[str, Value], extra: Mapping[str, Value]) -> dict[str, Value]:
    out = dict(base)
    for k, v in extra.items():
        current = out.get(k)
        if isinstance(v, Mapping) and isinstance(current, Mapping):
            out[k] = _deep_merge(dict(current), v)
        else:
            out[k] = v
    return out


def _as_data(cfg: PipelineConfig) -> dict[str, Value]:
    # not msgspec.to_builtins: a config built in Python may hold callables (a torch factory)
    data = msgspec.structs.asdict(cfg)
    # placement as plain data, so that stage_overrides deep-merge into it
    data["stages"] = [
        {**msgspec.structs.asdict(s), "placement": msgspec.to_builtins(s.placement)}
        for s in cfg.stages
    ]
    data.pop("source", None)
    return data


def load_config(
    config: PipelineConfig | Mapping[str, Value] | str | os.PathLike[str],
    /,
    *,
    check_vllm: bool = True,
    **overrides: Value,
) -> PipelineConfig:
    """Load, override and validate a pipeline config.

    ``config`` is a :class:`PipelineConfig`, a mapping, or a path to a ``.yaml``/``.toml``/
    ``.json`` file. ``overrides`` replace top-level keys; ``stage_overrides`` (a mapping or a
    JSON string ``{"talker": {"replicas": 2}}``) is deep-merged into the named stages.
    Blocking, does not checkpoint: it reads the file and imports the modules the config
    names (vllm too, for a vllm stage, when installed: several seconds the first time).
    ``check_vllm=False`` leaves out the checks of vllm stages' ``engine_args`` and
    ``default_sampling_params`` (run them later with :func:`check_vllm_stages`;
    ``open_engine`` does, in a worker thread, so the caller's event loop never blocks on
    importing vllm). Raises :class:`ConfigError` naming the source and path.
    """
    source = "<dict>"
    raw: Value
    if isinstance(config, PipelineConfig):
        source = config.source or "<config>"
        raw = _as_data(config)
    elif isinstance(config, Mapping):
        raw = config
    elif isinstance(config, (str, os.PathLike)):
        path = Path(config)
        source = str(path)
        raw = read_config_file(path)
    else:
        raise ConfigError(
            f"config must be a PipelineConfig, a mapping or a file path, "
            f"not {type(config).__name__}"
        )
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"the top level must be a mapping, got {type(raw).__name__}", source=source
        )
    check_tree(raw, source)
    data = dict(raw)
    for key, instead in _LEGACY_KEYS.items():
        if key in data or key in overrides:
            raise ConfigError(
                f"{key!r} is vLLM-Omni's layout and is not supported; {instead}",
                path=f"$.{key}",
                source=source,
            )
    stage_overrides = overrides.pop("stage_overrides", None)
    check_tree(overrides, source)
    data.update(overrides)
    if stage_overrides is not None:
        parsed = _parse_overrides(stage_overrides, source)
        stages = data.get("stages")
        if not isinstance(stages, list):
            raise ConfigError("stages must be a list", path="$.stages", source=source)
        known = {s.get("id") for s in stages if isinstance(s, Mapping)}
        for sid in parsed:
            if sid not in known:
                raise ConfigError(
                    f"stage_overrides names unknown stage {sid!r}; "
                    f"{some_ids([str(s.get('id')) for s in stages if isinstance(s, Mapping)])}",
                    path=f"$.stage_overrides.{sid}",
                    source=source,
                )
        data["stages"] = [
            _deep_merge(dict(s), parsed.get(str(s.get("id")), {})) if isinstance(s, Mapping) else s
            for s in stages
        ]
    data.pop("source", None)
    if isinstance(data.get("tracing"), bool):
        data["tracing"] = {"enabled": data["tracing"]}  # `tracing: true`, `tracing=True`
    try:
        with prechecked():  # the conversion checks every field: no second check
            cfg = msgspec.convert(data, PipelineConfig)
    except msgspec.ValidationError as exc:
        reason, where = explain_validation_error(exc, data, PipelineConfig)
        hint = _BOUND_HINTS.get(where.rpartition(".")[2], "")
        raise ConfigError(reason + hint, path=where, source=source) from None
    cfg.source = source
    validate(cfg, check_vllm=check_vllm)
    return cfg
