"""Interactions: control payloads for a live request, delivered to its entry-stage backend.

``await engine.interact(request_id, payload)`` and ``await stream.interact(payload)`` hand a
payload to the replica the request runs on in its entry stage (the first stage of its route
that takes the prompt), through ``StageBackend.interact``. What a payload means is the
backend's business: the ``scripted`` backend finishes the request on ``{"stop": True}`` and
records everything; a backend without an ``_interact`` hook refuses with
:class:`~omni_trio.errors.InvalidRequestError` naming the stage.

Delivered means accepted: the call returns once the backend's hook returned, in the caller's
task. In order: one request's interactions are delivered one at a time, first come first
served (a fair lock per request, created on first use and dropped when nobody holds or waits
for it), so two calls from one task arrive in that order, and so do calls from several tasks
in the order they began. A request that is admitted but not running on its entry stage yet
(its task has not started, or it waits for a replica) is waited for, event-driven
(:mod:`~omni_trio.stages.watch`), until it runs there; the payload is not queued anywhere
meanwhile, so cancelling the call leaves nothing behind. A request that ended, or whose entry
stage is done with it (finished, or its run there ended), takes no more: the call returns
``False``.
"""

from __future__ import annotations

from collections.abc import Mapping

import trio

from ..stages.backend import StageBackend
from ..stages.pool import StagePool
from ..stages.watch import wait_run
from .state import Request

__all__ = ["Interactions"]


class Interactions:
    """Delivers one engine's interactions (owned by the orchestrator). See the module
    docstring."""

    def __init__(self, pools: Mapping[str, StagePool]) -> None:
        self._pools = pools
        self._locks: dict[str, trio.Lock] = {}

    def entry_stage(self, req: Request) -> str:
        """The stage a request's interactions go to: the first entry stage of its route.
        Synchronous, pure."""
        return req.plan.entries[0]

    async def deliver(self, req: Request, payload: object) -> bool:
        """Deliver ``payload`` to ``req``'s entry-stage backend, after every interaction
        already on its way to it; whether it was delivered (``False``: the request ended or
        its entry stage is done with it).

        Always checkpoints. Cancelled while it waits (for its turn, or for the request to
        reach its entry stage), nothing is delivered. Raises what ``StageBackend.interact``
        raises (:class:`~omni_trio.errors.InvalidRequestError` for a backend that takes no
        interactions, naming the stage).
        """
        rid = req.request_id
        lock = self._locks.get(rid)
        if lock is None:
            lock = self._locks[rid] = trio.Lock()
        try:
            async with lock:  # fair: first come, first delivered
                backend = await self._entry_replica(req)
                if backend is None:
                    return False
                return await backend.interact(rid, payload)
        finally:
            if (
                self._locks.get(rid) is lock
                and not lock.locked()
                and lock.statistics().tasks_waiting == 0
            ):
                del self._locks[rid]

    async def _entry_replica(self, req: Request) -> StageBackend | None:
        """The replica running ``req`` on its entry stage, waiting until it runs there;
        ``None`` if it never will (again). Checkpoints only while it waits."""
        sid = self.entry_stage(req)
        pool = self._pools[sid]
        rid = req.request_id
        while True:
            backend = pool.replica_of(rid)
            if backend is not None and backend.has_request(rid):
                return backend
            if req.ended or req.stage_finished(sid):
                return None
            if await self._wait_run(req, sid) != "started":
                return None  # its run there ended (or the request did) before we saw it

    @staticmethod
    async def _wait_run(req: Request, sid: str) -> str:
        """Wait until ``req``'s run on stage ``sid`` starts or ends, or the request ends
        (``"request ended"``). Always checkpoints."""
        what = "request ended"
        async with trio.open_nursery() as nursery:

            async def until_ended() -> None:
                await req.wait_ended()
                nursery.cancel_scope.cancel()

            nursery.start_soon(until_ended)
            what = await wait_run(req.context, sid)
            nursery.cancel_scope.cancel()
        return what

    @property
    def pending(self) -> int:
        """How many requests have interactions on their way now. Synchronous."""
        return len(self._locks)

    def __repr__(self) -> str:
        return f"<Interactions pending={len(self._locks)}>"
