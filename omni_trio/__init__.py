"""omni-trio: a trio-native structured-concurrency engine for multi-stage inference.

This namespace is the public API users import (see ``__all__``). The package is in floors
(README, "Layout"); floor 0 holds the values every layer shares, each in its own module:

- ``errors``: the exception tree; ``failures``: several failures merged into one typed error;
- ``outputs``: stage inputs and outputs, a request's outputs, statistics; ``context``: what a
  request carries besides its input; ``_values``: cheaper construction of the frozen values
  made per output;
- ``observer``: engine events for metrics and tracing; ``audio``: WAV encoding of audio
  outputs; ``images``: PNG encoding of image outputs; ``heap``: the start-up heap left out
  of full garbage collections;

then ``config/``, ``transport/``, ``stages/``, ``backends/``, ``request/``, ``engine/``,
``server/``, ``testing/``, ``sync`` (the blocking facade) and ``cli/`` (``__main__`` runs
it); ``models/`` and ``pipelines/`` hold the tiny models and the shipped pipelines.
"""

from .config import PipelineConfig, StageConfig, load_config
from .config.stageinfo import StageInfo
from .engine.engine import Engine, open_engine
from .engine.health import HealthReport, ReplicaHealth, StageHealth
from .engine.live_events import (
    ResponseDelta,
    ResponseDone,
    ResponseStarted,
    SessionClosed,
    SessionEvent,
)
from .engine.live_rules import Fence
from .engine.live_session import AppendReceipt, Session, SessionStatistics
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
    ResourceUnavailableError,
    SessionBackpressureError,
    SessionClosedError,
    SessionError,
    SessionExistsError,
    SessionLimitError,
    SessionResumeError,
    StageError,
    StageRPCError,
    StageStartError,
    StageStopError,
    StaleFenceError,
)
from .outputs import (
    EngineStatistics,
    OmniOutput,
    ReplicaStatistics,
    ResourceStatistics,
    StageInput,
    StageOutput,
    StageStatistics,
)
from .request.companions import Companion
from .stages.backend import StageBackend

__version__ = "0.1.0"

__all__ = [
    "AppendReceipt",
    "BackendUnavailableError",
    "CollectiveRPCTimeoutError",
    "Companion",
    "ConfigError",
    "DuplicateRequestError",
    "Engine",
    "EngineClosedError",
    "EngineOverloadedError",
    "EngineStatistics",
    "Fence",
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
    "ResourceStatistics",
    "ResourceUnavailableError",
    "ResponseDelta",
    "ResponseDone",
    "ResponseStarted",
    "Session",
    "SessionBackpressureError",
    "SessionClosed",
    "SessionClosedError",
    "SessionError",
    "SessionEvent",
    "SessionExistsError",
    "SessionLimitError",
    "SessionResumeError",
    "SessionStatistics",
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
    "StaleFenceError",
    "load_config",
    "open_engine",
]
