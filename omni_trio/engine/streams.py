"""``RequestStream``: what ``Engine.generate()`` returns.

It is both an async context manager and an async iterator of
:class:`~omni_trio.outputs.OmniOutput`. The request is admitted when the stream is entered
(or first iterated). Leaving the ``async with`` block before the request ended, or being
cancelled inside it, aborts the request in every stage and waits for that before
``__aexit__`` returns. Plain ``async for`` without ``async with`` also works: cancelled while it
waits for an output, it aborts and waits the same way; breaking out of such a loop aborts the
request when the iterator is finalized (without waiting: only ``async with`` can wait).

The stream holds a narrow :class:`~omni_trio.request.state.RequestHandle` (its outputs, cancel,
cancel-and-wait, status, input); the request itself is owned by the orchestrator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING

import trio

from ..context import RequestContext
from ..errors import InvalidRequestError, OmniTrioError
from ..outputs import OmniOutput, Prompt, StageInput
from ..request.hooks import check_not_spent, remove_artifacts
from ..request.planning import RequestPlan, prompt_to_input
from ..request.state import RequestHandle

if TYPE_CHECKING:
    from .orchestrator import Orchestrator

__all__ = ["RequestStream"]


class RequestStream:
    """The output stream of one request. See the module docstring."""

    # one per request: no instance dict (a tracked object less for the garbage collector)
    __slots__ = (
        "__weakref__",
        "_first",
        "_handle",
        "_in_context",
        "_orchestrator",
        "context",
        "plan",
        "request_id",
    )

    def __init__(
        self,
        orchestrator: Orchestrator,
        request_id: str,
        first_input: StageInput,
        plan: RequestPlan,
        context: RequestContext,
    ) -> None:
        self._orchestrator = orchestrator
        self.request_id = request_id
        self._first = first_input
        self.plan = plan
        self.context = context
        self._handle: RequestHandle | None = None
        self._in_context = False

    async def _admit(self) -> RequestHandle:
        # Check for cancellation, then admit with no checkpoint in between (a cancelled
        # consumer never admits a request, an admitted one always gets to its __aexit__), then
        # a schedule point on every path, refusals included. With room this is synchronous
        # (no task switch before the request starts); without, the admission waits in line,
        # and that wait is the checkpoint: cancelled there, nothing is admitted, and once
        # admitted, submit() returns the handle with no checkpoint in between.
        await trio.lowlevel.checkpoint_if_cancelled()
        handle = self._handle
        if handle is None:
            try:
                check_not_spent(self.context)
                handle = self._orchestrator.submit_nowait(
                    self.request_id, self._first, self.plan, self.context
                )
            except trio.WouldBlock:
                pass
            except OmniTrioError:
                await remove_artifacts(self.context)  # a cancel-shielded checkpoint
                raise
            if handle is None:
                # no room: wait in line (outside the except block: its errors are its own;
                # a request that does not run has its artifacts deleted by submit)
                handle = await self._orchestrator.submit(
                    self.request_id, self._first, self.plan, self.context
                )
                self._handle = handle
                return handle
            self._handle = handle
        await trio.lowlevel.cancel_shielded_checkpoint()
        return handle

    @property
    def status(self) -> str:
        """``pending`` (not admitted yet), ``running``, ``finished``, ``aborted`` or ``failed``."""
        return "pending" if self._handle is None else self._handle.status

    async def __aenter__(self) -> RequestStream:
        """Admit the request; at ``max_requests_in_flight`` (or while the engine is paused)
        it waits first-in first-out under ``admission: wait``. Always checkpoints: cancelled
        before admission (also while waiting), nothing is admitted and nothing stays queued;
        once admitted, ``__aexit__`` is guaranteed to run. Aborted while it waits
        (``engine.abort``, ``engine.abort_nowait``, :meth:`abort` from another task), the
        request never runs: this returns, and the stream yields one ``finish_reason="abort"``
        terminal per output stage, then ends (its status is ``aborted``). Raises
        EngineClosedError (also when the engine closes while it waits),
        EngineOverloadedError (``admission: reject`` at the limit or paused, or
        ``max_waiting`` admissions already wait), DuplicateRequestError."""
        await self._admit()
        self._in_context = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Abort the request if it still runs and wait, shielded, until every stage dropped
        it. Always checkpoints."""
        self._in_context = False
        await self._leave()

    async def _leave(self) -> None:
        handle = self._handle
        if handle is None:
            await trio.lowlevel.checkpoint()
            return
        handle.close_receiver()
        await handle.cancel_and_wait()

    async def receive(self) -> OmniOutput:
        """The next output (a stage's terminal ``finished`` output included). Always
        checkpoints. Raises ``trio.EndOfChannel`` after the last one, or the request's error
        (a :class:`~omni_trio.errors.StageError` ...) if it failed. Outside ``async with``,
        cancelling it aborts the request and waits until every stage dropped it."""
        handle = self._handle if self._handle is not None else await self._admit()
        try:
            return await handle.next_output()
        except StopAsyncIteration:
            raise trio.EndOfChannel from None
        except trio.Cancelled:
            if not self._in_context:
                await self._leave()
            raise

    async def abort(self) -> list[OmniOutput]:
        """Abort this request and wait until every stage dropped it; its outputs so far.

        A request waiting for admission (its stream being entered in another task) leaves
        the queue at once and never runs: ``[]``, and its consumer reads one abort terminal
        per output stage. A stream not entered yet: a no-op, ``[]``. Always checkpoints.
        Cancelled before the abort is committed, nothing happens; once committed, the abort
        completes in the background whatever happens to the caller: cancelling the caller
        ends its wait (``trio.Cancelled``), not the abort. Raises the request's
        :class:`~omni_trio.errors.StageError` (with ``exc.partial_outputs``) if a stage
        failed it, even while it was being aborted."""
        if self._handle is None:
            return await self._orchestrator.abort_waiting(self.request_id, self.context)
        return await self._handle.abort()

    async def interact(self, payload: object) -> bool:
        """Deliver a control payload to this request's entry-stage backend, in order (see
        :mod:`~omni_trio.request.interactions`; e.g. ``{"stop": True}`` for a scripted stage).
        Returns ``True`` once the backend accepted it, ``False`` if the request ended or its
        entry stage is done with it; waits while the request has not reached its entry stage.

        Always checkpoints; cancelled before the backend accepted it, nothing was delivered.
        Raises :class:`InvalidRequestError` if the stream was not entered (``async with``) or
        iterated yet, or if the entry stage's backend takes no interactions (naming it).
        """
        if self._handle is None:
            await trio.lowlevel.checkpoint()
            raise InvalidRequestError(
                f"request {self.request_id!r} is not admitted yet: enter its stream "
                "(`async with engine.generate(...) as stream`) before interact()"
            )
        return await self._orchestrator.interact(self.request_id, payload, handle=self._handle)

    async def send_input(self, segment: Prompt) -> None:
        """Send one more input segment (text, token ids or a prompt dict, like a prompt) to
        the entry stage of a request opened with ``streaming_input=True``; the stage gets the
        segments in order. Waits while the stage is not keeping up (a bounded channel).

        Always checkpoints; cancelled, the segment was not sent. Raises
        :class:`InvalidRequestError` for a bad segment, a stream opened without
        ``streaming_input=True``, a stream not entered yet, after :meth:`end_input`, or once
        the request ended (nothing is sent, and nothing new starts).
        """
        try:
            chunk = prompt_to_input(segment)
            if self._handle is None:
                raise InvalidRequestError(
                    f"request {self.request_id!r} is not admitted yet: enter its stream "
                    "(async with) before sending input"
                )
        except InvalidRequestError:
            await trio.lowlevel.checkpoint()
            raise
        await self._handle.send_input(chunk)

    async def end_input(self) -> None:
        """End the input of a ``streaming_input`` request: the entry stage gets the end of
        its input. Always checkpoints; a no-op when repeated, after the request ended, or on
        a stream without ``streaming_input``. Raises :class:`InvalidRequestError` before the
        stream is entered."""
        if self._handle is None:
            await trio.lowlevel.checkpoint()
            raise InvalidRequestError(
                f"request {self.request_id!r} is not admitted yet: enter its stream first"
            )
        await self._handle.end_input()

    async def collect(self) -> list[OmniOutput]:
        """Read every remaining output into a list. Always checkpoints; raises the request's
        error. Outside ``async with`` it behaves as if inside one: cancelling it aborts the
        request everywhere before it returns."""
        if self._in_context:
            return [out async for out in self]
        async with self:
            return [out async for out in self]

    def __aiter__(self) -> AsyncIterator[OmniOutput]:
        handle = self._handle
        if self._in_context and handle is not None:
            # inside `async with`, leaving the block is what ends the request: the iterator
            # needs no finalizer, so it is the request's own (no async generator and no
            # frame of its own per output)
            return handle.outputs()
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[OmniOutput]:
        try:
            while True:
                try:
                    out = await self.receive()
                except trio.EndOfChannel:
                    return
                yield out
        finally:
            # a plain `async for` that stopped early: trio finalizes this generator, and the
            # request must not keep running for nobody (finalizers cannot wait: async with
            # can); its consumer is gone, so its ticket goes back
            if not self._in_context and self._handle is not None:
                self._handle.cancel()
                self._handle.close_receiver()

    def __repr__(self) -> str:
        return (
            f"<RequestStream {self.request_id!r} {self.status} outputs={list(self.plan.outputs)}>"
        )
