"""The whole omni-trio exception tree.

Every error omni-trio raises is an instance of :class:`OmniTrioError`. Messages state the
constraint that was broken (which stage, which config path, which request), so that one
line in a log is enough to act on.

```
OmniTrioError
 +-- ConfigError (also ValueError)            a pipeline config is invalid
 +-- InvalidRequestError (also ValueError)    a generate()/abort() argument is invalid
 |    +-- DuplicateRequestError               request_id already in flight
 +-- EngineClosedError                        the engine session has ended
 +-- EngineOverloadedError                    admission limit reached
 +-- StageStartError                          a stage failed or timed out while starting
 |    +-- ResourceUnavailableError            a replica's resources do not fit the capacities
 +-- StageStopError                           a replica's stop failed or overran
 +-- StageError                               a stage failed one request
 |    +-- ReplicaDeadError                    the replica serving the request died
 |    |    +-- NoLiveReplicaError             the stage has no live replica left
 |    +-- StageRPCError                       a collective_rpc call failed in a stage
 +-- CollectiveRPCTimeoutError (also TimeoutError)
 +-- BackendUnavailableError (also ImportError) an optional dependency is missing
 +-- ServerBindError (also OSError)            the HTTP server cannot listen on host:port
 +-- CodecError (also ValueError)             a message for another process cannot be (de)coded
 +-- SessionError                             a live session refused a call
      +-- SessionLimitError                   max_sessions reached (retryable)
      +-- SessionExistsError                  the session id is already open
      +-- SessionClosedError                  the session ended (or this handle was detached)
      +-- SessionBackpressureError            max_pending_input_bytes / max_pending_turns
      +-- StaleFenceError                     an append or cancel for an older epoch or turn
      +-- SessionResumeError                  a resume with a stale token or trimmed events
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .outputs import OmniOutput

__all__ = [
    "BackendUnavailableError",
    "CodecError",
    "CollectiveRPCTimeoutError",
    "ConfigError",
    "DuplicateRequestError",
    "EngineClosedError",
    "EngineOverloadedError",
    "InvalidRequestError",
    "NoLiveReplicaError",
    "OmniTrioError",
    "ReplicaDeadError",
    "ResourceUnavailableError",
    "ServerBindError",
    "SessionBackpressureError",
    "SessionClosedError",
    "SessionError",
    "SessionExistsError",
    "SessionLimitError",
    "SessionResumeError",
    "StageAborted",
    "StageError",
    "StageRPCError",
    "StageStartError",
    "StageStopError",
    "StaleFenceError",
]


class OmniTrioError(Exception):
    """Base class of every error raised by omni-trio."""


class ConfigError(OmniTrioError, ValueError):
    """A pipeline configuration is invalid.

    ``source`` is the file it came from (or ``"<dict>"``), ``path`` the JSON path of the
    offending value (``$.stages[1].inputs``), ``reason`` what is wrong with it.
    """

    def __init__(self, reason: str, *, path: str = "$", source: str | None = None) -> None:
        self.reason = reason
        self.path = path
        self.source = source or "<dict>"
        super().__init__(f"{self.source}: {path}: {reason}")


class InvalidRequestError(OmniTrioError, ValueError):
    """An argument of a request (prompt, sampling params, stage ids) is invalid."""


class DuplicateRequestError(InvalidRequestError):
    """A request with the same ``request_id`` is already in flight."""


class EngineClosedError(OmniTrioError):
    """The engine session has ended (or is ending); it accepts no more work.

    Also raised in the consumer of a request that was still in flight when the engine
    closed, if it had not yet been given a terminal output.
    """


class EngineOverloadedError(OmniTrioError):
    """The engine's admission limit (``max_requests_in_flight``) is reached."""


class StageStartError(OmniTrioError):
    """A stage failed to start, or did not start within its ``stage_init_timeout``."""

    def __init__(self, stage_id: str, reason: str) -> None:
        self.stage_id = stage_id
        self.reason = reason
        super().__init__(f"stage {stage_id!r} failed to start: {reason}")


class ResourceUnavailableError(StageStartError):
    """A replica's declared ``resources`` do not fit in what is left of the pipeline's
    ``capacities``: nothing was started (at ``open_engine``), or the replica was not added
    (``add_replica``). ``replica`` is its index, ``resource`` the name that does not fit,
    ``asked`` one replica's amount of it, ``left`` what the replicas reserved before it left,
    ``capacity`` the pipeline's total."""

    def __init__(
        self,
        stage_id: str,
        reason: str,
        *,
        replica: int,
        resource: str,
        asked: float,
        left: float,
        capacity: float,
    ) -> None:
        self.replica = replica
        self.resource = resource
        self.asked = asked
        self.left = left
        self.capacity = capacity
        super().__init__(stage_id, reason)


class StageStopError(OmniTrioError):
    """One or more stage replicas failed to stop cleanly: their stop raised, or did not
    finish within its ``shutdown_timeout`` (everything else was still stopped).

    ``failures`` holds ``(replica name, cause)`` pairs, e.g. ``("talker[1]", TooSlowError)``;
    raised ``from`` the single cause, or from an ``ExceptionGroup`` of every cause.
    """

    def __init__(self, failures: Sequence[tuple[str, BaseException]]) -> None:
        self.failures: tuple[tuple[str, BaseException], ...] = tuple(failures)
        listed = "; ".join(f"{name}: {type(exc).__name__}: {exc}" for name, exc in self.failures)
        super().__init__(f"{len(self.failures)} replica(s) did not stop cleanly: {listed}")


class StageError(OmniTrioError):
    """A stage failed one request. Only that request is affected.

    ``partial_outputs`` holds the request's outputs so far when raised from
    ``Engine.abort()`` (a stage failed the request while it was being aborted).
    """

    def __init__(
        self,
        message: str,
        *,
        stage_id: str | None = None,
        request_id: str | None = None,
        partial_outputs: Sequence[OmniOutput] = (),
    ) -> None:
        self.stage_id = stage_id
        self.request_id = request_id
        self.partial_outputs: list[OmniOutput] = list(partial_outputs)
        super().__init__(message)


class StageAborted(OmniTrioError):
    """Raised by a replica's ``run_request`` when the request was aborted through the
    replica's ``abort()`` (not by its caller's cancellation): an abort, not a failure."""


class ReplicaDeadError(StageError):
    """The replica serving the request died; the request cannot complete there.

    The engine keeps serving on the stage's other replicas.
    """

    def __init__(
        self,
        message: str,
        *,
        stage_id: str | None = None,
        request_id: str | None = None,
        replica: int | None = None,
    ) -> None:
        self.replica = replica
        super().__init__(message, stage_id=stage_id, request_id=request_id)


class NoLiveReplicaError(ReplicaDeadError):
    """Every replica of a stage is dead; the stage cannot take new requests."""


class StageRPCError(StageError):
    """A ``collective_rpc`` call raised inside a stage replica.

    Raised by a pool ``from`` an ``ExceptionGroup`` of every replica's cause when several
    replicas failed; ``failures`` then holds ``(replica name, cause)`` pairs.
    """

    def __init__(
        self,
        message: str,
        *,
        stage_id: str | None = None,
        request_id: str | None = None,
        failures: Sequence[tuple[str, BaseException]] = (),
    ) -> None:
        self.failures: tuple[tuple[str, BaseException], ...] = tuple(failures)
        super().__init__(message, stage_id=stage_id, request_id=request_id)


class CollectiveRPCTimeoutError(OmniTrioError, TimeoutError):
    """``collective_rpc`` timed out; ``pending`` names the stage replicas that did not answer."""

    def __init__(self, method: str, timeout: float, pending: Sequence[str]) -> None:
        self.method = method
        self.timeout = timeout
        self.pending = tuple(pending)
        super().__init__(
            f"collective_rpc({method!r}) did not complete within {timeout}s; "
            f"no answer from: {', '.join(self.pending)}"
        )


class BackendUnavailableError(OmniTrioError, ImportError):
    """A stage backend needs an optional dependency that is not installed."""


class ServerBindError(OmniTrioError, OSError):
    """The HTTP server cannot listen on ``host:port`` (taken, not an address of this
    machine, no permission). ``errno`` is the operating system's."""

    def __init__(self, host: str, port: int, cause: OSError) -> None:
        self.host = host
        self.port = port
        reason = cause.strerror or str(cause)
        super().__init__(cause.errno, f"cannot listen on {host}:{port}: {reason}")


class CodecError(OmniTrioError, ValueError):
    """A message to or from a replica in another process (a Ray actor) cannot be encoded
    (a value that cannot cross: an unpicklable object) or decoded (malformed bytes, the wrong
    message, a payload that fails to rebuild). ``operation`` is ``"encode"`` or ``"decode"``,
    ``what`` the message (``"inputs"``, ``"outputs"``, ``"context"``, ``"value"``),
    ``reason`` what was wrong. A stage that meets one fails the request it belongs to."""

    def __init__(self, operation: str, what: str, reason: str) -> None:
        self.operation = operation
        self.what = what
        self.reason = reason
        super().__init__(f"cannot {operation} the {what} message: {reason}")


class SessionError(OmniTrioError):
    """A live session (``engine.open_session``) refused a call; nothing was changed."""

    #: whether the same call may succeed later unchanged (a slot frees up)
    retryable: bool = False


class SessionLimitError(SessionError):
    """The engine holds ``sessions.max_sessions`` sessions (closing ones whose stage
    cleanup has not finished included). Retryable: a slot frees when one of them ends."""

    retryable = True


class SessionExistsError(SessionError):
    """A session with this ``session_id`` is open (or detached within its grace)."""


class SessionClosedError(SessionError):
    """The session has ended (closed, expired, engine closed, replica dead), or this handle
    was detached and the session belongs to another one now."""


class SessionBackpressureError(SessionError):
    """An append would go over ``sessions.max_pending_input_bytes`` (one user turn's input)
    or start a turn beyond ``sessions.max_pending_turns`` (turns whose response has not
    ended); nothing was appended."""


class StaleFenceError(SessionError):
    """An append or cancel carried a fence (``epoch``, ``turn_id``) that is not the
    session's current one (a barge-in or a turn's end moved it on); it had no effect."""


class SessionResumeError(SessionError):
    """A resume was refused: an unknown session, one that is not detached, a stale token
    (another resume won, or a later detach issued a new one), or ``last_seq`` older than
    the journal still holds."""
