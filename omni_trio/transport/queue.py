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
``receive`` raise ``trio.EndOfChannel`` once the queue is drained. No polling: senders park on
a ``trio.lowlevel.ParkingLot``, the one receiver is rescheduled directly (a second task
receiving at the same time gets ``trio.BusyResourceError``), each woken by the other side.
"""

from __future__ import annotations

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

    __slots__ = (
        "_closed",
        "_receiver",
        "_full",
        "_head",
        "_items",
        "_receiver_closed",
        "_space",
        "_window",
    )

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._window = window
        # A list read from ``_head`` on (a deque costs ~600 bytes even when empty, and there
        # is one queue per request in flight).
        self._items: list[T] = []
        self._head = 0
        # the one receiver, while it waits for an item (rescheduled directly: no parking lot)
        self._receiver: trio.lowlevel.Task | None = None
        # senders waiting for room, a batch receiver waiting for a full window: created when
        # someone first waits (most queues never need them)
        self._space: trio.lowlevel.ParkingLot | None = None
        self._full: trio.lowlevel.ParkingLot | None = None
        self._closed = False
        self._receiver_closed = False

    def __len__(self) -> int:
        return len(self._items) - self._head

    def _popleft(self) -> T:
        items = self._items
        item = items[self._head]
        self._head += 1
        if self._head == len(items):
            items.clear()
            self._head = 0
        elif self._head >= 64 and self._head * 2 >= len(items):
            del items[: self._head]  # amortized: the read part never outgrows the rest
            self._head = 0
        if self._space:
            self._space.unpark()
        return item

    def _unpark_all(self) -> None:
        self._wake_receiver()
        for lot in (self._space, self._full):
            if lot is not None:
                lot.unpark_all()

    def _wake_receiver(self) -> None:
        task = self._receiver
        if task is not None:
            self._receiver = None
            trio.lowlevel.reschedule(task)

    def _abort_wait(self, _: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        self._receiver = None
        return trio.lowlevel.Abort.SUCCEEDED

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
            if len(self) < self._window:
                break
            if self._space is None:
                self._space = trio.lowlevel.ParkingLot()
            await self._space.park()
            waited = True
        self.send_nowait(item)  # there is room: it queues the item
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()

    def send_nowait(self, item: T) -> None:
        """Queue ``item`` if the window has room. Synchronous. Raises ``trio.WouldBlock``
        when it is full, and the errors of :meth:`send`."""
        if self._receiver_closed:
            raise trio.BrokenResourceError("the consumer closed its side of the queue")
        if self._closed:
            raise trio.ClosedResourceError("the queue's sending side is closed")
        items = self._items
        if len(items) - self._head >= self._window:
            raise trio.WouldBlock
        items.append(item)
        self._wake_receiver()
        if self._full and len(items) - self._head >= self._window:
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
        self._wake_receiver()

    def close(self) -> None:
        """No more items: the receiver gets ``EndOfChannel`` after the queued ones.
        Idempotent; wakes every waiter."""
        self._closed = True
        self._unpark_all()

    # -- receiving side ----------------------------------------------------------------------
    async def receive(self) -> T:
        """The next item. Always checkpoints. Raises ``trio.EndOfChannel`` when the sending
        side closed and every item was received, ``trio.ClosedResourceError`` after
        :meth:`close_receiver`."""
        items = self._items
        if len(items) > self._head and not self._receiver_closed:
            # an item is here: one checkpoint (cancelled there, the item stays queued), then
            # take it
            await trio.lowlevel.checkpoint()
            if len(items) > self._head:
                return self._popleft()
        waited = False
        while len(items) <= self._head:
            if self._receiver_closed:
                if not waited:
                    await trio.lowlevel.checkpoint_if_cancelled()
                raise trio.ClosedResourceError("the queue's receiving side is closed")
            if self._closed:
                if not waited:
                    await trio.lowlevel.checkpoint()
                raise trio.EndOfChannel
            # the usual streaming case, nothing queued yet: park until an item comes or a
            # side closes. Parking is the checkpoint (a pending cancellation is delivered
            # there, and then nothing was taken)
            if self._receiver is not None:
                raise trio.BusyResourceError("another task is already receiving from this queue")
            self._receiver = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
            waited = True
        return self._popleft()

    async def wait_full(self) -> None:
        """Wait until the window is full or the sending side closed (a receiver that takes
        items in batches, not one wake-up per item). Always checkpoints."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if len(self) >= self._window or self._closed or self._receiver_closed:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        if self._full is None:
            self._full = trio.lowlevel.ParkingLot()
        await self._full.park()

    def receive_nowait(self) -> T:
        """The next item without waiting. Synchronous. Raises ``trio.WouldBlock`` when none is
        queued yet, ``trio.EndOfChannel`` when the queue is done."""
        if self._receiver_closed:
            raise trio.ClosedResourceError("the queue's receiving side is closed")
        if len(self):
            return self._popleft()
        if self._closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    def close_receiver(self) -> None:
        """The consumer leaves: queued items are dropped and senders get
        ``BrokenResourceError``. Idempotent."""
        self._receiver_closed = True
        self._items.clear()
        self._head = 0
        self._unpark_all()

    # -- introspection -----------------------------------------------------------------------
    def statistics(self) -> OutputQueueStatistics:
        return OutputQueueStatistics(
            items=len(self),
            window=self._window,
            senders_waiting=len(self._space or ()),
            receiver_waiting=self._receiver is not None,
            closed=self._closed,
            receiver_closed=self._receiver_closed,
        )

    def __repr__(self) -> str:
        state = "receiver-closed" if self._receiver_closed else "closed" if self._closed else "open"
        return (
            f"<OutputQueue {state} items={len(self)}/{self._window} "
            f"senders_waiting={len(self._space or ())}>"
        )
