"""One stage's schema: :class:`StageConfig` and where its replicas run (:class:`Placement`).

The msgspec structs that a stage entry of a pipeline file is converted to, with every key's
type, bounds, default and description (the JSON Schema and ``docs/config.md`` come from
them), and the names and bounds the rest of the package shares: the built-in backends, the
output types, :data:`MAX_REPLICAS`, :data:`MAX_SLOTS`. Converting checks one key at a time;
what needs several keys, several stages or an import is checked by
:mod:`omni_trio.config.checks`. Import these names from :mod:`omni_trio.config.loading`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from .backends import BUILTIN_BACKENDS
from .dotted import DOTTED_PATTERN
from .reading import FieldValue, check_struct

__all__ = [
    "MAX_REPLICAS",
    "MAX_SLOTS",
    "OUTPUT_TYPES",
    "PLACEMENTS",
    "LbPolicy",
    "NonNegative",
    "OutputType",
    "Placement",
    "RayPlacement",
    "RestartPolicy",
    "StageConfig",
    "Timeout",
    "doc",
]

OUTPUT_TYPES = ("text", "tokens", "audio", "image", "tensor")
OutputType = Literal["text", "tokens", "audio", "image", "tensor"]
#: most replicas one stage may have (a guard against typos that would start thousands of
#: engines; run more than this as separate pipelines)
MAX_REPLICAS = 256
#: bound on max_requests_in_flight and output_buffer (memory is reserved per slot)
MAX_SLOTS = 1_000_000
#: seconds to wait for something: positive
Timeout = Annotated[float, Meta(gt=0)]
#: an amount of a resource (CPUs, GPUs) or seconds of backoff: zero or more
NonNegative = Annotated[float, Meta(ge=0)]
#: how a stage's pool picks the replica a request is bound to (:mod:`omni_trio.stages.balancing`)
LbPolicy = Literal["least_loaded", "round_robin", "random"]
#: whether a dead replica is replaced
RestartPolicy = Literal["never", "on-failure"]


def doc(text: str, extra_json_schema: dict[str, object] | None = None) -> Meta:
    """A key's description in the JSON Schema, and more schema if given (its bounds are a
    ``Meta`` of their own beside it). Pure."""
    return Meta(description=text, extra_json_schema=extra_json_schema)


class RayPlacement(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A stage's replicas as Ray actors (``docs/ray.md``): where and with what resources."""

    address: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        doc(
            "an existing Ray cluster ('ray://head:10001', 'auto'); default: a local Ray "
            "started for the engine and shut down when it closes"
        ),
    ] = None
    num_cpus: Annotated[NonNegative, doc("CPUs each replica's actor reserves")] = 1.0
    num_gpus: Annotated[NonNegative, doc("GPUs each replica's actor reserves")] = 0.0
    resources: Annotated[
        dict[str, NonNegative], doc("custom Ray resources each actor reserves, by name")
    ] = {}
    runtime_env: Annotated[
        dict[str, FieldValue], doc("the actors' Ray runtime_env (pip, env_vars, working_dir ...)")
    ] = {}

    def __post_init__(self) -> None:
        check_struct(self)  # built in Python: checked as a loaded file is


class Placement(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where a stage's replicas run instead of this process."""

    ray: Annotated[RayPlacement | None, doc("as Ray actors")] = None

    def __post_init__(self) -> None:
        check_struct(self)  # built in Python: checked as a loaded file is


#: the placements a stage may name (the keys of ``placement``)
PLACEMENTS = ("ray",)


class StageConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One stage of a pipeline. Its position in ``PipelineConfig.stages`` is its index."""

    id: Annotated[str, Meta(min_length=1), doc("the stage's name, unique in the pipeline")]
    backend: Annotated[
        str,
        doc(
            "scripted | vllm | torch | 'package.module:Factory' (a user backend)",
            extra_json_schema={
                "anyOf": [{"enum": list(BUILTIN_BACKENDS)}, {"pattern": DOTTED_PATTERN}]
            },
        ),
    ] = "scripted"
    engine_args: Annotated[
        dict[str, FieldValue], doc("vllm stages: vllm AsyncEngineArgs fields")
    ] = {}
    options: Annotated[
        dict[str, FieldValue],
        doc(
            "backend options, checked at load against the backend's options "
            "(ScriptedOptions, TorchOptions, VllmOptions, or a user backend's Options)"
        ),
    ] = {}
    inputs: Annotated[list[str], doc("upstream stage ids; the entry stage has none")] = []
    input_processor: Annotated[
        str | None,
        doc(
            "'package.module:function' turning upstream outputs into this stage's input "
            "(default: hand the upstream token ids on)",
            extra_json_schema={"pattern": DOTTED_PATTERN},
        ),
    ] = None
    processor_options: Annotated[
        dict[str, FieldValue], doc("options passed to the input processor")
    ] = {}
    prompt_transform: Annotated[
        str | None,
        doc(
            "entry stages: 'package.module:function' called as fn(prompt, request_id) in "
            "generate() before the prompt is checked; returns the prompt, or (prompt, "
            "artifact_dirs): absolute directories deleted when the request ends",
            extra_json_schema={"pattern": DOTTED_PATTERN},
        ),
    ] = None
    prompt_expand: Annotated[
        str | None,
        doc(
            "entry stages: 'package.module:function' called as fn(prompt, sampling_params) "
            "-> list[Companion] (CFG companions, e.g. the negative prompt)",
            extra_json_schema={"pattern": DOTTED_PATTERN},
        ),
    ] = None
    stream_input: Annotated[
        bool, doc("start on streamed partial upstream output instead of waiting for it")
    ] = False
    is_prefill_only: Annotated[
        bool,
        doc(
            "vllm stages: the prefill half of a prefill/decode pair: runs each prompt to one "
            "token and hands its KV cache, through engine_args.kv_transfer_config, to the "
            "decode stage that lists it as its input"
        ),
    ] = False
    is_decode_only: Annotated[
        bool,
        doc(
            "vllm stages: the decode half of a prefill/decode pair: its one input is the "
            "prefill stage; it gets the prefill's prompt and kv_transfer_params and loads the "
            "KV cache instead of recomputing it"
        ),
    ] = False
    final_output: Annotated[bool, doc("its outputs go to callers by default")] = False
    output_type: Annotated[OutputType, doc("what the stage produces")] = "text"
    default_sampling_params: Annotated[
        dict[str, FieldValue],
        doc("sampling params merged under each request's (vllm: SamplingParams fields)"),
    ] = {}
    replicas: Annotated[
        int, Meta(ge=1, le=MAX_REPLICAS), doc(f"engine replicas of this stage, 1..{MAX_REPLICAS}")
    ] = 1
    stage_init_timeout: Annotated[
        Timeout | None,
        doc("seconds this stage may take to start (default: the pipeline's)"),
    ] = None
    shutdown_timeout: Annotated[
        Timeout | None,
        doc("seconds each replica may take to stop (default: the pipeline's)"),
    ] = None
    lb_policy: Annotated[
        LbPolicy | None,
        doc(
            "least_loaded | round_robin | random: which replica takes a request "
            "(default: the pipeline's lb_policy)"
        ),
    ] = None
    max_in_flight_per_replica: Annotated[
        Annotated[int, Meta(ge=1, le=MAX_SLOTS)] | None,
        doc(
            "requests one replica runs at once; more wait first-in first-out for a slot "
            "(default: no limit)"
        ),
    ] = None
    restart: Annotated[RestartPolicy, doc("never | on-failure: replace a replica that died")] = (
        "never"
    )
    max_restarts: Annotated[
        int, Meta(ge=0), doc("restarts allowed per replica index (restart: on-failure)")
    ] = 3
    restart_backoff_s: Annotated[
        Annotated[float, Meta(ge=0)],
        doc(
            "seconds before the first restart; doubled per restart of the same index, "
            "capped at restart_backoff_max_s"
        ),
    ] = 1.0
    restart_backoff_max_s: Annotated[
        Annotated[float, Meta(ge=0)], doc("cap on the restart backoff")
    ] = 30.0
    replica_wait_timeout_s: Annotated[
        Annotated[float, Meta(ge=0)],
        doc(
            "seconds a request waits for a restarting (or starting) replica when none is "
            "ready, before failing with NoLiveReplicaError"
        ),
    ] = 10.0
    placement: Annotated[
        Placement | None,
        doc("where the replicas run (ray: as Ray actors); default: in this process"),
    ] = None
    resources: Annotated[
        dict[str, float],
        doc(
            "what each replica reserves, by name, from the pipeline's capacities before it "
            "starts (cpu_cores, memory_gib, device_memory_fraction or a name of yours), "
            "amounts > 0; not for Ray stages (Ray reserves placement.ray's); default: nothing",
            # the bounds are checked at load, naming each amount's path (config.resources):
            # msgspec's own would name only the mapping
            extra_json_schema={"propertyNames": {"minLength": 1}},
        ),
    ] = {}

    def __post_init__(self) -> None:
        check_struct(self)  # built in Python: checked as a loaded file is
