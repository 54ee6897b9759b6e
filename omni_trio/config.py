"""Pipeline configuration: ``PipelineConfig`` / ``StageConfig``, loading, validation, overrides.

A config comes from a YAML, TOML or JSON file, a dict, or is built directly. Loading checks
everything that can be known without starting an engine: unknown keys, types and ranges,
the stage graph, every backend's ``options`` (:mod:`omni_trio.stages.options`), the dotted
paths it names (imported), torch weights files, and vllm ``engine_args`` and
``default_sampling_params`` when vllm is installed. Every error is a
:class:`~omni_trio.errors.ConfigError` naming the file and the JSON path of the offending
value, e.g. ``tiny.yaml: $.stages[1].inputs[0]: unknown input stage 'x'``.

A loaded :class:`PipelineConfig` is treated as immutable: its graph (index maps, topological
order) is computed once and cached on it. To change one, ``load_config(cfg, **overrides)``
returns a new one. :func:`config_schema` is the JSON Schema of the file format.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ._config_read import (
    Value,
    check_tree,
    explain_validation_error,
    json_object,
    read_config_file,
)
from ._dotted import DOTTED_PATTERN, import_dotted, is_dotted
from ._stage_graph import StageGraph, some_ids
from .errors import ConfigError

__all__ = [
    "BUILTIN_BACKENDS",
    "MAX_REPLICAS",
    "OUTPUT_TYPES",
    "PLACEMENTS",
    "PipelineConfig",
    "Placement",
    "RayPlacement",
    "StageConfig",
    "check_vllm_stages",
    "config_schema",
    "load_config",
    "topological_order",
]

OUTPUT_TYPES = ("text", "tokens", "audio", "image", "tensor")
BUILTIN_BACKENDS = ("scripted", "vllm", "torch")
OutputType = Literal["text", "tokens", "audio", "image", "tensor"]
#: most replicas one stage may have (a guard against typos that would start thousands of
#: engines; run more than this as separate pipelines)
MAX_REPLICAS = 256
#: bound on max_requests_in_flight and output_buffer (memory is reserved per slot)
MAX_SLOTS = 1_000_000

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
_TIMEOUT = Annotated[float, Meta(gt=0)]
#: how a stage's pool picks the replica a request is bound to (:mod:`omni_trio.stages.balancing`)
LbPolicy = Literal["least_loaded", "round_robin", "random"]
#: what a request gets when ``max_requests_in_flight`` is reached
Admission = Literal["wait", "reject"]
#: whether a dead replica is replaced
RestartPolicy = Literal["never", "on-failure"]


def _doc(text: str, **extra: Value) -> Meta:
    return Meta(description=text, **extra)


_NON_NEGATIVE = Annotated[float, Meta(ge=0)]


class RayPlacement(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A stage's replicas as Ray actors (``docs/ray.md``): where and with what resources."""

    address: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        _doc(
            "an existing Ray cluster ('ray://head:10001', 'auto'); default: a local Ray "
            "started for the engine and shut down when it closes"
        ),
    ] = None
    num_cpus: Annotated[_NON_NEGATIVE, _doc("CPUs each replica's actor reserves")] = 1.0
    num_gpus: Annotated[_NON_NEGATIVE, _doc("GPUs each replica's actor reserves")] = 0.0
    resources: Annotated[
        dict[str, _NON_NEGATIVE], _doc("custom Ray resources each actor reserves, by name")
    ] = {}
    runtime_env: Annotated[
        dict[str, Value], _doc("the actors' Ray runtime_env (pip, env_vars, working_dir ...)")
    ] = {}


class Placement(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where a stage's replicas run instead of this process."""

    ray: Annotated[RayPlacement | None, _doc("as Ray actors")] = None


#: the placements a stage may name (the keys of ``placement``)
PLACEMENTS = ("ray",)


class StageConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One stage of a pipeline. Its position in ``PipelineConfig.stages`` is its index."""

    id: Annotated[str, _doc("the stage's name, unique in the pipeline", min_length=1)]
    backend: Annotated[
        str,
        _doc(
            "scripted | vllm | torch | 'package.module:Factory' (a user backend)",
            extra_json_schema={
                "anyOf": [{"enum": list(BUILTIN_BACKENDS)}, {"pattern": DOTTED_PATTERN}]
            },
        ),
    ] = "scripted"
    engine_args: Annotated[dict[str, Value], _doc("vllm stages: vllm AsyncEngineArgs fields")] = {}
    options: Annotated[
        dict[str, Value],
        _doc(
            "backend options, checked at load against the backend's options "
            "(ScriptedOptions, TorchOptions, VllmOptions, or a user backend's Options)"
        ),
    ] = {}
    inputs: Annotated[list[str], _doc("upstream stage ids; the entry stage has none")] = []
    input_processor: Annotated[
        str | None,
        _doc(
            "'package.module:function' turning upstream outputs into this stage's input "
            "(default: hand the upstream token ids on)",
            extra_json_schema={"pattern": DOTTED_PATTERN},
        ),
    ] = None
    processor_options: Annotated[
        dict[str, Value], _doc("options passed to the input processor")
    ] = {}
    prompt_transform: Annotated[
        str | None,
        _doc(
            "entry stages: 'package.module:function' called as fn(prompt, request_id) in "
            "generate() before the prompt is checked; returns the prompt, or (prompt, "
            "artifact_dirs): absolute directories deleted when the request ends",
            extra_json_schema={"pattern": DOTTED_PATTERN},
        ),
    ] = None
    prompt_expand: Annotated[
        str | None,
        _doc(
            "entry stages: 'package.module:function' called as fn(prompt, sampling_params) "
            "-> list[Companion] (CFG companions, e.g. the negative prompt)",
            extra_json_schema={"pattern": DOTTED_PATTERN},
        ),
    ] = None
    stream_input: Annotated[
        bool, _doc("start on streamed partial upstream output instead of waiting for it")
    ] = False
    final_output: Annotated[bool, _doc("its outputs go to callers by default")] = False
    output_type: Annotated[OutputType, _doc("what the stage produces")] = "text"
    default_sampling_params: Annotated[
        dict[str, Value],
        _doc("sampling params merged under each request's (vllm: SamplingParams fields)"),
    ] = {}
    replicas: Annotated[
        int, _doc(f"engine replicas of this stage, 1..{MAX_REPLICAS}", ge=1, le=MAX_REPLICAS)
    ] = 1
    stage_init_timeout: Annotated[
        _TIMEOUT | None,
        _doc("seconds this stage may take to start (default: the pipeline's)"),
    ] = None
    shutdown_timeout: Annotated[
        _TIMEOUT | None,
        _doc("seconds each replica may take to stop (default: the pipeline's)"),
    ] = None
    lb_policy: Annotated[
        LbPolicy | None,
        _doc(
            "least_loaded | round_robin | random: which replica takes a request "
            "(default: the pipeline's lb_policy)"
        ),
    ] = None
    max_in_flight_per_replica: Annotated[
        Annotated[int, Meta(ge=1, le=MAX_SLOTS)] | None,
        _doc(
            "requests one replica runs at once; more wait first-in first-out for a slot "
            "(default: no limit)"
        ),
    ] = None
    restart: Annotated[RestartPolicy, _doc("never | on-failure: replace a replica that died")] = (
        "never"
    )
    max_restarts: Annotated[
        int, _doc("restarts allowed per replica index (restart: on-failure)", ge=0)
    ] = 3
    restart_backoff_s: Annotated[
        Annotated[float, Meta(ge=0)],
        _doc(
            "seconds before the first restart; doubled per restart of the same index, "
            "capped at restart_backoff_max_s"
        ),
    ] = 1.0
    restart_backoff_max_s: Annotated[
        Annotated[float, Meta(ge=0)], _doc("cap on the restart backoff")
    ] = 30.0
    replica_wait_timeout_s: Annotated[
        Annotated[float, Meta(ge=0)],
        _doc(
            "seconds a request waits for a restarting (or starting) replica when none is "
            "ready, before failing with NoLiveReplicaError"
        ),
    ] = 10.0
    placement: Annotated[
        Placement | None,
        _doc("where the replicas run (ray: as Ray actors); default: in this process"),
    ] = None


class PipelineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, dict=True):
    """A whole pipeline plus the engine-level settings of a session."""

    stages: Annotated[
        list[StageConfig],
        _doc("the stages; a stage's position is its index", extra_json_schema={"minItems": 1}),
    ]
    name: Annotated[str, _doc("the pipeline's name (the served model name)")] = "pipeline"
    stage_init_timeout: Annotated[
        _TIMEOUT, _doc("seconds each stage may take to start (a stage may set its own)")
    ] = 600.0
    init_timeout: Annotated[
        _TIMEOUT | None, _doc("seconds the whole start may take (default: no bound)")
    ] = None
    shutdown_timeout: Annotated[
        _TIMEOUT, _doc("seconds each replica may take to stop (a stage may set its own)")
    ] = 30.0
    max_requests_in_flight: Annotated[
        int, _doc("admission limit: requests running at once", ge=1, le=MAX_SLOTS)
    ] = 4096
    admission: Annotated[
        Admission,
        _doc(
            "at max_requests_in_flight: wait (first-in first-out) or reject "
            "(EngineOverloadedError at once)"
        ),
    ] = "wait"
    max_waiting: Annotated[
        Annotated[int, Meta(ge=0, le=MAX_SLOTS)] | None,
        _doc(
            "admissions that may wait (admission: wait); beyond it EngineOverloadedError "
            "(default: no bound)"
        ),
    ] = None
    lb_policy: Annotated[LbPolicy, _doc("the default lb_policy of every stage")] = "least_loaded"
    lb_seed: Annotated[int | None, _doc("seed of the random lb_policy (reproducible choices)")] = (
        None
    )
    output_buffer: Annotated[
        int,
        _doc(
            "size of every per-request output channel (readers that lag exert backpressure)",
            ge=1,
            le=MAX_SLOTS,
        ),
    ] = 64
    source: str | None = None

    # -- graph helpers (O(1) or linear; computed once, see the module docstring) ---------
    def graph(self) -> StageGraph:
        """The stage graph (order, indexes, downstream, ancestors), built once and rebuilt
        only if ``stages`` is replaced. Synchronous. Raises ConfigError for unknown inputs
        or a cycle."""
        key = (id(self.stages), len(self.stages))
        cached: tuple[tuple[int, int], StageGraph] | None = self.__dict__.get("_graph_cache")
        if cached is None or cached[0] != key:
            ids = [s.id for s in self.stages]
            graph = StageGraph(ids, [s.inputs for s in self.stages], self.source)
            cached = self.__dict__["_graph_cache"] = (key, graph)
        return cached[1]

    @property
    def stage_ids(self) -> list[str]:
        return list(self.graph().ids)

    def stage(self, stage_id: str) -> StageConfig:
        """The stage named ``stage_id``. O(1). Raises KeyError."""
        return self.stages[self.graph().index[stage_id]]

    def index_of(self, stage_id: str) -> int:
        """The index of the stage named ``stage_id``. O(1). Raises ValueError."""
        try:
            return self.graph().index[stage_id]
        except KeyError:
            raise ValueError(f"{stage_id!r} is not a stage of the pipeline") from None

    def downstream(self, stage_id: str) -> list[str]:
        """Stages that list ``stage_id`` as an input, in config order."""
        return list(self.graph().downstream[stage_id])

    def ancestors(self, stage_id: str) -> set[str]:
        """Stage ids that ``stage_id`` depends on, transitively (not including itself)."""
        return set(self.graph().ancestors(stage_id))

    @property
    def entry_stages(self) -> list[str]:
        return [s.id for s in self.stages if not s.inputs]

    @property
    def final_output_stages(self) -> list[str]:
        return [s.id for s in self.stages if s.final_output]


def topological_order(cfg: PipelineConfig) -> list[str]:
    """Stage ids, every stage after all of its inputs; ties keep config order. Cached."""
    return list(cfg.graph().order)


# -- loading ------------------------------------------------------------------------------


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
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(dict(out[k]), v)
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
        reason, where = explain_validation_error(exc, data, PipelineConfig)
        hint = _BOUND_HINTS.get(where.rpartition(".")[2], "")
        raise ConfigError(reason + hint, path=where, source=source) from None
    cfg.source = source
    validate(cfg, check_vllm=check_vllm)
    return cfg


def check_vllm_stages(cfg: PipelineConfig) -> None:
    """Check every vllm stage's ``engine_args`` and ``default_sampling_params`` against vLLM's
    own fields (when vllm is installed). Blocking: imports vllm (seconds, once per process).
    Raises :class:`ConfigError` naming the path."""
    from .stages._vllm_fields import check_vllm_stage

    for i, st in enumerate(cfg.stages):
        if st.backend == "vllm":
            check_vllm_stage(
                st.engine_args, st.default_sampling_params, f"$.stages[{i}]", cfg.source
            )


def validate(cfg: PipelineConfig, *, check_vllm: bool = True) -> None:
    """Check the stage graph and every stage (see the module docstring). Blocking (imports
    the modules the config names). Raises :class:`ConfigError` at the first problem."""
    from .stages.options import check_stage

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
        if st.backend not in BUILTIN_BACKENDS and not is_dotted(st.backend):
            raise ConfigError(
                f"unknown backend {st.backend!r}; use one of {', '.join(BUILTIN_BACKENDS)} "
                f"or a 'package.module:Factory' path",
                path=f"{where}.backend",
                source=src,
            )
        for j, up in enumerate(st.inputs):
            if up == st.id:
                raise ConfigError(
                    f"stage {st.id!r} lists itself as an input",
                    path=f"{where}.inputs[{j}]",
                    source=src,
                )
        if len(set(st.inputs)) != len(st.inputs):
            raise ConfigError("an input stage is listed twice", path=f"{where}.inputs", source=src)
    for i, st in enumerate(cfg.stages):
        for j, up in enumerate(st.inputs):
            if up not in seen:
                raise ConfigError(
                    f"unknown input stage {up!r}; {some_ids(list(seen))}",
                    path=f"$.stages[{i}].inputs[{j}]",
                    source=src,
                )
    if not cfg.entry_stages:
        raise ConfigError(
            "no entry stage: every stage has inputs, so no stage can take the prompt",
            path="$.stages",
            source=src,
        )
    cfg.__dict__.pop("_graph_cache", None)
    cfg.graph()  # unknown inputs, cycles
    if not cfg.final_output_stages:
        raise ConfigError(
            "no stage has final_output: true, so callers would receive nothing",
            path="$.stages",
            source=src,
        )
    for i, st in enumerate(cfg.stages):
        _check_entry_hooks(st, i, src)
        check_stage(st, i, src, check_vllm=check_vllm)
    _check_placements(cfg.stages, src)


#: the hooks only an entry stage may name (they act on the request's prompt)
_ENTRY_HOOKS = ("prompt_transform", "prompt_expand")


def _check_entry_hooks(st: StageConfig, index: int, source: str | None) -> None:
    # Blocking: imports the hook's module. Raises ConfigError naming the key's path.
    for key in _ENTRY_HOOKS:
        path: str | None = getattr(st, key)
        if path is None:
            continue
        where = f"$.stages[{index}].{key}"
        if st.inputs:
            raise ConfigError(
                f"{key} is for entry stages (stages without inputs): it acts on the "
                f"caller's prompt, and stage {st.id!r} takes its input from {st.inputs}",
                path=where,
                source=source,
            )
        import_dotted(path, what=key, where=where, source=source)


def _check_placements(stages: list[StageConfig], source: str | None) -> None:
    # Pure. A process holds one Ray connection, so all Ray stages share one address.
    first: tuple[int, str | None] | None = None
    for i, st in enumerate(stages):
        if st.placement is None:
            continue
        where = f"$.stages[{i}].placement"
        if st.placement.ray is None:
            raise ConfigError(
                f"a placement names where the replicas run: one of {', '.join(PLACEMENTS)} "
                "(e.g. placement: {ray: {num_cpus: 1}}); leave placement out to run them here",
                path=where,
                source=source,
            )
        address = st.placement.ray.address
        if first is None:
            first = (i, address)
        elif address != first[1]:
            raise ConfigError(
                f"stage {st.id!r} is placed on Ray at {_ray_address(address)} but stage "
                f"{stages[first[0]].id!r} ($.stages[{first[0]}]) at "
                f"{_ray_address(first[1])}: an engine connects to one Ray cluster, so every "
                "Ray stage must name the same address",
                path=f"{where}.ray.address",
                source=source,
            )


def _ray_address(address: str | None) -> str:
    return "a local Ray (no address)" if address is None else repr(address)


def config_schema() -> dict[str, Value]:
    """The JSON Schema (draft 2020-12) of a pipeline config file, options of the built-in
    backends included (chosen by each stage's ``backend``). Pure."""
    from .stages.options import BUILTIN_OPTIONS

    types: list[Value] = [PipelineConfig, *BUILTIN_OPTIONS.values()]
    _, defs = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    pipeline = defs["PipelineConfig"]
    pipeline["properties"].pop("source", None)
    stage = defs["StageConfig"]
    rules = []
    for backend, options_type in BUILTIN_OPTIONS.items():
        # no `required` for the default backend: a stage without `backend:` is scripted
        cond: dict[str, Value] = {"properties": {"backend": {"const": backend}}}
        if backend != "scripted":
            cond["required"] = ["backend"]
        ref = {"$ref": f"#/$defs/{options_type.__name__}"}
        rules.append({"if": cond, "then": {"properties": {"options": ref}}})
    stage["allOf"] = rules
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "omni-trio pipeline config",
        "$ref": "#/$defs/PipelineConfig",
        "$defs": defs,
    }
