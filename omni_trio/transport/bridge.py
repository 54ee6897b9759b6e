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

Thread safety: the buffer, the counters and each end's state live in one ``_Core`` guarded
by a ``threading.Lock``; each critical section is a few attribute updates and never calls
out. A ``ParkingLot`` is only touched on its own loop (directly, or through
``run_sync_soon``). A parked task cannot miss its wake-up: it decides to park under the lock
and parks without a checkpoint, and the wake-up callback can only run on its loop after it
has parked.

Closing either end, at any time and from any thread, wakes every task waiting on either
end. When a loop finishes while an end bound to it is still open (its owner never closed
it), the end counts as lost: a per-loop system task notices the loop ending and breaks the
bridge, so the peer gets ``anyio.BrokenResourceError`` instead of waiting forever.

An end used from a thread that runs no trio loop (e.g. an asyncio program in a worker
thread) stays unbound: only its non-blocking calls (``send_nowait``, ``receive_nowait``,
``close``) work there, and its owner must close it, since no loop watcher can.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Generic, Literal, Protocol, Self, TypeVar, final

import anyio
import anyio.abc
import trio

__all__ = ["BridgeReceiver", "BridgeSender", "BridgeStatistics", "open_bridge"]

T = TypeVar("T")

_State = Literal["open", "closed", "lost"]
_OPEN: Final = "open"
_CLOSED: Final = "closed"
_LOST: Final = "lost"


@dataclass(frozen=True)
class BridgeStatistics:
    """A snapshot of one bridge, the same from either end.

    ``items_in_flight`` counts items sent and not yet received (they sit in the buffer);
    ``items_discarded`` counts items dropped because the receiver closed before reading them.
    ``sender_closed``/``receiver_closed`` are true once that end was closed or its loop ended.
    """

    name: str
    max_buffer: int
    items_in_flight: int
    credits_available: int
    items_sent: int
    items_received: int
    items_discarded: int
    sender_closed: bool
    receiver_closed: bool
    tasks_waiting_send: int
    tasks_waiting_receive: int


class _Losable(Protocol):
    """What the loop watcher needs of an end, whatever its item type."""

    def _mark_lost(self) -> None: ...


class _Side:
    """Loop binding and wake-up state of one end (fields guarded by ``_Core.lock``)."""

    __slots__ = ("end_ref", "lot", "role", "state", "token", "waiting", "wake_pending")

    def __init__(self, role: str) -> None:
        self.role = role
        # Weak: the core must not keep its ends alive (the loop watcher holds weak refs too).
        self.end_ref: weakref.ref[_Losable] | None = None
        self.state: _State = _OPEN
        self.token: trio.lowlevel.TrioToken | None = None
        self.lot = trio.lowlevel.ParkingLot()  # only touched on the loop of ``token``
        self.waiting = 0
        self.wake_pending = False


class _Core(Generic[T]):
    """State shared by both ends; see the module docstring for the locking rules."""

    def __init__(self, max_buffer: int, name: str) -> None:
        self.lock = threading.Lock()
        self.name = name
        self.max_buffer = max_buffer
        self.credit_batch = max(1, max_buffer // 4)
        self.buffer: deque[T] = deque()
        self.sent = 0
        self.received = 0
        self.discarded = 0
        self.tx = _Side("sender")
        self.rx = _Side("receiver")

    def bind(self, side: _Side) -> None:
        token = _current_token()
        if token is None:
            # a thread without a trio loop (a plain asyncio worker): it can only use the
            # non-blocking calls, nothing is ever parked there, so there is nothing to bind
            return
        if side.token is token:
            return
        with self.lock:
            bound = side.token
            if bound is None:
                side.token = token
        if bound is not None:
            raise RuntimeError(
                f"bridge {self.name!r}: its {side.role} is bound to another trio loop; "
                "each end must be used from one loop only"
            )
        _watch_current_loop(side)

    def request_wake(self, side: _Side) -> bool:
        """Under the lock: whether the caller must deliver a wake-up to ``side``."""
        if side.waiting == 0 or side.wake_pending:
            return False
        side.wake_pending = True
        return True

    def deliver_wake(self, side: _Side) -> None:
        """Outside the lock: wake every task parked on ``side``, on its own loop."""
        token = side.token
        if token is None:
            return
        if _current_token() is token:
            self._run_wake(side)
            return
        try:
            token.run_sync_soon(self._run_wake, side)
        except trio.RunFinishedError:
            # Its loop is gone, so nothing is parked there; the end can never act again.
            self.end(side, _LOST)

    def _run_wake(self, side: _Side) -> None:
        with self.lock:
            side.wake_pending = False
        side.lot.unpark_all()

    def end(self, side: _Side, how: _State) -> None:
        """Close (or mark lost) one end and wake everyone waiting on either end."""
        with self.lock:
            if side.state != _OPEN:
                return
            side.state = how
            if side is self.rx:
                # Nobody will ever read them: drop them now so no item outlives the bridge.
                self.discarded += len(self.buffer)
                self.buffer.clear()
            wakes = [s for s in (self.tx, self.rx) if self.request_wake(s)]
        for s in wakes:
            self.deliver_wake(s)

    def statistics(self) -> BridgeStatistics:
        with self.lock:
            in_flight = len(self.buffer)
            return BridgeStatistics(
                name=self.name,
                max_buffer=self.max_buffer,
                items_in_flight=in_flight,
                credits_available=max(0, self.max_buffer - in_flight),
                items_sent=self.sent,
                items_received=self.received,
                items_discarded=self.discarded,
                sender_closed=self.tx.state != _OPEN,
                receiver_closed=self.rx.state != _OPEN,
                tasks_waiting_send=self.tx.waiting,
                tasks_waiting_receive=self.rx.waiting,
            )

    def describe(self, side: _Side) -> str:
        peer = self.rx if side is self.tx else self.tx
        with self.lock:
            return (
                f"{side.state}{'' if side.token else ' unbound'} "
                f"in_flight={len(self.buffer)}/{self.max_buffer} sent={self.sent} "
                f"received={self.received} waiting_send={self.tx.waiting} "
                f"waiting_receive={self.rx.waiting} peer={peer.state}"
            )


def _current_token() -> trio.lowlevel.TrioToken | None:
    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:
        return None


# One system task per trio loop that uses a bridge: when the loop finishes, every end
# still open on it is marked lost (weak refs, so ends that were dropped cost nothing).
_LOOP_ENDS: trio.lowlevel.RunVar[weakref.WeakSet[_Losable]] = trio.lowlevel.RunVar(
    "omni_trio_bridge_ends"
)


async def _loop_watcher(ends: weakref.WeakSet[_Losable]) -> None:
    try:
        await trio.sleep_forever()
    finally:
        for end in list(ends):
            end._mark_lost()


def _watch_current_loop(side: _Side) -> None:
    end = side.end_ref() if side.end_ref is not None else None
    if end is None:
        return
    try:
        ends = _LOOP_ENDS.get()
    except LookupError:
        ends = weakref.WeakSet()
        _LOOP_ENDS.set(ends)
        trio.lowlevel.spawn_system_task(
            _loop_watcher, ends, name="omni_trio.transport.bridge.loop_watcher"
        )
    ends.add(end)


class _EndBase(Generic[T]):
    _core: _Core[T]
    _side: _Side

    def _mark_lost(self) -> None:
        """Its loop ended while it was open: break the bridge (the peer is woken)."""
        self._core.end(self._side, _LOST)

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

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._core.name!r} {self._core.describe(self._side)}>"


class BridgeSender(_EndBase[T], anyio.abc.ObjectSendStream[T]):
    """The sending end of a bridge; see :func:`open_bridge`."""

    def __init__(self, core: _Core[T]) -> None:
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
            if side.state != _OPEN:
                raise anyio.ClosedResourceError(f"bridge {core.name!r}: this sender is closed")
            if core.rx.state != _OPEN:
                why = " was closed" if core.rx.state == _CLOSED else "'s loop has finished"
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
        self._core.end(self._side, _CLOSED)

    async def aclose(self) -> None:
        """Close this end (see :meth:`close`), then checkpoint; closed even if cancelled."""
        self.close()
        await trio.lowlevel.checkpoint()


class BridgeReceiver(_EndBase[T], anyio.abc.ObjectReceiveStream[T]):
    """The receiving end of a bridge; see :func:`open_bridge`. ``async for`` reads it to
    the end of the stream."""

    def __init__(self, core: _Core[T]) -> None:
        self._core = core
        self._side = core.rx

    def receive_nowait(self) -> T:
        """Take the next item if one is buffered. Does not checkpoint.

        Raises ``anyio.WouldBlock`` when none is, ``anyio.EndOfStream`` once the sender has
        closed and every item was read, ``anyio.BrokenResourceError`` once the sender's loop
        ended without closing it and every item was read, ``anyio.ClosedResourceError`` if
        this end was closed, ``RuntimeError`` if this end is bound to another trio loop.
        """
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

    def _take(self, *, park: bool) -> tuple[T] | tuple[()]:
        # ``(item,)``, or ``()`` when there is none: no sentinel, and ``None`` stays an item
        core, side = self._core, self._side
        core.bind(side)
        with core.lock:
            if side.state != _OPEN:
                raise anyio.ClosedResourceError(f"bridge {core.name!r}: this receiver is closed")
            if not core.buffer:
                if core.tx.state == _CLOSED:
                    raise anyio.EndOfStream
                if core.tx.state == _LOST:
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
        self._core.end(self._side, _CLOSED)

    async def aclose(self) -> None:
        """Close this end (see :meth:`close`), then checkpoint; closed even if cancelled."""
        self.close()
        await trio.lowlevel.checkpoint()


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
        core: _Core[T] = _Core(max_buffer, name)
        sender = BridgeSender(core)
        receiver = BridgeReceiver(core)
        core.tx.end_ref = weakref.ref(sender)
        core.rx.end_ref = weakref.ref(receiver)
        return sender, receiver

    def __init__(self, max_buffer: int = 64, *, name: str = "bridge") -> None:
        pass  # for the type checker's signature; __new__ did the work
