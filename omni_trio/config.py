"""Pipeline configuration: ``PipelineConfig`` / ``StageConfig``, loading, validation, overrides.

A config comes from a YAML, TOML or JSON file, a dict, or is built directly. Unknown keys
are rejected. Every error is a :class:`~omni_trio.errors.ConfigError` naming the file and the
JSON path of the offending value, e.g. ``tiny.yaml: $.stages[1].inputs: unknown stage 'x'``.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from .errors import ConfigError

__all__ = [
    "BUILTIN_BACKENDS",
    "OUTPUT_TYPES",
    "PipelineConfig",
    "StageConfig",
    "load_config",
]

OUTPUT_TYPES = ("text", "tokens", "audio", "image", "tensor")
BUILTIN_BACKENDS = ("scripted", "vllm", "torch")
OutputType = Literal["text", "tokens", "audio", "image", "tensor"]

# Keys of vLLM-Omni's config layout that have a different home here.
_LEGACY_KEYS = {
    "stage_configs_path": "pass the pipeline file itself as `config` (open_engine(path) or "
    "`omni-trio run PATH`); stages are listed under `stages:`",
    "stage_configs": "list the stages under `stages:` in the pipeline config",
}
_BACKEND_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class StageConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One stage of a pipeline. Its position in ``PipelineConfig.stages`` is its index."""

    id: str
    backend: str = "scripted"
    engine_args: dict[str, Any] = {}
    options: dict[str, Any] = {}
    inputs: list[str] = []
    input_processor: str | None = None
    processor_options: dict[str, Any] = {}
    stream_input: bool = False
    final_output: bool = False
    output_type: OutputType = "text"
    default_sampling_params: dict[str, Any] = {}
    replicas: int = 1
    stage_init_timeout: float | None = None


class PipelineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A whole pipeline plus the engine-level settings of a session.

    ``stage_init_timeout`` bounds each stage's start (a stage may set its own),
    ``init_timeout`` the whole start, ``shutdown_timeout`` each stage's stop.
    ``max_requests_in_flight`` is the admission limit; ``output_buffer`` the size of every
    per-request channel (callers that do not read exert backpressure up to the stages).
    """

    stages: list[StageConfig]
    name: str = "pipeline"
    stage_init_timeout: float = 600.0
    init_timeout: float | None = None
    shutdown_timeout: float = 30.0
    max_requests_in_flight: int = 4096
    output_buffer: int = 64
    source: str | None = None

    # -- graph helpers -------------------------------------------------------------------
    @property
    def stage_ids(self) -> list[str]:
        return [s.id for s in self.stages]

    def stage(self, stage_id: str) -> StageConfig:
        for s in self.stages:
            if s.id == stage_id:
                return s
        raise KeyError(stage_id)

    def index_of(self, stage_id: str) -> int:
        return self.stage_ids.index(stage_id)

    def downstream(self, stage_id: str) -> list[str]:
        return [s.id for s in self.stages if stage_id in s.inputs]

    def ancestors(self, stage_id: str) -> set[str]:
        """Stage ids that ``stage_id`` depends on, transitively (not including itself)."""
        seen: set[str] = set()
        todo = list(self.stage(stage_id).inputs)
        while todo:
            sid = todo.pop()
            if sid not in seen:
                seen.add(sid)
                todo.extend(self.stage(sid).inputs)
        return seen

    @property
    def entry_stages(self) -> list[str]:
        return [s.id for s in self.stages if not s.inputs]

    @property
    def final_output_stages(self) -> list[str]:
        return [s.id for s in self.stages if s.final_output]


# -- loading ------------------------------------------------------------------------------


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror}", source=str(path)) from exc
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(
                f"unsupported config file type {suffix!r}; use .yaml, .yml, .toml or .json",
                source=str(path),
            )
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot parse file: {exc}", source=str(path)) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"the top level must be a mapping, got {type(data).__name__}", source=str(path)
        )
    return data


def _parse_overrides(value: Any, source: str) -> dict[str, dict[str, Any]]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"stage_overrides must be JSON (an object keyed by stage id): {exc}",
                path="$.stage_overrides",
                source=source,
            ) from exc
    if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
        raise ConfigError(
            "stage_overrides must map stage ids to objects of stage keys",
            path="$.stage_overrides",
            source=source,
        )
    return {str(k): dict(v) for k, v in value.items()}


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def _msgspec_path(message: str) -> tuple[str, str]:
    """Split a msgspec validation message into (reason, path)."""
    m = re.search(r" - at `(\$[^`]*)`$", message)
    if m:
        return message[: m.start()], m.group(1)
    return message, "$"


def load_config(
    config: PipelineConfig | Mapping[str, Any] | str | os.PathLike[str],
    **overrides: Any,
) -> PipelineConfig:
    """Load, override and validate a pipeline config.

    ``config`` is a :class:`PipelineConfig`, a mapping, or a path to a ``.yaml``/``.toml``/
    ``.json`` file. ``overrides`` replace top-level keys; ``stage_overrides`` (a mapping or a
    JSON string ``{"talker": {"replicas": 2}}``) is deep-merged into the named stages.
    Does not checkpoint. Raises :class:`ConfigError` naming the source and path.
    """
    source = "<dict>"
    if isinstance(config, PipelineConfig):
        source = config.source or "<config>"
        data: dict[str, Any] = msgspec.to_builtins(config)
        data.pop("source", None)
    elif isinstance(config, Mapping):
        data = dict(config)
    elif isinstance(config, (str, os.PathLike)):
        path = Path(config)
        source = str(path)
        data = _read_file(path)
    else:
        raise ConfigError(
            f"config must be a PipelineConfig, a mapping or a file path, "
            f"not {type(config).__name__}"
        )
    for key, instead in _LEGACY_KEYS.items():
        if key in data or key in overrides:
            raise ConfigError(
                f"{key!r} is vLLM-Omni's layout and is not supported; {instead}",
                path=f"$.{key}",
                source=source,
            )
    stage_overrides = overrides.pop("stage_overrides", None)
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
                    f"stage_overrides names unknown stage {sid!r}; stages are "
                    f"{sorted(str(k) for k in known)}",
                    path=f"$.stage_overrides.{sid}",
                    source=source,
                )
        data["stages"] = [
            _deep_merge(dict(s), parsed.get(str(s.get("id")), {})) if isinstance(s, Mapping) else s
            for s in stages
        ]
    data.pop("source", None)
    try:
        cfg = msgspec.convert(data, PipelineConfig)
    except msgspec.ValidationError as exc:
        reason, where = _msgspec_path(str(exc))
        raise ConfigError(reason, path=where, source=source) from None
    cfg.source = source
    validate(cfg)
    return cfg


def validate(cfg: PipelineConfig) -> None:
    """Check the stage graph and values; raises :class:`ConfigError` at the first problem."""
    src = cfg.source
    if not cfg.stages:
        raise ConfigError("a pipeline needs at least one stage", path="$.stages", source=src)
    seen: dict[str, int] = {}
    for i, st in enumerate(cfg.stages):
        where = f"$.stages[{i}]"
        if not st.id or not st.id.strip():
            raise ConfigError("stage id must be a non-empty name", path=f"{where}.id", source=src)
        if st.id in seen:
            raise ConfigError(
                f"duplicate stage id {st.id!r} (also $.stages[{seen[st.id]}])",
                path=f"{where}.id",
                source=src,
            )
        seen[st.id] = i
        if st.backend not in BUILTIN_BACKENDS and not _BACKEND_RE.match(st.backend):
            raise ConfigError(
                f"unknown backend {st.backend!r}; use one of {', '.join(BUILTIN_BACKENDS)} "
                f"or a 'package.module:Factory' path",
                path=f"{where}.backend",
                source=src,
            )
        if st.replicas < 1:
            raise ConfigError(
                f"replicas must be >= 1, got {st.replicas}", path=f"{where}.replicas", source=src
            )
        if st.stage_init_timeout is not None and st.stage_init_timeout <= 0:
            raise ConfigError(
                "stage_init_timeout must be > 0", path=f"{where}.stage_init_timeout", source=src
            )
    for i, st in enumerate(cfg.stages):
        for j, up in enumerate(st.inputs):
            if up not in seen:
                raise ConfigError(
                    f"unknown input stage {up!r}; stages are {list(seen)}",
                    path=f"$.stages[{i}].inputs[{j}]",
                    source=src,
                )
            if up == st.id:
                raise ConfigError(
                    f"stage {st.id!r} lists itself as an input",
                    path=f"$.stages[{i}].inputs[{j}]",
                    source=src,
                )
        if len(set(st.inputs)) != len(st.inputs):
            raise ConfigError(
                "an input stage is listed twice", path=f"$.stages[{i}].inputs", source=src
            )
    if not cfg.entry_stages:
        raise ConfigError(
            "no entry stage: every stage has inputs, so no stage can take the prompt",
            path="$.stages",
            source=src,
        )
    cycle = _find_cycle(cfg)
    if cycle:
        i = seen[cycle[0]]
        raise ConfigError(
            f"the stage graph has a cycle: {' -> '.join(cycle)}",
            path=f"$.stages[{i}].inputs",
            source=src,
        )
    if not cfg.final_output_stages:
        raise ConfigError(
            "no stage has final_output: true, so callers would receive nothing",
            path="$.stages",
            source=src,
        )
    for key in ("stage_init_timeout", "shutdown_timeout"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0", path=f"$.{key}", source=src)
    if cfg.init_timeout is not None and cfg.init_timeout <= 0:
        raise ConfigError("init_timeout must be > 0", path="$.init_timeout", source=src)
    for key in ("max_requests_in_flight", "output_buffer"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key} must be >= 1", path=f"$.{key}", source=src)


def _find_cycle(cfg: PipelineConfig) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the DFS stack, 2 = done
    stack: list[str] = []

    def visit(sid: str) -> list[str] | None:
        state[sid] = 1
        stack.append(sid)
        for up in cfg.stage(sid).inputs:
            if state.get(up) == 1:
                return [*stack[stack.index(up) :], up]
            if up not in state:
                found = visit(up)
                if found:
                    return found
        stack.pop()
        state[sid] = 2
        return None

    for sid in cfg.stage_ids:
        if sid not in state:
            found = visit(sid)
            if found:
                return found
    return None


def topological_order(cfg: PipelineConfig) -> list[str]:
    """Stage ids, every stage after all of its inputs; ties keep config order."""
    done: list[str] = []
    remaining = list(cfg.stage_ids)
    while remaining:
        for sid in remaining:
            if all(up in done for up in cfg.stage(sid).inputs):
                done.append(sid)
                remaining.remove(sid)
                break
    return done
