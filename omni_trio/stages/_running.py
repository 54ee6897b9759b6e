"""One request running on one replica: its record, the emit contract, and how it ended.

:class:`RunningRequest` is what a replica keeps per request (its cancel scope, whether its
finished output was delivered) and enforces the backend contract on every emit: nothing
after the finished output. The outputs themselves are kept once, by the request core that
receives them (``engine.abort()`` returns them). :func:`request_outcome` decides, purely, how
the request ended once the backend returned or raised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import trio

from ..errors import StageError

if TYPE_CHECKING:
    from ..context import RequestContext
from ..outputs import StageOutput
from .emit import Emit, EmitNowait, Emitter, nowait_of

__all__ = ["RequestOutcome", "RunningRequest", "request_outcome"]

RequestOutcome = Literal["violation", "dead", "error", "finished", "aborted"]


def request_outcome(
    *, violated: bool, failed: bool, cancelled: bool, finished: bool, dead: bool
) -> RequestOutcome:
    """How a request ended on a replica, once its backend call returned or raised. Pure.

    ``violated``: the backend emitted after the finished output (a broken contract, always a
    failure); ``failed``: the backend raised; ``cancelled``: the request's own scope was
    cancelled (``abort()`` or replica death); ``finished``: its finished output was delivered;
    ``dead``: the replica died. A cancellation that lands after the finished output was
    delivered does not undo it: the request finished.
    """
    if violated:
        return "violation"
    if failed:
        return "dead" if dead else "error"
    if cancelled and not finished:
        return "dead" if dead else "aborted"
    return "finished"


class RunningRequest:
    """A request in flight on one replica (``replica`` names it in errors)."""

    __slots__ = (
        "_done",
        "_downstream",
        "_emit",
        "cancelled",
        "context",
        "ended",
        "finished",
        "replica",
        "request_id",
        "scope",
        "stage_id",
        "streamed",
        "text",
        "violation",
    )

    def __init__(
        self,
        request_id: str,
        stage_id: str,
        replica: str,
        *,
        streamed: bool = True,
        text: bool = True,
        context: RequestContext | None = None,
    ):
        self.request_id = request_id
        self.stage_id = stage_id
        self.replica = replica
        self.scope = trio.CancelScope()
        #: :meth:`cancel` was called (abort or replica death; a plain flag, where the scope's
        #: ``cancel_called`` reads the clock)
        self.cancelled = False
        #: the finished output was delivered
        self.finished = False
        self.violation: StageError | None = None
        #: whether anyone needs the outputs as they come (else the finished one is enough)
        self.streamed = streamed
        #: whether anyone reads the outputs' text (else token ids are enough)
        self.text = text
        #: the request's context (original prompt, sampling params, options), if given
        self.context = context
        #: the backend call returned or raised
        self.ended = False
        self._done: trio.Event | None = None  # created by the first waiter (abort())
        # what emitter() wraps (slots and bound methods: a request holds no closures)
        self._emit: Emit | None = None
        self._downstream: EmitNowait | None = None

    def cancel(self) -> None:
        """Cancel the backend's call (abort, replica death). Synchronous."""
        self.cancelled = True
        self.scope.cancel()

    def end(self) -> None:
        """The backend call is over: wake whoever waits in :meth:`wait_ended`. Synchronous."""
        self.ended = True
        if self._done is not None:
            self._done.set()

    async def wait_ended(self) -> None:
        """Wait until :meth:`end`. Always checkpoints."""
        if self._done is None:
            self._done = trio.Event()
        if self.ended:
            self._done.set()
        await self._done.wait()

    def emitter(self, emit: Emit) -> Emitter:
        """The ``emit`` the backend gets: passes each output on and notes when the finished
        one was delivered; an output after the finished one is not passed on but raises (and
        is kept as ``violation``, so a backend that swallows the error still fails the
        request). Its ``nowait`` passes an output to ``emit``'s own fast path, and refuses
        (``False``, nothing delivered) after the finished output, once the request's scope
        was cancelled, or when ``emit`` has no fast path. Once per request: it wraps the one
        ``emit``."""
        self._emit = emit
        self._downstream = nowait_of(emit)
        if self._downstream is None:
            return Emitter(self._record)
        return Emitter(self._record, self._record_nowait)

    async def _record(self, out: StageOutput) -> None:
        if self.finished:
            self.violation = StageError(
                f"replica {self.replica} of stage {self.stage_id!r} broke the backend "
                f"contract: it emitted an output for request {self.request_id!r} after "
                f"its finished output",
                stage_id=self.stage_id,
                request_id=self.request_id,
            )
            raise self.violation
        assert self._emit is not None
        await self._emit(out)
        # only once delivered: an emit cancelled midway did not deliver it
        self.finished = out.finished

    def _record_nowait(self, out: StageOutput) -> bool:
        # the awaited emit handles every refusal (it raises the violation, it is cancelled);
        # the fast path only ever delivers
        downstream = self._downstream
        if self.finished or self.cancelled or downstream is None or not downstream(out):
            return False
        self.finished = out.finished
        return True
