"""A bounded, event-driven, one-way channel between two trio loops (it replaces janus).

``open_bridge()`` returns a :class:`BridgeSender` and a :class:`BridgeReceiver`. Each end
binds to the trio loop of the thread that first sends or receives on it, and is native to
that loop: a task that must wait parks on a :class:`trio.lowlevel.ParkingLot` of its own
loop, and the other side wakes it with ``TrioToken.run_sync_soon`` (``trio.from_thread``
refuses to run inside a thread that runs its own ``trio.run``). Both ends may live on the
same loop; then wake-ups are direct calls.

Flow control is a credit window of ``max_buffer`` items: the sender may have at most that
many items sent but not yet received. A sender that runs out of credit waits; the receiver
hands credit back in batches (a quarter of the window, or all of it once it has drained
everything), so a saturated stream costs one cross-thread wake-up per batch, not per item.
The receiver is only woken when it is actually waiting. Nothing polls.

Thread safety: the state both ends share, its lock and the rules that make a wake-up
impossible to miss are in :mod:`omni_trio.transport._bridge_core`.

Closing either end, at any time and from any thread, wakes every task waiting on either
end. When a loop finishes while an end bound to it is still open (its owner never closed
it), the end counts as lost: a per-loop system task notices the loop ending and breaks the
bridge, so the peer gets ``anyio.BrokenResourceError`` instead of waiting forever.

A receiver that only hands items on (a demultiplexer) can :meth:`BridgeReceiver.consume`
them: a synchronous handler is called for each item from the wake-up callback itself, so a
wake-up costs no task switch; the task that called ``consume`` stays parked, as its owner.

An end used from a thread that runs no trio loop (e.g. an asyncio program in a worker
thread) stays unbound: only its non-blocking calls (``send_nowait``, ``receive_nowait``,
``close``) work there, and its owner must close it, since no loop watcher can.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Generic, Self, TypeVar, final

import anyio
import anyio.abc
import outcome
import trio

from ._bridge_core import CLOSED, LOST, OPEN, BridgeStatistics, Core, Side

__all__ = ["BridgeReceiver", "BridgeSender", "BridgeStatistics", "open_bridge"]

T = TypeVar("T")


class _EndBase(Generic[T]):
    _core: Core[T]
    _side: Side

    def _mark_lost(self) -> None:
        """Its loop ended while it was open: break the bridge (the peer is woken)."""
        self._core.end(self._side, LOST)

    def statistics(self) -> BridgeStatistics:
        """A frozen snapshot of the bridge (see :class:`BridgeStatistics`). Never blocks."""
        return self._core.statistics()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    def _own_state(self) -> str:
        return ""  # what this end's own state adds to the repr

    def __repr__(self) -> str:
        state = self._core.describe(self._side) + self._own_state()
        return f"<{type(self).__name__} {self._core.name!r} {state}>"


class BridgeSender(_EndBase[T], anyio.abc.ObjectSendStream[T]):
    """The sending end of a bridge; see :func:`open_bridge`."""

    def __init__(self, core: Core[T]) -> None:
        self._core = core
        self._side = core.tx

    def send_nowait(self, item: T) -> None:
        """Send ``item`` if there is credit. Does not checkpoint.

        Raises ``anyio.WouldBlock`` when ``max_buffer`` items are unread,
        ``anyio.ClosedResourceError`` if this end was closed, ``anyio.BrokenResourceError``
        if the receiver was closed or its loop has finished, ``RuntimeError`` if this end is
        bound to another trio loop.
        """
        if not self._put(item, park=False):
            raise anyio.WouldBlock

    async def send(self, item: T) -> None:
        """Send ``item``, waiting while the credit window is full. Always checkpoints.

        Cancellation while waiting means the item was not sent. Raises what
        :meth:`send_nowait` raises, except ``WouldBlock``; a wait ends with
        ``BrokenResourceError`` as soon as the receiver closes or its loop ends.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._put(item, park=True):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        core, side = self._core, self._side
        while True:
            try:
                await side.lot.park()
            finally:
                with core.lock:
                    side.waiting -= 1
            if self._put(item, park=True):
                return

    def _put(self, item: T, *, park: bool) -> bool:
        core, side = self._core, self._side
        core.bind(side)
        with core.lock:
            if side.state != OPEN:
                raise anyio.ClosedResourceError(f"bridge {core.name!r}: this sender is closed")
            if core.rx.state != OPEN:
                why = " was closed" if core.rx.state == CLOSED else "'s loop has finished"
                raise anyio.BrokenResourceError(f"bridge {core.name!r}: the receiver{why}")
            if len(core.buffer) >= core.max_buffer:
                if park:
                    side.waiting += 1
                return False
            core.buffer.append(item)
            core.sent += 1
            wake = core.request_wake(core.rx)
        if wake:
            core.deliver_wake(core.rx)
        return True

    def close(self) -> None:
        """Close this end; never blocks. The receiver reads what was sent, then gets
        ``EndOfStream``. Tasks waiting in :meth:`send` get ``ClosedResourceError``."""
        self._core.end(self._side, CLOSED)

    async def aclose(self) -> None:
        """Close this end (see :meth:`close`), then checkpoint; closed even if cancelled."""
        self.close()
        await trio.lowlevel.checkpoint()


class BridgeReceiver(_EndBase[T], anyio.abc.ObjectReceiveStream[T]):
    """The receiving end of a bridge; see :func:`open_bridge`. ``async for`` reads it to
    the end of the stream."""

    def __init__(self, core: Core[T]) -> None:
        self._core = core
        self._side = core.rx
        # a consume() call is running (its whole call, not only while it waits: a consumer on
        # its way out after a cancellation has given up its wake-up callback but not ended)
        self._consuming = False

    def _own_state(self) -> str:
        return " consuming" if self._consuming else ""

    def receive_nowait(self) -> T:
        """Take the next item if one is buffered. Does not checkpoint.

        Raises ``anyio.WouldBlock`` when none is, ``anyio.EndOfStream`` once the sender has
        closed and every item was read, ``anyio.BrokenResourceError`` once the sender's loop
        ended without closing it and every item was read, ``anyio.ClosedResourceError`` if
        this end was closed, ``RuntimeError`` if this end is bound to another trio loop,
        ``anyio.BusyResourceError`` while a :meth:`consume` runs on this end (its handler
        takes every item).
        """
        if self._consuming:
            raise anyio.BusyResourceError("receiving from this bridge (a consume() runs)")
        took = self._take(park=False)
        if not took:
            raise anyio.WouldBlock
        return took[0]

    async def receive(self) -> T:
        """Take the next item, waiting for one. Always checkpoints.

        Cancellation while waiting takes nothing. Raises what :meth:`receive_nowait`
        raises, except ``WouldBlock``.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._consuming:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise anyio.BusyResourceError("receiving from this bridge (a consume() runs)")
        took = self._take(park=True)
        if took:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return took[0]
        core, side = self._core, self._side
        while True:
            try:
                await side.lot.park()
            finally:
                with core.lock:
                    side.waiting -= 1
            took = self._take(park=True)
            if took:
                return took[0]

    async def consume(self, handler: Callable[[T], object]) -> None:
        """Hand every item to ``handler(item)``, in order, on this loop, until the sender
        closes (then return). Always checkpoints.

        Items already buffered are handed over first, in this task. Then it waits, and the
        items that arrive are handed over by the wake-up itself: the callback the sender
        schedules on this loop calls ``handler`` for each one there, with no task switch
        between the sender's wake-up and ``handler`` (a consumer that only hands items on,
        such as a demultiplexer, saves one scheduler trip per wake-up over a ``receive()``
        loop). So ``handler`` must be synchronous, quick and must not wait; it runs outside
        this task's call stack and context.

        Cancelled while it waits, it returns no item to the bridge: every item taken was
        handed to ``handler``, the others stay buffered. Raises what ``handler`` raised (the
        items after that one stay buffered), ``anyio.BusyResourceError`` if another
        ``consume()`` is running on this end (while one runs, :meth:`receive` and
        :meth:`receive_nowait` raise it too), and what :meth:`receive` raises except
        ``EndOfStream``.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._consuming:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise anyio.BusyResourceError("consuming from this bridge")
        self._consuming = True
        try:
            consumer = _Consumer(self._take, self._core, self._side, handler)
            done = consumer.drain()
            if done is None:
                done = await consumer.wait()
            else:
                await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._consuming = False
        done.unwrap()

    def _take(self, *, park: bool) -> tuple[T] | tuple[()]:
        # ``(item,)``, or ``()`` when there is none: no sentinel, and ``None`` stays an item
        core, side = self._core, self._side
        core.bind(side)
        with core.lock:
            if side.state != OPEN:
                raise anyio.ClosedResourceError(f"bridge {core.name!r}: this receiver is closed")
            if not core.buffer:
                if core.tx.state == CLOSED:
                    raise anyio.EndOfStream
                if core.tx.state == LOST:
                    raise anyio.BrokenResourceError(
                        f"bridge {core.name!r}: the sender's loop finished without closing it"
                    )
                if park:
                    side.waiting += 1
                return ()
            item = core.buffer.popleft()
            core.received += 1
            wake = core.max_buffer - len(core.buffer) >= core.credit_batch and core.request_wake(
                core.tx
            )
        if wake:
            core.deliver_wake(core.tx)
        return (item,)

    def close(self) -> None:
        """Close this end; never blocks. Unread items are dropped; a sender waiting in
        ``send()`` is woken with ``BrokenResourceError``; tasks waiting in :meth:`receive`
        get ``ClosedResourceError``."""
        self._core.end(self._side, CLOSED)

    async def aclose(self) -> None:
        """Close this end (see :meth:`close`), then checkpoint; closed even if cancelled."""
        self.close()
        await trio.lowlevel.checkpoint()


class _Consumer(Generic[T]):
    """One :meth:`BridgeReceiver.consume` call: hands the buffered items to its handler, in
    its task at first, then from the receiver side's wake-up callback (``Side.on_wake``) on
    the same loop, until the stream ends, the handler raises or the task is cancelled.

    ``Side.waiting`` counts it as one waiter exactly while it holds a unit there: taken by
    ``_take(park=True)`` when it found the buffer empty, given back when a wake-up comes or
    the wait is aborted. A cancellation that reaches the waiting task while the handler is
    running (the handler cancelled it) cannot abort the wait there: the drain finishes, then
    wakes the task, which meets the cancellation at its next checkpoint.
    """

    __slots__ = (
        "_core",
        "_handler",
        "_holds",
        "_interrupted",
        "_running",
        "_side",
        "_take",
        "_task",
    )

    def __init__(  # type: ignore[explicit-any]
        self,
        take: Callable[..., tuple[T] | tuple[()]],
        core: Core[T],
        side: Side,
        handler: Callable[[T], object],
    ) -> None:
        self._take = take
        self._core = core
        self._side = side
        self._handler = handler
        self._task: trio.lowlevel.Task | None = None
        self._holds = False  # holds a unit of side.waiting
        self._running = False  # the handler is running (the wait cannot be aborted now)
        self._interrupted = False  # a cancellation came while the handler ran

    def drain(self) -> outcome.Outcome[None] | None:
        """Hand every buffered item on; ``None`` once the buffer is empty and open (a unit
        of ``waiting`` now held), else how the consumer ends. Synchronous."""
        take, handler = self._take, self._handler
        try:
            while not self._interrupted:
                took = take(park=True)
                if not took:
                    self._holds = True
                    return None
                self._running = True
                try:
                    handler(took[0])
                finally:
                    self._running = False
        except anyio.EndOfStream:
            return outcome.Value(None)
        except BaseException as exc:  # the handler's own, or the bridge's: the task raises it
            return outcome.Error(exc)
        return None

    async def wait(self) -> outcome.Outcome[None]:
        """Wait, handing items on from the wake-up callback, until the consumer ends; raises
        ``trio.Cancelled`` if cancelled. Always checkpoints (it parks)."""
        self._task = trio.lowlevel.current_task()
        side = self._side
        try:
            while True:
                side.on_wake = self._woken
                done: outcome.Outcome[None] | None = await trio.lowlevel.wait_task_rescheduled(
                    self._abort
                )
                if done is not None:
                    return done
                # woken after a cancellation that came while the handler ran: meet it
                self._interrupted = False
                await trio.lowlevel.checkpoint()
                done = self.drain()
                if done is not None:
                    return done
        finally:
            side.on_wake = None
            self._release()

    def _woken(self) -> None:
        # a wake-up on this loop (the sender sent, or an end closed): the unit it answers
        # is given back, the buffer drained; the task wakes only when the consumer ends
        self._release()
        done = self.drain()
        if done is not None or self._interrupted:
            self._side.on_wake = None
            assert self._task is not None
            trio.lowlevel.reschedule(self._task, outcome.Value(done))

    def _release(self) -> None:
        if self._holds:
            self._holds = False
            with self._core.lock:
                self._side.waiting -= 1

    def _abort(self, _: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        if self._running:
            self._interrupted = True
            return trio.lowlevel.Abort.FAILED
        self._side.on_wake = None
        self._release()
        return trio.lowlevel.Abort.SUCCEEDED


# written as a class, like trio.open_memory_channel, so that ``open_bridge[int](8)`` types the
# items; a plain ``open_bridge(8)`` gives ends of ``Any``
@final
class open_bridge(tuple[BridgeSender[T], BridgeReceiver[T]]):  # noqa: N801 (a function to users)
    """Create a bridge: at most ``max_buffer`` items sent and not yet received.

    Returns ``(sender, receiver)``. ``open_bridge[Item](n)`` types the items. Does not
    checkpoint and needs no running loop: each end binds to the trio loop that first uses
    it. Raises ``ValueError`` if ``max_buffer`` is not a positive int.
    """

    def __new__(  # type: ignore[misc]  # returns the pair, as trio.open_memory_channel does
        cls, max_buffer: int = 64, *, name: str = "bridge"
    ) -> tuple[BridgeSender[T], BridgeReceiver[T]]:
        if isinstance(max_buffer, bool) or not isinstance(max_buffer, int) or max_buffer < 1:
            raise ValueError(
                f"bridge {name!r}: max_buffer must be a positive int, got {max_buffer!r}"
            )
        core: Core[T] = Core(max_buffer, name)
        sender = BridgeSender(core)
        receiver = BridgeReceiver(core)
        core.tx.end_ref = weakref.ref(sender)
        core.rx.end_ref = weakref.ref(receiver)
        return sender, receiver

    def __init__(self, max_buffer: int = 64, *, name: str = "bridge") -> None:
        pass  # for the type checker's signature; __new__ did the work
