"""The ``emit`` a stage's backend gets, for each place its outputs go (see
:mod:`omni_trio.request.run`), and :func:`deliver`, which puts one into the consumer's queue.

- :class:`PulledEmit`: an output stage that feeds no other stage. Its outputs go straight
  into the request's bounded queue; the queue's window is the backpressure.
- :class:`CollectEmit`: a stage whose outputs nobody needs as they come. They are recorded
  (the request keeps every output); the stage's run hands them on once the backend
  returned.
- :class:`OutboxEmit`: any other stage. Its outputs fill the stage's bounded outbox, which
  its routing task empties.

Each is one slotted object per request-stage whose bound methods go into an
:class:`~omni_trio.stages.emit.Emitter` (``emit`` awaited, ``emit_nowait`` its fast path):
a request in flight holds no closures and no cells. ``emit_nowait`` only ever delivers: it
refuses (``False``, nothing changed) whenever the awaited ``emit`` would do anything else
(wait, abort). None checks the backend contract (nothing after the finished output): the
replica that runs the request does, before any of them sees an output.
"""

from __future__ import annotations

import trio

from ..outputs import StageOutput
from ..stages.emit import Emitter
from ..transport.queue import OutputQueue
from .state import Request

__all__ = ["CollectEmit", "OutboxEmit", "PulledEmit", "deliver"]


async def deliver(req: Request, item: tuple[str, StageOutput]) -> None:
    """Put a recorded output into the request's queue for the consumer. Checkpoints only
    when the window is full or the consumer left (which is an abort).

    A stage's finished output never waits for the window: the lifecycle already counts the
    stage finished, so it must reach the consumer even if the request is cancelled now (a
    cancelled wait would leave that stage with no finished output at all). It costs at most
    one item per output stage past the window.
    """
    queue = req.queue
    try:
        try:
            queue.send_nowait(item)
        except trio.WouldBlock:
            if item[1].finished:
                queue.send_final_nowait(item)
            else:
                await queue.send(item)
    except trio.BrokenResourceError:
        # the consumer stopped listening: that is an abort
        req.request_abort()
        await trio.lowlevel.checkpoint()


class PulledEmit:
    """The emit of an output stage that feeds no other stage: into the request's queue, as
    emitted (the consumer builds each OmniOutput when it reads it)."""

    __slots__ = ("_req", "_sid")

    def __init__(self, req: Request, sid: str) -> None:
        self._req = req
        self._sid = sid

    def emitter(self) -> Emitter:
        """The Emitter over :meth:`emit` and :meth:`emit_nowait`. Synchronous."""
        return Emitter(self.emit, self.emit_nowait)

    async def emit(self, out: StageOutput) -> None:
        """Record ``out`` and queue it; waits only when the window is full (see
        :func:`deliver`)."""
        req = self._req
        sid = self._sid
        req.record(sid, out)
        item = (sid, out)
        try:
            req.queue.send_nowait(item)  # the usual case, room in the window: no coroutine
        except (trio.WouldBlock, trio.BrokenResourceError):
            await deliver(req, item)

    def emit_nowait(self, out: StageOutput) -> bool:
        """Into the window if it has room, and only when :meth:`emit` would do just that (no
        abort or failure under way). Synchronous."""
        req = self._req
        sid = self._sid
        lifecycle = req.lifecycle
        if lifecycle.abort_requested or lifecycle.failed:
            return False
        try:
            req.queue.send_nowait((sid, out))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        req.record(sid, out)
        return True


class CollectEmit:
    """The emit of a stage whose outputs nobody needs as they come: records each output (the
    request keeps it), for the stage's run to hand them on once the backend returned."""

    __slots__ = ("_req", "_sid", "_since")

    def __init__(self, req: Request, sid: str) -> None:
        self._req = req
        self._sid = sid
        # the request's outputs before this stage's first: its own are among the later ones
        self._since = req.n_produced

    def emitter(self) -> Emitter:
        """The Emitter over :meth:`emit` and :meth:`emit_nowait`. Synchronous."""
        return Emitter(self.emit, self.emit_nowait)

    async def emit(self, out: StageOutput) -> None:
        """Record ``out``. Never checkpoints (nothing waits)."""
        self._req.record(self._sid, out)

    def emit_nowait(self, out: StageOutput) -> bool:
        """:meth:`emit`, unless the request is being aborted or failed (then the awaited emit
        is cancelled). Synchronous."""
        lifecycle = self._req.lifecycle
        if lifecycle.abort_requested or lifecycle.failed:
            return False
        self._req.record(self._sid, out)
        return True

    def outputs(self) -> list[StageOutput]:
        """The stage's outputs so far, in order. Synchronous."""
        return self._req.stage_outputs(self._sid, self._since)


class OutboxEmit:
    """The emit of a stage with a routing task: into the stage's bounded outbox, which the
    routing task empties (the orchestrator's code, never the backend's call stack)."""

    __slots__ = ("_outbox", "_req")

    def __init__(self, req: Request, outbox: OutputQueue[StageOutput]) -> None:
        self._req = req
        self._outbox = outbox

    def emitter(self) -> Emitter:
        """The Emitter over :meth:`emit` and :meth:`emit_nowait`. Synchronous."""
        return Emitter(self.emit, self.emit_nowait)

    async def emit(self, out: StageOutput) -> None:
        """Into the outbox; with room it does not even yield, else it waits for room."""
        try:
            self._outbox.send_nowait(out)
        except trio.WouldBlock:
            await self._outbox.send(out)

    def emit_nowait(self, out: StageOutput) -> bool:
        """Into the outbox if it has room and the request is neither aborting nor failed.
        Synchronous."""
        lifecycle = self._req.lifecycle
        if lifecycle.abort_requested or lifecycle.failed:
            return False
        try:
            self._outbox.send_nowait(out)
        except (trio.WouldBlock, trio.ClosedResourceError):
            return False
        return True
