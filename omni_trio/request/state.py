"""One admitted request: its state (:class:`Request`, owned by the orchestrator) and the
consumer's narrow :class:`RequestHandle` on it; and a request still waiting for admission
(:class:`WaitingRequest`), which an abort takes out of the queue.

A :class:`Request` changes only through its own methods: a stage's output is recorded
(:meth:`Request.record`: kept, once, for ``abort()``; the lifecycle notes a finished stage)
and queued for the consumer (:meth:`Request.send_output`, :meth:`Request.deliver`), who reads
it (:meth:`Request.next_output`); an abort is requested (:meth:`Request.request_abort`), a
stage fails it (:meth:`Request.fail`), its task ends (:meth:`Request.end`, which decides the
outcome with the pure :class:`~omni_trio.request.lifecycle.RequestLifecycle` and queues the
terminal outputs or the error to the consumer, through the same queue as every other output).
"Cancel and wait until every stage dropped it" is written once,
:meth:`Request.cancel_and_wait` (shielded: leaving a stream keeps that promise); an abort's
own wait (:meth:`Request.aborted`) is the caller's to cancel, and the abort, once committed,
completes in the request's own task either way.

A request admitted under ``max_requests_in_graph`` holds its ticket's release: it is
called once, when the consumer is done with the request (it took the final item, the
request ended and nothing is left to read; or it left, :meth:`Request.close_receiver`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AbstractContextManager

import outcome
import trio

from ..context import RequestContext
from ..errors import InvalidRequestError, OmniTrioError, StageError
from ..failures import request_error
from ..observer import ObserverSet
from ..outputs import FINISH_ABORT, OmniOutput, SamplingParams, StageInput, StageOutput
from ..transport.queue import OutputQueue
from .feeds import StageInputs, WholeInput
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
    """Everything the orchestrator holds for one request; dropped when its task ends.

    Its state is private: the request core and the consumer change it only through the
    methods below, each as cheap as the code it replaced on the paths every output takes.
    """

    __slots__ = (
        "_context",
        "_convert",
        "_done",
        "_ended",
        "_error",
        "_first_input",
        "_input",
        "_kept_inputs",
        "_lifecycle",
        "_observers",
        "_plan",
        "_produced",
        "_queue",
        "_scope",
        "_stage_params",
        "_ticket",
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
        ticket: Callable[[], None] | None = None,
        observers: ObserverSet | None = None,
    ) -> None:
        # told of an abort request and of a stage's failure (tracing), when any watch
        self._observers = observers
        # (request id, stage id, StageOutput) -> the OmniOutput a caller gets
        self._convert = convert
        self._plan = plan
        self._first_input = first_input
        self._context = context
        # the entry stage's input, sent in segments by the caller (``streaming_input``)
        self._input = streamed_input
        self._lifecycle = RequestLifecycle(request_id, plan.outputs)
        self._lifecycle.start()
        # the consumer's queue: every output, terminal or error it reads
        self._queue: OutputQueue[_Item] = OutputQueue(window)
        # the request's stages run in it: an abort cancels it
        self._scope = trio.CancelScope()
        # every stage's outputs so far, in the order they came (``abort()`` returns them),
        # flat: stage id, output, stage id, output... (no pair per output); created by the
        # first one
        self._produced: list[str | StageOutput] | None = None
        self._ended = False
        self._done: trio.Event | None = None  # created by the first waiter
        self._error: BaseException | None = None  # set when the request ends failed
        # a prefill stage's whole input, kept for its decode stage (request/pd.py), and the
        # params a stage runs with when they were set after the request was made
        self._kept_inputs: dict[str, StageInput] | None = None
        self._stage_params: dict[str, SamplingParams] | None = None
        # releases the request's max_requests_in_graph ticket: called once, when the
        # consumer is done (None: no ticket, or released)
        self._ticket = ticket

    # -- what it is (set once) -----------------------------------------------------------------
    @property
    def request_id(self) -> str:
        return self._lifecycle.request_id

    @property
    def plan(self) -> RequestPlan:
        """Its route: the stages it runs on, their outputs' destinations."""
        return self._plan

    @property
    def context(self) -> RequestContext:
        """What it carries (prompt, sampling params, options, companions, artifacts)."""
        return self._context

    def sampling_params(self, stage_id: str) -> SamplingParams:
        """Stage ``stage_id``'s sampling params: those :meth:`set_stage_params` set, else the
        context's. Synchronous."""
        if self._stage_params is not None and stage_id in self._stage_params:
            return self._stage_params[stage_id]
        return self._context.sampling_params[stage_id]

    def set_stage_params(self, stage_id: str, params: SamplingParams) -> None:
        """Run stage ``stage_id`` (not started yet) with ``params``, which only its upstream
        stages' outputs could decide (a decode stage's ``kv_transfer_params``); the
        context keeps the params the request was made with. Synchronous."""
        if self._stage_params is None:
            self._stage_params = {}
        self._stage_params[stage_id] = params

    @property
    def first_input(self) -> StageInput:
        """The entry stages' input, as the request was made with it (its first segment, with
        ``streaming_input``)."""
        return self._first_input

    def keep_input(self, stage_id: str, chunk: StageInput) -> None:
        """Keep stage ``stage_id``'s whole input for a later stage (:meth:`kept_input`).
        Synchronous."""
        if self._kept_inputs is None:
            self._kept_inputs = {}
        self._kept_inputs[stage_id] = chunk

    def kept_input(self, stage_id: str) -> StageInput | None:
        """The input :meth:`keep_input` kept for stage ``stage_id``, or None. Synchronous."""
        return None if self._kept_inputs is None else self._kept_inputs.get(stage_id)

    def entry_input(self) -> StageInputs:
        """What an entry stage reads: the prompt whole, or (``streaming_input``) the segments
        the caller sends. Synchronous; for the one entry stage run."""
        streamed = self._input
        return WholeInput(self._first_input) if streamed is None else streamed.receiver

    def run_scope(self) -> AbstractContextManager[object]:
        """The cancel scope its stages run in (entered once, by its task): an abort or a
        failure cancels it. Synchronous."""
        return self._scope

    # -- where it is -------------------------------------------------------------------------
    @property
    def status(self) -> RequestStatus:
        return self._lifecycle.status

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def failed(self) -> bool:
        """A stage failed it (it will end ``failed``)."""
        return self._lifecycle.failed

    @property
    def stopping(self) -> bool:
        """An abort was requested or a stage failed it: its stages are being cancelled."""
        lifecycle = self._lifecycle
        return lifecycle.abort_requested or lifecycle.failed

    def stage_finished(self, stage_id: str) -> bool:
        """Whether stage ``stage_id`` delivered its finished output. Synchronous."""
        return self._lifecycle.stage_finished(stage_id)

    @property
    def n_produced(self) -> int:
        """How many outputs the stages produced so far."""
        return len(self._produced or ()) // 2

    def _ended_event(self) -> trio.Event:
        if self._done is None:
            self._done = trio.Event()
            if self._ended:
                self._done.set()
        return self._done

    # -- transitions -------------------------------------------------------------------------
    def request_abort(self) -> None:
        """Abort: cancel the request's scope. Synchronous; a no-op once it ended."""
        if self._lifecycle.request_abort():
            if self._observers:
                self._observers.emit("abort_requested", self.request_id)
            self._scope.cancel()

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
        if self._lifecycle.abort_requested:
            logger.warning(
                "request %r failed in stage %r while being aborted: %r",
                self.request_id,
                stage_id,
                error,
            )
        self._lifecycle.fail(error)
        if self._observers:
            self._observers.emit("stage_error", self.request_id, stage_id, error)
        self._scope.cancel()

    def record(self, stage_id: str, out: StageOutput) -> None:
        """Note an output of stage ``stage_id``: kept for :meth:`abort`, and the stage counts
        finished once it is its finished output. Synchronous."""
        if out.finished:
            self._lifecycle.finish_stage(stage_id)
        produced = self._produced
        if produced is None:
            self._produced = [stage_id, out]
        else:
            produced.append(stage_id)
            produced.append(out)

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
        convert, rid = self._convert, self.request_id
        out: list[OmniOutput] = []
        for i in range(0, len(flat), 2):
            sid, stage_out = flat[i], flat[i + 1]
            assert isinstance(sid, str) and isinstance(stage_out, StageOutput)
            out.append(convert(rid, sid, stage_out))
        return out

    # -- its outputs to the consumer -----------------------------------------------------------
    async def send_output(self, stage_id: str, out: StageOutput) -> None:
        """Record an output of stage ``stage_id`` and queue it for the consumer (see
        :meth:`deliver`). With room in the window it does not even yield (no coroutine but
        its own)."""
        self.record(stage_id, out)
        try:
            self._queue.send_nowait((stage_id, out))
        except (trio.WouldBlock, trio.BrokenResourceError):
            await self.deliver(stage_id, out)

    def send_output_nowait(self, stage_id: str, out: StageOutput) -> bool:
        """:meth:`send_output` if the window has room and no abort or failure is under way,
        else ``False`` (nothing changed: the awaited one decides). Synchronous."""
        if self.stopping:
            return False
        try:
            self._queue.send_nowait((stage_id, out))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        self.record(stage_id, out)
        return True

    async def deliver(self, stage_id: str, out: StageOutput) -> None:
        """Queue an output of stage ``stage_id`` (:meth:`record` noted it) for the consumer.
        Checkpoints only when the window is full or the consumer left (which is an abort).

        A stage's finished output never waits for the window: the lifecycle already counts
        the stage finished, so it must reach the consumer even if the request is cancelled
        now (a cancelled wait would leave that stage with no finished output at all). It
        costs at most one item per output stage past the window.
        """
        item = (stage_id, out)
        queue = self._queue
        try:
            try:
                queue.send_nowait(item)
            except trio.WouldBlock:
                if out.finished:
                    queue.send_final_nowait(item)
                else:
                    await queue.send(item)
        except trio.BrokenResourceError:
            # the consumer stopped listening: that is an abort
            self.request_abort()
            await trio.lowlevel.checkpoint()

    async def next_output(self) -> OmniOutput:
        """The next output the consumer gets, terminals included. Always checkpoints. Raises
        ``StopAsyncIteration`` after the last one (the async iterator protocol), or the
        request's error if it failed. Taking the last item releases the request's ticket."""
        try:
            item = await self._queue.receive()
        except trio.EndOfChannel:
            self._consumer_done()
            raise StopAsyncIteration from None
        if self._ticket is not None and self._ended and not len(self._queue):
            self._consumer_done()  # the final item: nothing is left to take
        if type(item) is tuple:
            return self._convert(self._lifecycle.request_id, item[0], item[1])
        if isinstance(item, outcome.Error):
            item.unwrap()
        assert isinstance(item, OmniOutput)
        return item

    def close_receiver(self) -> None:
        """The consumer stops reading: later outputs are dropped, and a stage delivering one
        finds the consumer gone, which aborts the request; its ticket is released.
        Synchronous."""
        self._queue.close_receiver()
        self._consumer_done()

    def _consumer_done(self) -> None:
        # the consumer took the final item or left: the ticket goes back, once
        release, self._ticket = self._ticket, None
        if release is not None:
            release()

    # -- its input from the consumer -------------------------------------------------------------
    async def send_input(self, segment: StageInput) -> None:
        """See :meth:`RequestInput.send`. Raises InvalidRequestError for a request opened
        without ``streaming_input``."""
        streamed = self._input
        if streamed is None:
            await trio.lowlevel.checkpoint()
            raise InvalidRequestError(
                f"request {self.request_id!r} was opened without streaming_input=True: "
                "its input is the prompt"
            )
        await streamed.send(segment)

    async def end_input(self) -> None:
        """See :meth:`RequestInput.end`; a no-op without ``streaming_input``."""
        streamed = self._input
        if streamed is None:
            await trio.lowlevel.checkpoint()
            return
        await streamed.end()

    # -- its end ---------------------------------------------------------------------------
    def end(self) -> RequestStatus:
        """The request's task ended: decide its status, queue its terminal outputs (an aborted
        request: one per output stage without its own) or its error (a failed one), end the
        queue, and wake everyone waiting on it. Synchronous; returns the status."""
        status = self._lifecycle.end()
        if status == "failed":
            self._error = request_error(self.request_id, self._lifecycle.errors)
            self._queue.send_final_nowait(outcome.Error(self._error))
        elif status == "aborted":
            rid, convert = self.request_id, self._convert
            for sid in self._lifecycle.abort_terminals():
                self._queue.send_final_nowait(convert(rid, sid, _ABORTED))
        self._queue.close()
        if self._input is not None:
            self._input.close()  # a segment sent from now on is refused
        self._ended = True
        if self._done is not None:
            self._done.set()
        return status

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
        if self._ended:
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
            f"<Request {self.request_id!r} {self._lifecycle.status} "
            f"stages={list(self._plan.active)} outputs={self.n_produced}>"
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
        return self._req.status

    def next_output(self) -> Coroutine[object, object, OmniOutput]:
        """The request's :meth:`Request.next_output`: await what this returns (a coroutine,
        as if this were an ``async def``: no frame of the handle's own per output)."""
        return self._req.next_output()

    def outputs(self) -> AsyncIterator[OmniOutput]:
        """The request's outputs as an async iterator: each ``__anext__`` is
        :meth:`Request.next_output` itself (always a checkpoint). It has no finalizer:
        whoever iterates ends the request (a stream's ``async with``). Synchronous."""
        return _Outputs(self._req.next_output)

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
        """See :meth:`Request.send_input`."""
        await self._req.send_input(segment)

    async def end_input(self) -> None:
        """See :meth:`Request.end_input`."""
        await self._req.end_input()

    def refers_to(self, request: Request) -> bool:
        """Whether this handle is on ``request`` (not on a later one with the same id).
        Synchronous."""
        return self._req is request

    def close_receiver(self) -> None:
        """See :meth:`Request.close_receiver`."""
        self._req.close_receiver()

    def __repr__(self) -> str:
        return f"<RequestHandle {self._req!r}>"


class _Outputs(AsyncIterator[OmniOutput]):
    """An async iterator whose ``__anext__`` is the request's ``next_output`` (no frame of
    its own per output)."""

    __slots__ = ("_next",)

    def __init__(self, next_output: Callable[[], Awaitable[OmniOutput]]) -> None:
        self._next = next_output

    def __aiter__(self) -> _Outputs:
        return self

    def __anext__(self) -> Awaitable[OmniOutput]:
        return self._next()
