"""Waiting for a request's run on a stage to start or end, without polling.

An interaction for a request that is admitted but not yet running on its entry stage (its task
has not started, or it waits for a replica) waits here until a replica of that stage starts
running it, or its run there ended. Replicas report both (``StageBackend.run_request``) through
:func:`notify_run`, which costs one truthiness check per request while nobody waits.

A watch is keyed by the identity of the request's :class:`~omni_trio.context.RequestContext`
(one object per request, alive while anyone waits on it: the waiter holds it) and the stage id,
so requests with the same id in two engines of one process (each in its own thread) never
share a watch: a watch is only ever set from the trio run its waiter runs in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import trio

if TYPE_CHECKING:
    from ..context import RequestContext

__all__ = ["RunEvent", "notify_run", "wait_run"]

#: what happened to a watched run
RunEvent = Literal["started", "ended"]


class _Watch:
    __slots__ = ("event", "what")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.what: RunEvent = "started"


#: (id of a request's context, stage id) -> its watch, while someone waits
_watches: dict[tuple[int, str], _Watch] = {}


def notify_run(
    context: RequestContext | None, stage_id: str, request_id: str, what: RunEvent
) -> None:
    """A replica of ``stage_id`` started or ended running ``request_id``: wake whoever waits for
    that request's run there. Synchronous; a dictionary check when nobody waits."""
    if not _watches or context is None or request_id != context.request_id:
        return
    watch = _watches.pop((id(context), stage_id), None)
    if watch is not None:
        watch.what = what
        watch.event.set()


async def wait_run(context: RequestContext, stage_id: str) -> RunEvent:
    """Wait until a replica of ``stage_id`` starts or ends running the request ``context``
    belongs to; which of the two happened. Always checkpoints; cancellable (nothing stays
    registered). The caller checks the request's state first: this waits for a change."""
    key = (id(context), stage_id)
    watch = _watches.get(key)
    if watch is None:
        watch = _watches[key] = _Watch()
    try:
        await watch.event.wait()
    finally:
        if (
            _watches.get(key) is watch
            and not watch.event.is_set()
            and watch.event.statistics().tasks_waiting == 0
        ):
            del _watches[key]
    return watch.what


def watched() -> int:
    """How many request runs are watched now (tests check nothing is left). Synchronous."""
    return len(_watches)
