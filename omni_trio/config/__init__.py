"""Pipeline configuration: what a pipeline file says, checked before anything starts.

The modules:

- :mod:`~omni_trio.config.loading`: :func:`load_config` (a file, a mapping or a config, with
  overrides) into a checked :class:`PipelineConfig`;
- :mod:`~omni_trio.config.reading`: reading a file safely (size, depth, duplicate keys), and
  turning msgspec's validation errors into ``$``-paths;
- :mod:`~omni_trio.config.stage`: a stage's schema (:class:`StageConfig`, its placement);
- :mod:`~omni_trio.config.pipeline`: the pipeline's schema and its JSON Schema;
- :mod:`~omni_trio.config.graph`: the stage graph (index maps, order, ancestors);
- :mod:`~omni_trio.config.checks`: everything beyond types, at load;
- :mod:`~omni_trio.config.pd`: prefill/decode pairs, found and checked at load;
- :mod:`~omni_trio.config.resources`: the stages' ``resources`` against the pipeline's
  ``capacities``;
- :mod:`~omni_trio.config.backends`: the built-in backends, listed once, and what a backend
  factory named by path must be;
- :mod:`~omni_trio.config.options`: the built-in backends' option schemas, and
  :func:`parse_options` for any backend's;
- :mod:`~omni_trio.config.vllm_fields`: a vllm stage's keys against vLLM's own fields;
- :mod:`~omni_trio.config.dotted`: ``"package.module:attribute"`` paths;
- :mod:`~omni_trio.config.stageinfo`: what each stage is and produces
  (:class:`StageInfo`), and what the pipeline can do.

This package imports only the package's floor-0 modules (errors, values); vllm only to read
its field lists.
"""

from .backends import BUILTIN_BACKENDS, BuiltinBackend
from .checks import check_vllm_stages, validate
from .loading import load_config
from .options import ScriptedOptions, TorchOptions, VllmOptions, parse_options
from .pipeline import (
    Admission,
    PipelineConfig,
    SessionsConfig,
    TracingConfig,
    config_schema,
    topological_order,
)
from .stage import (
    MAX_REPLICAS,
    MAX_SLOTS,
    OUTPUT_TYPES,
    PLACEMENTS,
    LbPolicy,
    OutputType,
    Placement,
    RayPlacement,
    RestartPolicy,
    StageConfig,
)
from .stageinfo import StageInfo

__all__ = [
    "BUILTIN_BACKENDS",
    "MAX_REPLICAS",
    "MAX_SLOTS",
    "OUTPUT_TYPES",
    "PLACEMENTS",
    "Admission",
    "BuiltinBackend",
    "LbPolicy",
    "OutputType",
    "PipelineConfig",
    "SessionsConfig",
    "TracingConfig",
    "Placement",
    "RayPlacement",
    "RestartPolicy",
    "ScriptedOptions",
    "StageConfig",
    "StageInfo",
    "TorchOptions",
    "VllmOptions",
    "check_vllm_stages",
    "config_schema",
    "load_config",
    "parse_options",
    "topological_order",
    "validate",
]
