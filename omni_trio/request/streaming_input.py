"""The input side of a request opened with ``streaming_input=True``: :class:`RequestInput`.

Such a request's entry stage does not get its whole input at once: it gets the prompt as a
first segment, then each segment the caller sends (``RequestStream.send_input``), in order,
through a bounded channel (``output_buffer`` segments: a caller sending faster than the stage
reads waits), then a final, empty chunk when the caller ends the input
(``RequestStream.end_input``). The request owns this object; it is closed when the request
ends, however it ends, so a segment sent after that is refused and never starts anything.
"""

from __future__ import annotations

import dataclasses

import trio

from ..errors import InvalidRequestError
from ..outputs import StageInput

__all__ = ["RequestInput"]

_END = StageInput(final=True)


class RequestInput:
    """The caller's end of a streaming-input request's entry-stage input. See the module
    docstring."""

    __slots__ = ("_ended", "_request_id", "_send", "_stage", "receiver")

    def __init__(self, request_id: str, stage_id: str, first: StageInput, size: int) -> None:
        self._request_id = request_id
        self._stage = stage_id
        send, receive = trio.open_memory_channel[StageInput](max(size, 1))
        send.send_nowait(dataclasses.replace(first, final=False))
        self._send = send
        #: what the entry stage reads
        self.receiver = receive
        self._ended = False  # end() was called

    def _refusal(self, why: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"cannot send input to request {self._request_id!r}: {why}; nothing was sent"
        )

    async def send(self, segment: StageInput) -> None:
        """Send one segment to the entry stage, waiting while its channel is full.

        Always checkpoints. Cancelled, the segment was not sent. Raises
        :class:`InvalidRequestError` after :meth:`end`, once the request ended, or when its
        entry stage no longer reads input.
        """
        if self._ended:
            await trio.lowlevel.checkpoint()
            raise self._refusal("its input was ended (end_input)")
        try:
            await self._send.send(dataclasses.replace(segment, final=False))
        except (trio.ClosedResourceError, trio.BrokenResourceError) as exc:
            # refused before any schedule point: take one, as every path does
            await trio.lowlevel.cancel_shielded_checkpoint()
            if isinstance(exc, trio.ClosedResourceError):
                raise self._refusal("the request has ended") from None
            raise self._refusal(f"its entry stage {self._stage!r} no longer reads input") from None

    async def end(self) -> None:
        """End the input: the entry stage gets a final chunk and then the end of its input.

        Always checkpoints; waits while the channel is full. A no-op once ended, or when the
        request ended (its input is over anyway). Cancelled while waiting, the input is
        still ended (closed) so the stage is not left waiting for more.
        """
        if self._ended:
            await trio.lowlevel.checkpoint()
            return
        self._ended = True
        try:
            await self._send.send(_END)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._send.close()

    def close(self) -> None:
        """The request ended: refuse every later segment. Synchronous; idempotent."""
        self._send.close()

    def __repr__(self) -> str:
        state = "ended" if self._ended else "open"
        stats = self._send.statistics()
        return (
            f"<RequestInput {self._request_id!r} -> {self._stage!r} {state} "
            f"buffered={stats.current_buffer_used}/{stats.max_buffer_size}>"
        )
