"""One admitted request: its state (:class:`Request`, owned by the orchestrator) and the
consumer's narrow :class:`RequestHandle` on it; and a request still waiting for admission
(:class:`WaitingRequest`), which an abort takes out of the queue.

A :class:`Request` changes only through its own methods: an abort is requested
(:meth:`Request.request_abort`), a stage fails it (:meth:`Request.fail`), its task ends
(:meth:`Request.end`, which decides the outcome with the pure
:class:`~omni_trio.request.lifecycle.RequestLifecycle` and queues the terminal outputs or the error
to the consumer, through the same queue as every other output). "Cancel and wait until every
stage dropped it" is written once, :meth:`Request.cancel_and_wait` (shielded: leaving a stream
keeps that promise); an abort's own wait (:meth:`Request.aborted`) is the caller's to cancel,
and the abort, once committed, completes in the request's own task either way.
"""

from __future__ import annotations

import logging
import math

import outcome
import trio

from ..context import RequestContext
from ..errors import InvalidRequestError, OmniTrioError, StageError
from ..failures import request_error
from ..outputs import FINISH_ABORT, OmniOutput, StageInput, StageOutput
from ..transport.queue import OutputQueue
from .lifecycle import RequestLifecycle, RequestStatus
from .output_builder import Convert
from .planning import RequestPlan
from .streaming_input import RequestInput

__all__ = ["Request", "RequestHandle", "WaitingRequest"]

logger = logging.getLogger(__name__)

_ABORTED = StageOutput(finished=True, finish_reason=FINISH_ABORT)

#: a stage's output as the backend emitted it, with the stage's id
StageItem = tuple[str, StageOutput]
#: what the consumer's queue carries: outputs (routed, or as a stage emitted them, turned into
#: OmniOutputs when read), terminals, or the request's error
_Item = OmniOutput | StageItem | outcome.Error


class Request:
    """Everything the orchestrator holds for one request; dropped when its task ends."""

    __slots__ = (
        "convert",
        "context",
        "input",
        "_done",
        "_ended",
        "_error",
        "first_input",
        "lifecycle",
        "params",
        "_produced",
        "plan",
        "queue",
        "scope",
    )

    def __init__(
        self,
        request_id: str,
        plan: RequestPlan,
        first_input: StageInput,
        context: RequestContext,
        window: int,
        convert: Convert,
        streamed_input: RequestInput | None = None,
    ) -> None:
        #: (request id, stage id, StageOutput) -> the OmniOutput a caller gets; set once
        self.convert = convert
        self.plan = plan
        self.first_input = first_input
        self.context = context
        #: the entry stage's input, sent in segments by the caller (``streaming_input``)
        self.input = streamed_input
        #: every stage's sampling params (the context's, read per stage run)
        self.params = context.sampling_params
        self.lifecycle = RequestLifecycle(request_id, plan.outputs)
        self.lifecycle.start()
        self.queue: OutputQueue[_Item] = OutputQueue(window)
        self.scope = trio.CancelScope()
        # every stage's outputs so far, in the order they came (``abort()`` returns them),
        # flat: stage id, output, stage id, output... (no pair per output); created by the
        # first one
        self._produced: list[str | StageOutput] | None = None
        self._ended = False
        self._done: trio.Event | None = None  # created by the first waiter
        self._error: BaseException | None = None  # set when the request ends failed

    @property
    def request_id(self) -> str:
        return self.lifecycle.request_id

    @property
    def ended(self) -> bool:
        return self._ended

    def _ended_event(self) -> trio.Event:
        if self._done is None:
            self._done = trio.Event()
            if self._ended:
                self._done.set()
        return self._done

    # -- transitions -------------------------------------------------------------------------
    def request_abort(self) -> None:
        """Abort: cancel the request's scope. Synchronous; a no-op once it ended."""
        if self.lifecycle.request_abort():
            self.scope.cancel()

    def fail(self, stage_id: str, exc: BaseException) -> None:
        """Record a request-scoped failure of stage ``stage_id`` and cancel the request.
        Synchronous. An error while the request is being aborted is logged here too: it
        fails the request instead of vanishing into the abort."""
        if isinstance(exc, StageError):
            exc.request_id = exc.request_id or self.request_id
            exc.stage_id = exc.stage_id or stage_id
            error: BaseException = exc
        elif isinstance(exc, OmniTrioError):
            error = exc
        else:
            error = StageError(
                f"stage {stage_id!r} failed request {self.request_id!r}: "
                f"{type(exc).__name__}: {exc}",
                stage_id=stage_id,
                request_id=self.request_id,
            )
            error.__cause__ = exc
        if self.lifecycle.abort_requested:
            logger.warning(
                "request %r failed in stage %r while being aborted: %r",
                self.request_id,
                stage_id,
                error,
            )
        self.lifecycle.fail(error)
        self.scope.cancel()

    def record(self, stage_id: str, out: StageOutput) -> None:
        """Note an output of stage ``stage_id``: kept for :meth:`abort`, and the stage counts
        finished once it is its finished output. Synchronous."""
        if out.finished:
            self.lifecycle.finish_stage(stage_id)
        produced = self._produced
        if produced is None:
            self._produced = [stage_id, out]
        else:
            produced.append(stage_id)
            produced.append(out)

    @property
    def n_produced(self) -> int:
        """How many outputs the stages produced so far."""
        return len(self._produced or ()) // 2

    def stage_outputs(self, stage_id: str, since: int = 0) -> list[StageOutput]:
        """Stage ``stage_id``'s outputs among those produced after the first ``since`` (an
        :attr:`n_produced` taken before the stage's first output: the search then covers only
        what came while the stage ran), in order. Synchronous."""
        flat = self._produced or []
        return [
            out
            for i in range(2 * since, len(flat), 2)
            if flat[i] == stage_id and isinstance(out := flat[i + 1], StageOutput)
        ]

    def produced(self) -> list[OmniOutput]:
        """Every stage's outputs so far as OmniOutputs, in the order they came. Synchronous."""
        flat = self._produced or []
        convert, rid = self.convert, self.lifecycle.request_id
        out: list[OmniOutput] = []
        for i in range(0, len(flat), 2):
            sid, stage_out = flat[i], flat[i + 1]
            assert isinstance(sid, str) and isinstance(stage_out, StageOutput)
            out.append(convert(rid, sid, stage_out))
        return out

    def output(self, item: StageItem) -> OmniOutput:
        """The OmniOutput a caller gets for a stage's output. Synchronous, pure."""
        return self.convert(self.lifecycle.request_id, item[0], item[1])

    def end(self) -> RequestStatus:
        """The request's task ended: decide its status, queue its terminal outputs (an aborted
        request: one per output stage without its own) or its error (a failed one), end the
        queue, and wake everyone waiting on it. Synchronous; returns the status."""
        status = self.lifecycle.end()
        if status == "failed":
            self._error = request_error(self.request_id, self.lifecycle.errors)
            self.queue.send_final_nowait(outcome.Error(self._error))
        elif status == "aborted":
            for sid in self.lifecycle.abort_terminals():
                self.queue.send_final_nowait(self.output((sid, _ABORTED)))
        self.queue.close()
        if self.input is not None:
            self.input.close()  # a segment sent from now on is refused
        self._ended = True
        if self._done is not None:
            self._done.set()
        return status

    # -- waiting -----------------------------------------------------------------------------
    async def wait_ended(self) -> None:
        """Wait until the request ended (every stage dropped it). Always checkpoints."""
        await self._ended_event().wait()

    async def cancel_and_wait(self) -> None:
        """Abort the request (if it still runs) and wait, shielded, until every stage dropped
        it. Always checkpoints; not cancellable (bounded by the stages' abort)."""
        self.request_abort()
        if self._ended and trio.current_effective_deadline() != -math.inf:
            # the usual case, an ended request and a caller not cancelled: a cancellation
            # point that cannot raise, then a schedule point that cannot be cancelled, without
            # a shielded scope (three times cheaper)
            await trio.lowlevel.checkpoint_if_cancelled()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        with trio.CancelScope(shield=True):
            await self._ended_event().wait()

    async def abort(self) -> list[OmniOutput]:
        """Abort and wait until every stage dropped the request; the outputs so far (``[]``
        if it had ended already).

        Always checkpoints. Cancelled before the abort is committed: nothing happens. Once
        committed, the abort completes in the request's own task whatever happens to the
        caller: cancelling the caller ends only its wait (see :meth:`aborted`). Raises the
        request's :class:`StageError` (with ``exc.partial_outputs``) if a stage failed it,
        even while it was being aborted.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.ended:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return []
        self.request_abort()
        return await self.aborted()

    async def aborted(self) -> list[OmniOutput]:
        """Wait until the request ended (an abort was committed: :meth:`request_abort`); its
        outputs so far.

        Always checkpoints. Cancelled, it raises ``trio.Cancelled`` and the request goes on
        ending in its own task (a stage's slow abort cleanup does not hold the caller past
        its deadline). Raises the request's :class:`StageError` (with
        ``exc.partial_outputs``) if a stage failed it, even while it was being aborted.
        """
        await self._ended_event().wait()
        produced = self.produced()
        error = self._error
        if error is None:
            return produced
        if isinstance(error, StageError):
            error.partial_outputs = produced
            raise error
        raise StageError(
            f"request {self.request_id!r} failed while being aborted: {error}",
            request_id=self.request_id,
            partial_outputs=produced,
        ) from error

    def __repr__(self) -> str:
        return (
            f"<Request {self.request_id!r} {self.lifecycle.status} "
            f"stages={list(self.plan.active)} outputs={self.n_produced}>"
        )


class WaitingRequest:
    """A request waiting for admission (``admission: wait`` at ``max_requests_in_flight``,
    or paused), held by the orchestrator while it waits. Its wait runs in :attr:`scope`: an
    abort (:meth:`request_abort`) cancels that scope, which takes the request out of the
    admission queue at once; it then never runs, and ends as an aborted request."""

    __slots__ = ("_left", "context", "scope")

    def __init__(self, context: RequestContext) -> None:
        #: the waiting request's context: tells it from a later request with the same id
        self.context = context
        #: the scope of its admission wait (only an abort cancels it)
        self.scope = trio.CancelScope()
        self._left = trio.Event()

    @property
    def request_id(self) -> str:
        return self.context.request_id

    def request_abort(self) -> None:
        """Abort: end the wait; the request never runs. Synchronous; a no-op once it left
        the queue another way (admitted, refused, cancelled)."""
        self.scope.cancel()

    def leave(self) -> None:
        """It is done waiting: admitted, ended aborted, refused or cancelled. Synchronous."""
        self._left.set()

    async def aborted(self) -> list[OmniOutput]:
        """Wait until it left (an abort was committed: :meth:`request_abort`); ``[]``, the
        request never ran. Always checkpoints; cancelled, it raises ``trio.Cancelled``."""
        await self._left.wait()
        return []

    def __repr__(self) -> str:
        state = "left" if self._left.is_set() else "waiting"
        abort = " abort-requested" if self.scope.cancel_called else ""
        return f"<WaitingRequest {self.request_id!r} {state}{abort}>"


class RequestHandle:
    """The consumer's narrow handle on one admitted request (see ``RequestStream``)."""

    __slots__ = ("_req",)

    def __init__(self, request: Request) -> None:
        self._req = request

    @property
    def request_id(self) -> str:
        return self._req.request_id

    @property
    def status(self) -> RequestStatus:
        return self._req.lifecycle.status

    async def receive(self) -> OmniOutput:
        """The next output, terminals included. Always checkpoints. Raises
        ``trio.EndOfChannel`` after the last one, or the request's error if it failed."""
        req = self._req
        item = await req.queue.receive()
        if type(item) is tuple:
            return req.output(item)
        if isinstance(item, outcome.Error):
            item.unwrap()
        assert isinstance(item, OmniOutput)
        return item

    async def next_output(self) -> OmniOutput:
        """:meth:`receive` for the async iterator protocol: ``StopAsyncIteration`` (not
        ``trio.EndOfChannel``) after the last output. Always checkpoints."""
        req = self._req
        try:
            item = await req.queue.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        if type(item) is tuple:
            # req.output(item), inlined: once per output
            return req.convert(req.lifecycle.request_id, item[0], item[1])
        if isinstance(item, outcome.Error):
            item.unwrap()
        assert isinstance(item, OmniOutput)
        return item

    def cancel(self) -> None:
        """Abort the request without waiting. Synchronous; a no-op once it ended."""
        self._req.request_abort()

    async def cancel_and_wait(self) -> None:
        """See :meth:`Request.cancel_and_wait`."""
        await self._req.cancel_and_wait()

    async def abort(self) -> list[OmniOutput]:
        """See :meth:`Request.abort`."""
        return await self._req.abort()

    async def send_input(self, segment: StageInput) -> None:
        """See :meth:`RequestInput.send`. Raises InvalidRequestError for a request opened
        without ``streaming_input``."""
        streamed = self._req.input
        if streamed is None:
            await trio.lowlevel.checkpoint()
            raise InvalidRequestError(
                f"request {self.request_id!r} was opened without streaming_input=True: "
                "its input is the prompt"
            )
        await streamed.send(segment)

    async def end_input(self) -> None:
        """See :meth:`RequestInput.end`; a no-op without ``streaming_input``."""
        streamed = self._req.input
        if streamed is None:
            await trio.lowlevel.checkpoint()
            return
        await streamed.end()

    def refers_to(self, request: Request) -> bool:
        """Whether this handle is on ``request`` (not on a later one with the same id).
        Synchronous."""
        return self._req is request

    def close_receiver(self) -> None:
        """The consumer stops reading: later outputs are dropped, and a stage delivering one
        finds the consumer gone, which aborts the request. Synchronous."""
        self._req.queue.close_receiver()

    def __repr__(self) -> str:
        return f"<RequestHandle {self._req!r}>"
