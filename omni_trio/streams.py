"""``RequestStream``: what ``Engine.generate()`` returns.

It is both an async context manager and an async iterator of
:class:`~omni_trio.outputs.OmniOutput`. The request is admitted when the stream is entered
(or first iterated). Leaving the ``async with`` block before the request finished, or being
cancelled inside it, aborts the request in every stage and waits for that before
``__aexit__`` returns. Plain ``async for`` without ``async with`` also works; breaking out
of such a loop aborts the request when the iterator is finalized (fire-and-forget).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import trio

from .outputs import OmniOutput, StageInput

if TYPE_CHECKING:
    from .orchestrator import Orchestrator, RequestPlan, RequestState

__all__ = ["RequestStream"]


class RequestStream:
    """The output stream of one request. See the module docstring."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        request_id: str,
        first_input: StageInput,
        plan: RequestPlan,
        params: dict[str, Any],
    ) -> None:
        self._orch = orchestrator
        self.request_id = request_id
        self._first = first_input
        self.plan = plan
        self._params = params
        self._state: RequestState | None = None
        self._receive: trio.MemoryReceiveChannel[OmniOutput] | None = None
        self._tail: list[OmniOutput] | None = None
        self._in_context = False

    def _ensure_started(self) -> trio.MemoryReceiveChannel[OmniOutput]:
        if self._receive is None:
            self._state, self._receive = self._orch.submit(
                self.request_id, self._first, self.plan, self._params
            )
        return self._receive

    @property
    def status(self) -> str:
        """``pending`` (not admitted yet), ``running``, ``finished``, ``aborted`` or ``failed``."""
        return "pending" if self._state is None else self._state.status

    async def __aenter__(self) -> RequestStream:
        self._ensure_started()
        self._in_context = True
        await trio.lowlevel.checkpoint()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._in_context = False
        state = self._state
        if self._receive is not None:
            self._receive.close()
        if state is not None and not state.done.is_set():
            state.scope.cancel()
            # shielded: the abort must be complete in every stage before we return, even
            # when we are here because our own task was cancelled
            with trio.CancelScope(shield=True):
                await state.done.wait()

    async def receive(self) -> OmniOutput:
        """The next output. Checkpoints. Raises ``trio.EndOfChannel`` after the last one, or
        the request's error (a :class:`~omni_trio.errors.StageError` ...) if it failed."""
        receive = self._ensure_started()
        try:
            return await receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return await self._after_last_output()

    async def _after_last_output(self) -> OmniOutput:
        # the channel is done: then come the abort terminals, then the error or the end
        state = self._state
        assert state is not None
        await state.done.wait()
        if self._tail is None:
            self._tail = list(state.tail)
        if self._tail:
            return self._tail.pop(0)
        if state.error is not None:
            raise state.error
        raise trio.EndOfChannel

    async def abort(self) -> list[OmniOutput]:
        """Abort this request; returns its outputs so far. Checkpoints."""
        return await self._orch.abort(self.request_id)

    async def collect(self) -> list[OmniOutput]:
        """Read every remaining output into a list. Checkpoints; raises the request's error.

        Outside ``async with`` it behaves as if inside one: cancelling it aborts the request
        everywhere before it returns."""
        if self._in_context:
            return [out async for out in self]
        async with self:
            return [out async for out in self]

    def __aiter__(self) -> AsyncIterator[OmniOutput]:
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
            # a plain `async for` that stopped early: trio finalizes this generator, and
            # the request must not keep running for nobody
            state = self._state
            if not self._in_context and state is not None and not state.done.is_set():
                state.scope.cancel()

    def __repr__(self) -> str:
        return (
            f"<RequestStream {self.request_id!r} {self.status} outputs={list(self.plan.outputs)}>"
        )
