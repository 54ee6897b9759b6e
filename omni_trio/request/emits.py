"""The ``emit`` a stage's backend gets, for each place its outputs go (see
:mod:`omni_trio.request.run`).

- :func:`pulled_emitter`: an output stage that feeds no other stage. Its outputs go straight
  into the request's bounded queue (:meth:`Request.send_output
  <omni_trio.request.state.Request.send_output>`); the queue's window is the backpressure.
- :class:`CollectEmit`: a stage whose outputs nobody needs as they come. They are recorded
  (the request keeps every output); the stage's run hands them on once the backend
  returned.
- :class:`OutboxEmit`: any other stage. Its outputs fill the stage's bounded outbox, which
  its routing task empties.
- :class:`FirstOutputEmit`: around either of the first two while observers that need no
  routing watch: notes when the stage's first output came (the run tells them once the
  stage ended, out of the backend's call stack).

Each is an :class:`~omni_trio.stages.emit.Emitter` (``emit`` awaited, its ``nowait`` the
fast path) over bound methods: a request in flight holds no closures and no cells. The fast
path only ever delivers: it refuses (``False``, nothing changed) whenever the awaited
``emit`` would do anything else (wait, abort). None checks the backend contract (nothing
after the finished output): the replica that runs the request does, before any of them sees
an output.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import trio

from ..outputs import StageOutput
from ..stages.emit import Emitter
from ..transport.queue import OutputQueue
from .state import Request

__all__ = ["CollectEmit", "FirstOutputEmit", "OutboxEmit", "pulled_emitter"]


def pulled_emitter(req: Request, sid: str) -> Emitter:
    """The emit of output stage ``sid`` that feeds no other stage: the request's own
    :meth:`~omni_trio.request.state.Request.send_output` (the consumer builds each
    OmniOutput when it reads it), its fast path
    :meth:`~omni_trio.request.state.Request.send_output_nowait`. Synchronous."""
    return Emitter(partial(req.send_output, sid), partial(req.send_output_nowait, sid))


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
        req = self._req
        if req.stopping:
            return False
        req.record(self._sid, out)
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
        if self._req.stopping:
            return False
        try:
            self._outbox.send_nowait(out)
        except (trio.WouldBlock, trio.ClosedResourceError):
            return False
        return True


class FirstOutputEmit:
    """Wraps a stage's emitter: notes the clock when its first output was delivered."""

    __slots__ = ("_clock", "_inner", "first", "since")

    def __init__(self, inner: Emitter, clock: Callable[[], float], since: int) -> None:
        self._inner = inner
        self._clock = clock
        #: when the first output was delivered, or None
        self.first: float | None = None
        #: the request's outputs before the stage's first (``Request.stage_outputs``)
        self.since = since

    def emitter(self) -> Emitter:
        """The Emitter over :meth:`emit` and :meth:`emit_nowait`. Synchronous."""
        return Emitter(self.emit, self.emit_nowait)

    async def emit(self, out: StageOutput) -> None:
        """The inner emit (it may wait)."""
        await self._inner(out)
        if self.first is None:
            self.first = self._clock()

    def emit_nowait(self, out: StageOutput) -> bool:
        """The inner fast path. Synchronous."""
        if not self._inner.nowait(out):
            return False
        if self.first is None:
            self.first = self._clock()
        return True
