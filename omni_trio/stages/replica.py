"""Small pieces of a replica's contract: its stop default, its cancellation test, its errors.

:data:`DEFAULT_SHUTDOWN_TIMEOUT` bounds a replica's stop when nothing else does;
:func:`is_cancellation` tells a shutdown (cancellation) from a failure; :func:`death_reason`
is what a replica's crash is recorded as;
:func:`unavailable_error` and :func:`no_live_replica` build the typed errors for a replica
that cannot take work and a stage that has none that can. All pure. :class:`ReplicaView` is
the narrow view of a replica that its request table and RPC calls get.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import trio

from ..errors import NoLiveReplicaError, ReplicaDeadError
from ..failures import single_leaf
from ..outputs import ReplicaState

__all__ = [
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "ReplicaView",
    "death_reason",
    "is_cancellation",
    "no_live_replica",
    "unavailable_error",
]

#: seconds a replica's stop may take when neither the stage nor the pipeline sets one
#: (the default of ``PipelineConfig.shutdown_timeout``)
DEFAULT_SHUTDOWN_TIMEOUT = 30.0


def is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``trio.Cancelled``, or a group of nothing else. Pure."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


def death_reason(exc: Exception) -> Exception:
    """What a replica that crashed with ``exc`` records as its death: the one exception
    inside a group of one (a backend's nursery wraps what its task raised, and the group's
    own message, "Exceptions from Trio nursery", names nothing), else ``exc`` itself. Pure."""
    if isinstance(exc, ExceptionGroup):
        leaf = single_leaf(exc)
        if isinstance(leaf, Exception):
            return leaf
    return exc


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What a replica's request table and RPC calls see of it: its names, whether it is
    alive, why it died (``None`` if it did not), and the error for work it cannot take."""

    stage_id: str
    name: str
    alive: Callable[[], bool]
    death: Callable[[], BaseException | None]
    unavailable: Callable[[str | None], ReplicaDeadError]


def unavailable_error(
    name: str,
    stage_id: str,
    replica: int,
    state: ReplicaState,
    death: BaseException | None,
    request_id: str | None,
) -> ReplicaDeadError:
    """The error for work sent to replica ``name`` that is not ready (``state``; ``death``
    is why a dead one died). Pure."""
    if state == "dead":
        why = f"is dead: {type(death).__name__}: {death}"
    else:
        why = f"is {state}, not ready"
    return ReplicaDeadError(
        f"replica {name} {why}",
        stage_id=stage_id,
        request_id=request_id,
        replica=replica,
    )


def no_live_replica(stage_id: str, request_id: str | None) -> NoLiveReplicaError:
    return NoLiveReplicaError(
        f"stage {stage_id!r} has no live replica", stage_id=stage_id, request_id=request_id
    )
