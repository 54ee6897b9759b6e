"""The pipeline's schema: :class:`PipelineConfig`, its stage graph, and the file's JSON Schema.

:class:`PipelineConfig` is the msgspec struct a whole pipeline file is converted to: its
stages (:class:`~omni_trio.config.stage.StageConfig`) and the engine-level settings of a
session. Its graph queries (index of a stage, downstream, ancestors, topological order) are
answered from a :class:`~omni_trio.config.graph.StageGraph` built once and cached on the
config. :func:`config_schema` is the JSON Schema of the file format (``omni-trio schema``).
Import these names from :mod:`omni_trio.config.loading`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from .backends import BUILTIN_BACKENDS
from .graph import StageGraph
from .reading import Value, check_struct
from .stage import MAX_SLOTS, LbPolicy, StageConfig, Timeout, doc

__all__ = [
    "Admission",
    "PipelineConfig",
    "SessionsConfig",
    "TracingConfig",
    "config_schema",
    "topological_order",
]

#: what a request gets when ``max_requests_in_flight`` is reached
Admission = Literal["wait", "reject"]


class SessionsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The bounds of live sessions (``engine.open_session``)."""

    max_sessions: Annotated[
        int,
        Meta(ge=1, le=MAX_SLOTS),
        doc("sessions open at once (closing ones included); beyond it SessionLimitError"),
    ] = 1024
    idle_timeout_s: Annotated[
        Timeout, doc("seconds without a client call or a response event before it closes")
    ] = 300.0
    detach_grace_s: Annotated[
        Timeout, doc("seconds a detached session waits for a resume before it closes")
    ] = 30.0
    max_pending_input_bytes: Annotated[
        int,
        Meta(ge=1),
        doc("bytes one user turn's input may hold; an append beyond raises (does not wait)"),
    ] = 16 * 1024 * 1024
    max_pending_turns: Annotated[
        int,
        Meta(ge=1, le=MAX_SLOTS),
        doc("turns whose response has not ended; an append starting one more raises"),
    ] = 4
    journal_events: Annotated[
        int,
        Meta(ge=1, le=MAX_SLOTS),
        doc("events kept for a resume; undelivered ones beyond it make the response wait"),
    ] = 512
    journal_bytes: Annotated[
        int,
        Meta(ge=1),
        doc("bytes of events kept for a resume; undelivered ones beyond it make it wait"),
    ] = 2 * 1024 * 1024

    def __post_init__(self) -> None:
        check_struct(self)  # built in Python: checked as a loaded file is


class TracingConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenTelemetry tracing of requests (needs the ``otel`` extra; off: nothing imported).
    ``tracing: true`` is short for ``tracing: {enabled: true}``."""

    enabled: Annotated[
        bool,
        doc(
            "one trace per request (a span per stage); also on when OTEL_TRACES_EXPORTER or "
            "an OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is set"
        ),
    ] = False
    otlp_traces_endpoint: Annotated[
        str | None,
        doc(
            "where spans go over OTLP/HTTP (e.g. http://localhost:4318/v1/traces); default: "
            "the global tracer provider if the program set one, else the OTEL_* variables"
        ),
    ] = None
    sample_ratio: Annotated[
        float,
        Meta(ge=0, le=1),
        doc("the share of requests traced (a caller's sampled trace is always continued)"),
    ] = 1.0

    def __post_init__(self) -> None:
        check_struct(self)  # built in Python: checked as a loaded file is


class PipelineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, dict=True):
    """A whole pipeline plus the engine-level settings of a session."""

    stages: Annotated[
        list[StageConfig],
        doc("the stages; a stage's position is its index", extra_json_schema={"minItems": 1}),
    ]
    name: Annotated[str, doc("the pipeline's name (the served model name)")] = "pipeline"
    stage_init_timeout: Annotated[
        Timeout, doc("seconds each stage may take to start (a stage may set its own)")
    ] = 600.0
    init_timeout: Annotated[
        Timeout | None, doc("seconds the whole start may take (default: no bound)")
    ] = None
    shutdown_timeout: Annotated[
        Timeout, doc("seconds each replica may take to stop (a stage may set its own)")
    ] = 30.0
    max_requests_in_flight: Annotated[
        int, Meta(ge=1, le=MAX_SLOTS), doc("admission limit: requests running at once")
    ] = 4096
    admission: Annotated[
        Admission,
        doc(
            "at max_requests_in_flight: wait (first-in first-out) or reject "
            "(EngineOverloadedError at once)"
        ),
    ] = "wait"
    max_waiting: Annotated[
        Annotated[int, Meta(ge=0, le=MAX_SLOTS)] | None,
        doc(
            "admissions that may wait (admission: wait); beyond it EngineOverloadedError "
            "(default: no bound)"
        ),
    ] = None
    lb_policy: Annotated[LbPolicy, doc("the default lb_policy of every stage")] = "least_loaded"
    lb_seed: Annotated[int | None, doc("seed of the random lb_policy (reproducible choices)")] = (
        None
    )
    output_buffer: Annotated[
        int,
        Meta(ge=1, le=MAX_SLOTS),
        doc("size of every per-request output channel (readers that lag exert backpressure)"),
    ] = 64
    sessions: Annotated[SessionsConfig, doc("live sessions' bounds (engine.open_session)")] = (
        msgspec.field(default_factory=SessionsConfig)
    )
    capacities: Annotated[
        dict[str, float],
        doc(
            "the totals the stages' resources are reserved from, by name, amounts >= 0; "
            "cpu_cores and memory_gib default to what this process may use of the machine",
            # the bounds are checked at load, naming each amount's path (config.resources):
            # msgspec's own would name only the mapping
            extra_json_schema={"propertyNames": {"minLength": 1}},
        ),
    ] = {}
    max_requests_in_graph: Annotated[
        Annotated[int, Meta(ge=1, le=MAX_SLOTS)] | None,
        doc(
            "requests in the pipeline at once, each counted from its admission until its "
            "consumer took the final output or left; beyond it a request waits or is "
            "refused as admission says (default: no limit)"
        ),
    ] = None
    tracing: Annotated[TracingConfig, doc("OpenTelemetry tracing of requests")] = msgspec.field(
        default_factory=TracingConfig
    )
    source: str | None = None

    def __post_init__(self) -> None:
        check_struct(self)  # built in Python: checked as a loaded file is

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


def config_schema() -> dict[str, Value]:
    """The JSON Schema (draft 2020-12) of a pipeline config file, options of the built-in
    backends included (chosen by each stage's ``backend``). Pure."""
    types: list[Value] = [PipelineConfig, *(b.options for b in BUILTIN_BACKENDS.values())]
    _, defs = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    pipeline = defs["PipelineConfig"]
    pipeline["properties"].pop("source", None)
    stage = defs["StageConfig"]
    rules = []
    for backend, builtin in BUILTIN_BACKENDS.items():
        options_type = builtin.options
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
