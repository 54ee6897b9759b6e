"""omni-trio: a trio-native structured-concurrency engine for multi-stage inference."""

from .config import PipelineConfig, StageConfig, load_config
from .config.stageinfo import StageInfo
from .engine.engine import Engine, open_engine
from .engine.health import HealthReport, ReplicaHealth, StageHealth
from .engine.streams import RequestStream
from .errors import (
    BackendUnavailableError,
    CollectiveRPCTimeoutError,
    ConfigError,
    DuplicateRequestError,
    EngineClosedError,
    EngineOverloadedError,
    InvalidRequestError,
    NoLiveReplicaError,
    OmniTrioError,
    ReplicaDeadError,
    StageError,
    StageRPCError,
    StageStartError,
    StageStopError,
)
from .outputs import (
    EngineStatistics,
    OmniOutput,
    ReplicaStatistics,
    StageInput,
    StageOutput,
    StageStatistics,
)
from .request.companions import Companion
from .stages.backend import StageBackend

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "CollectiveRPCTimeoutError",
    "Companion",
    "ConfigError",
    "DuplicateRequestError",
    "Engine",
    "EngineClosedError",
    "EngineOverloadedError",
    "EngineStatistics",
    "HealthReport",
    "InvalidRequestError",
    "NoLiveReplicaError",
    "OmniOutput",
    "OmniTrioError",
    "PipelineConfig",
    "ReplicaDeadError",
    "ReplicaHealth",
    "ReplicaStatistics",
    "RequestStream",
    "StageBackend",
    "StageConfig",
    "StageError",
    "StageHealth",
    "StageInfo",
    "StageInput",
    "StageOutput",
    "StageRPCError",
    "StageStartError",
    "StageStatistics",
    "StageStopError",
    "load_config",
    "open_engine",
]
