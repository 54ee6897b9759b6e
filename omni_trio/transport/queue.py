"""``OutputQueue``: one request's outputs on their way to its consumer.

A single-producer-side, single-consumer queue on one trio loop with a *window*: ``send``
waits while ``window`` ordinary items are unread (a consumer that does not read slows the
stages down), while ``send_final_nowait`` never waits. The final items (a request's terminal
outputs, or its error) go through the same queue as every other output, after them, and can
always be delivered: a request can end, and leave the orchestrator, even when its consumer
stopped reading. There are at most a handful of final items per request (one per output
stage, or one error), so the queue stays bounded.

Closing the receiving side (:meth:`OutputQueue.close_receiver`) makes every ``send`` raise
``trio.BrokenResourceError``; closing the sending side (:meth:`OutputQueue.close`) makes
``receive`` raise ``trio.EndOfChannel`` once the queue is drained. No polling: waiters park on
``trio.lowlevel.ParkingLot`` and are woken by the other side.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

import trio

__all__ = ["OutputQueue", "OutputQueueStatistics"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class OutputQueueStatistics:
    """A snapshot of an :class:`OutputQueue`."""

    items: int
    window: int
    senders_waiting: int
    receiver_waiting: bool
    closed: bool
    receiver_closed: bool


class OutputQueue(Generic[T]):
    """See the module docstring."""

    __slots__ = ("_closed", "_data", "_full", "_items", "_receiver_closed", "_space", "_window")

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._window = window
        self._items: deque[T] = deque()
        self._data = trio.lowlevel.ParkingLot()  # the receiver waits here for items
        self._space = trio.lowlevel.ParkingLot()  # senders wait here for room
        self._full = trio.lowlevel.ParkingLot()  # a batch receiver waits for a full window
        self._closed = False
        self._receiver_closed = False

    # -- sending side ------------------------------------------------------------------------
    async def send(self, item: T) -> None:
        """Queue ``item``, waiting while the window is full. Always checkpoints; cancellation
        before the item is queued leaves the queue unchanged.

        Raises ``trio.BrokenResourceError`` if the receiver closed, ``trio.ClosedResourceError``
        if the sending side was closed."""
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            if self._receiver_closed:
                raise trio.BrokenResourceError("the consumer closed its side of the queue")
            if self._closed:
                raise trio.ClosedResourceError("the queue's sending side is closed")
            if len(self._items) < self._window:
                break
            await self._space.park()
            waited = True
        self._items.append(item)
        if self._data:  # a waiting receiver (unpark itself costs even when nobody waits)
            self._data.unpark()
        if self._full and len(self._items) >= self._window:
            self._full.unpark()
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()

    def send_nowait(self, item: T) -> None:
        """Queue ``item`` if the window has room. Synchronous. Raises ``trio.WouldBlock``
        when it is full, and the errors of :meth:`send`."""
        if self._receiver_closed:
            raise trio.BrokenResourceError("the consumer closed its side of the queue")
        if self._closed:
            raise trio.ClosedResourceError("the queue's sending side is closed")
        if len(self._items) >= self._window:
            raise trio.WouldBlock
        self._items.append(item)
        if self._data:
            self._data.unpark()
        if self._full and len(self._items) >= self._window:
            self._full.unpark()

    def send_final_nowait(self, item: T) -> None:
        """Queue a final item past the window (never waits). Synchronous. Dropped when the
        receiver is gone (nobody can read it). Raises ``trio.ClosedResourceError`` after
        :meth:`close`."""
        if self._closed:
            raise trio.ClosedResourceError("the queue's sending side is closed")
        if self._receiver_closed:
            return
        self._items.append(item)
        if self._data:
            self._data.unpark()

    def close(self) -> None:
        """No more items: the receiver gets ``EndOfChannel`` after the queued ones.
        Idempotent; wakes every waiter."""
        self._closed = True
        self._data.unpark_all()
        self._space.unpark_all()
        self._full.unpark_all()

    # -- receiving side ----------------------------------------------------------------------
    async def receive(self) -> T:
        """The next item. Always checkpoints. Raises ``trio.EndOfChannel`` when the sending
        side closed and every item was received, ``trio.ClosedResourceError`` after
        :meth:`close_receiver`."""
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while not self._items:
            if self._receiver_closed:
                raise trio.ClosedResourceError("the queue's receiving side is closed")
            if self._closed:
                if not waited:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                raise trio.EndOfChannel
            await self._data.park()
            waited = True
        item = self._items.popleft()
        if self._space:
            self._space.unpark()
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return item

    async def wait_full(self) -> None:
        """Wait until the window is full or the sending side closed (a receiver that takes
        items in batches, not one wake-up per item). Always checkpoints."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if len(self._items) >= self._window or self._closed or self._receiver_closed:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        await self._full.park()

    def receive_nowait(self) -> T:
        """The next item without waiting. Synchronous. Raises ``trio.WouldBlock`` when none is
        queued yet, ``trio.EndOfChannel`` when the queue is done."""
        if self._receiver_closed:
            raise trio.ClosedResourceError("the queue's receiving side is closed")
        if self._items:
            item = self._items.popleft()
            if self._space:
                self._space.unpark()
            return item
        if self._closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    def close_receiver(self) -> None:
        """The consumer leaves: queued items are dropped and senders get
        ``BrokenResourceError``. Idempotent."""
        self._receiver_closed = True
        self._items.clear()
        self._data.unpark_all()
        self._space.unpark_all()
        self._full.unpark_all()

    # -- introspection -----------------------------------------------------------------------
    def statistics(self) -> OutputQueueStatistics:
        return OutputQueueStatistics(
            items=len(self._items),
            window=self._window,
            senders_waiting=len(self._space),
            receiver_waiting=len(self._data) > 0,
            closed=self._closed,
            receiver_closed=self._receiver_closed,
        )

    def __repr__(self) -> str:
        state = "receiver-closed" if self._receiver_closed else "closed" if self._closed else "open"
        return (
            f"<OutputQueue {state} items={len(self._items)}/{self._window} "
            f"senders_waiting={len(self._space)}>"
        )
