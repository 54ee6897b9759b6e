"""The ``emit`` a stage's backend gets, for each place its outputs go (see
:mod:`omni_trio.request.run`), and :func:`deliver`, which puts one into the consumer's queue.

- :class:`PulledEmit`: an output stage that feeds no other stage. Its outputs go straight
  into the request's bounded queue; the queue's window is the backpressure.
- :class:`CollectEmit`: a stage whose outputs nobody needs as they come. They are recorded
  and kept; the stage's run hands them on once the backend returned.
- :class:`OutboxEmit`: any other stage. Its outputs fill the stage's bounded outbox, which
  its routing task empties.

Each is one slotted object per request-stage whose bound methods go into an
:class:`~omni_trio.stages.emit.Emitter` (``emit`` awaited, ``emit_nowait`` its fast path):
a request in flight holds no closures and no cells. ``emit_nowait`` only ever delivers: it
refuses (``False``, nothing changed) whenever the awaited ``emit`` would do anything else
(wait, abort, raise the contract violation).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from ..outputs import StageOutput
from ..stages.emit import Emitter
from ..transport.queue import OutputQueue
from .state import Request

__all__ = ["CollectEmit", "OutboxEmit", "PulledEmit", "Record", "deliver"]

#: the runner's record of one output of a stage (lifecycle, outputs kept for abort):
#: ``record(req, sid, out) -> (sid, out)``; raises StageError naming the replica on a
#: contract violation
Record = Callable[[Request, str, StageOutput], tuple[str, StageOutput]]


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

    __slots__ = ("_record", "_req", "_sid")

    def __init__(self, record: Record, req: Request, sid: str) -> None:
        self._record = record
        self._req = req
        self._sid = sid

    def emitter(self) -> Emitter:
        """The Emitter over :meth:`emit` and :meth:`emit_nowait`. Synchronous."""
        return Emitter(self.emit, self.emit_nowait)

    async def emit(self, out: StageOutput) -> None:
        """Record ``out`` and queue it; waits only when the window is full (see
        :func:`deliver`). Raises StageError for an output after the stage's finished one."""
        req = self._req
        item = self._record(req, self._sid, out)
        try:
            req.queue.send_nowait(item)  # the usual case, room in the window: no coroutine
        except (trio.WouldBlock, trio.BrokenResourceError):
            await deliver(req, item)

    def emit_nowait(self, out: StageOutput) -> bool:
        """Into the window if it has room, and only when :meth:`emit` would do just that (no
        abort, failure, violation). Synchronous."""
        req = self._req
        sid = self._sid
        lifecycle = req.lifecycle
        if lifecycle.abort_requested or lifecycle.failed or lifecycle.stage_finished(sid):
            return False
        try:
            req.queue.send_nowait((sid, out))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        # the record, inlined: the stage had not finished, so the lifecycle only needs to hear
        # of a finished output
        if out.finished:
            lifecycle.stage_output(sid, True)
        req.keep(sid, out)
        return True


class CollectEmit:
    """The emit of a stage whose outputs nobody needs as they come: records each output and
    keeps it in :attr:`outs`, for the stage's run to hand on once the backend returned."""

    __slots__ = ("_record", "_req", "_sid", "outs")

    def __init__(self, record: Record, req: Request, sid: str) -> None:
        self._record = record
        self._req = req
        self._sid = sid
        #: the outputs so far, in order
        self.outs: list[StageOutput] = []

    def emitter(self) -> Emitter:
        """The Emitter over :meth:`emit` and :meth:`emit_nowait`. Synchronous."""
        return Emitter(self.emit, self.emit_nowait)

    async def emit(self, out: StageOutput) -> None:
        """Record and keep ``out``. Never checkpoints (nothing waits). Raises StageError for
        an output after the stage's finished one."""
        self.outs.append(self._record(self._req, self._sid, out)[1])

    def emit_nowait(self, out: StageOutput) -> bool:
        """:meth:`emit`, unless the request is being aborted or failed or the stage already
        finished (then the awaited emit raises the violation, or is cancelled). Synchronous."""
        lifecycle = self._req.lifecycle
        if lifecycle.abort_requested or lifecycle.failed or lifecycle.stage_finished(self._sid):
            return False
        self.outs.append(self._record(self._req, self._sid, out)[1])
        return True


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
