"""Public value types: what flows between stages and what callers receive.

All of them are immutable. ``token_ids`` and ``text`` are always *deltas*: the new part
produced since the previous output of the same stage for the same request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from ._values import direct_init

__all__ = [
    "EngineStatistics",
    "Metrics",
    "Prompt",
    "SamplingParams",
    "OmniOutput",
    "ReplicaState",
    "ReplicaStatistics",
    "ResourceStatistics",
    "StageInput",
    "StageOutput",
    "StageStatistics",
]

FINISH_ABORT = "abort"

#: One stage's sampling params: a mapping (merged over the stage's defaults) or a backend's
#: own object (a vLLM ``SamplingParams``), passed unchanged.
SamplingParams: TypeAlias = Mapping[str, object] | object
#: A backend's per-output metrics (``prompt_tokens``, ``output_index`` ...).
Metrics: TypeAlias = Mapping[str, object]
#: A request's prompt: text, token ids, or a prompt dict (vLLM's, multimodal data included).
Prompt: TypeAlias = str | Sequence[int] | Mapping[str, object]

#: a replica's life: ``starting`` -> ``ready`` -> (``draining`` while removed) -> ``stopped``;
#: ``dead`` when it failed, ``restarting`` while a replacement (same index) is on its way
ReplicaState = Literal["starting", "ready", "draining", "dead", "restarting", "stopped"]


@direct_init  # made per output or per stage run: see omni_trio._values
@dataclass(frozen=True, slots=True)
class StageInput:
    """One chunk of input to a stage for one request.

    The entry stage receives exactly one chunk built from the prompt. A downstream stage
    receives one chunk (the processed, finished upstream output) or, with
    ``stream_input: true``, one chunk per upstream delta; ``final`` marks the last chunk.
    """

    prompt: str | None = None
    token_ids: tuple[int, ...] = ()
    data: object = None
    final: bool = True
    source: str | None = None

    def __repr__(self) -> str:
        return (
            f"StageInput(prompt={self.prompt!r}, token_ids=<{len(self.token_ids)}>, "
            f"data={type(self.data).__name__}, final={self.final}, source={self.source!r})"
        )


@direct_init  # made per output or per stage run: see omni_trio._values
@dataclass(frozen=True, slots=True)
class StageOutput:
    """One streamed output of a stage backend for one request (a delta)."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    data: object = None
    finished: bool = False
    finish_reason: str | None = None
    metrics: Metrics | None = None


@direct_init  # made per output or per stage run: see omni_trio._values
@dataclass(frozen=True, slots=True)
class OmniOutput:
    """One output delivered to a caller of ``Engine.generate``.

    ``stage_id`` names the stage that produced it and ``stage_index`` its position in the
    pipeline; ``kind`` is the stage's ``output_type`` (text, tokens, audio, image, tensor).
    ``token_ids`` and ``text`` are deltas; ``data`` carries non-text payloads (an audio
    chunk, an image). ``finished`` is true on the last output of that stage; its
    ``finish_reason`` is the backend's ("stop", "length", ...) or ``"abort"``.
    """

    request_id: str
    stage_id: str
    stage_index: int
    kind: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    data: object = None
    finished: bool = False
    finish_reason: str | None = None
    metrics: Metrics | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason == FINISH_ABORT


@dataclass(frozen=True, slots=True)
class ReplicaStatistics:
    """A snapshot of one stage replica."""

    replica: int
    alive: bool
    requests_in_flight: int
    requests_finished: int
    requests_aborted: int
    requests_failed: int
    state: ReplicaState = "ready"
    #: times this replica index was replaced after dying (``restart: on-failure``)
    restarts: int = 0
    #: times this replica index died (after readiness, or a replacement failing to start)
    failures: int = 0
    #: ``"ExcType: message"`` of its last death, or None
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class StageStatistics:
    """A snapshot of one stage: its replicas and the requests bound to it."""

    stage_id: str
    stage_index: int
    backend: str
    requests_in_flight: int
    live_replicas: int
    replicas: tuple[ReplicaStatistics, ...] = ()
    #: requests waiting for a replica (a slot under ``max_in_flight_per_replica``, or a
    #: restarting replica)
    requests_waiting: int = 0


@dataclass(frozen=True, slots=True)
class ResourceStatistics:
    """One resource of the pipeline's ledger (``capacities``, ``resources``): its total and
    what the replicas hold now."""

    resource: str
    capacity: float
    reserved: float


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of an engine session. ``requests_in_flight == 0`` after every request ended
    and every stage shows zero in flight: nothing of any request is left behind."""

    requests_in_flight: int
    requests_finished: int
    requests_aborted: int
    requests_failed: int
    requests_total: int
    closed: bool
    stages: tuple[StageStatistics, ...] = field(default_factory=tuple)
    #: admissions waiting for room under ``max_requests_in_flight`` (``admission: wait``), or
    #: for ``resume()`` while paused; not yet in ``requests_in_flight``
    requests_waiting: int = 0
    #: admission is paused (``engine.pause()``)
    paused: bool = False
    #: live sessions holding a slot (open, detached, or closing until their stages dropped
    #: their requests)
    sessions: int = 0
    #: requests holding a ticket of ``max_requests_in_graph`` (admitted, and their consumer
    #: has neither taken the final output nor left); None without that limit
    requests_in_graph: int | None = None
    #: every resource a stage reserves (``resources:``), its capacity and what is held
    resources: tuple[ResourceStatistics, ...] = ()
    #: of them, detached ones (waiting for a resume)
    sessions_detached: int = 0
    #: live sessions opened since the engine started
    sessions_opened: int = 0

    @property
    def stage_requests_in_flight(self) -> int:
        return sum(s.requests_in_flight for s in self.stages)

    def stage(self, stage_id: str) -> StageStatistics:
        for s in self.stages:
            if s.stage_id == stage_id:
                return s
        raise KeyError(stage_id)
