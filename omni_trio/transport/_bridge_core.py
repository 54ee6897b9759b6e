"""The shared state of a bridge (see :mod:`omni_trio.transport.bridge`): its buffer and
counters, each end's loop binding and wake-ups, and the watcher that marks an end lost when
its loop ends.

Thread safety: the buffer, the counters and each end's state live in one :class:`Core`
guarded by a ``threading.Lock``; each critical section is a few attribute updates and never
calls out. A ``ParkingLot`` is only touched on its own loop (directly, or through
``run_sync_soon``). A parked task cannot miss its wake-up: it decides to park under the lock
and parks without a checkpoint, and the wake-up callback can only run on its loop after it
has parked.

When a loop finishes while an end bound to it is still open (its owner never closed it), the
end counts as lost: a per-loop system task notices the loop ending and breaks the bridge, so
the peer gets ``anyio.BrokenResourceError`` instead of waiting forever.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Generic, Literal, Protocol, TypeVar

import trio

__all__ = [
    "CLOSED",
    "LOST",
    "OPEN",
    "BridgeStatistics",
    "Core",
    "Losable",
    "Side",
    "State",
    "current_token",
    "watch_current_loop",
]

T = TypeVar("T")

State = Literal["open", "closed", "lost"]
OPEN: Final = "open"
CLOSED: Final = "closed"
LOST: Final = "lost"


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


class Losable(Protocol):
    """What the loop watcher needs of an end, whatever its item type."""

    def _mark_lost(self) -> None: ...


class Side:
    """Loop binding and wake-up state of one end (fields guarded by ``Core.lock``)."""

    __slots__ = ("end_ref", "lot", "on_wake", "role", "state", "token", "waiting", "wake_pending")

    def __init__(self, role: str) -> None:
        self.role = role
        # Weak: the core must not keep its ends alive (the loop watcher holds weak refs too).
        self.end_ref: weakref.ref[Losable] | None = None
        self.state: State = OPEN
        self.token: trio.lowlevel.TrioToken | None = None
        self.lot = trio.lowlevel.ParkingLot()  # only touched on the loop of ``token``
        self.waiting = 0
        self.wake_pending = False
        # a receiver's consumer (BridgeReceiver.consume): a wake-up calls it instead of
        # unparking the lot; only touched on the loop of ``token``
        self.on_wake: Callable[[], None] | None = None


class Core(Generic[T]):
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
        self.tx = Side("sender")
        self.rx = Side("receiver")

    def bind(self, side: Side) -> None:
        token = current_token()
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
        watch_current_loop(side)

    def request_wake(self, side: Side) -> bool:
        """Under the lock: whether the caller must deliver a wake-up to ``side``."""
        if side.waiting == 0 or side.wake_pending:
            return False
        side.wake_pending = True
        return True

    def deliver_wake(self, side: Side) -> None:
        """Outside the lock: wake every task parked on ``side``, on its own loop."""
        token = side.token
        if token is None:
            return
        if current_token() is token and side.on_wake is None:
            # a consumer is not run inside the caller's call stack: it gets the callback
            self._run_wake(side)
            return
        try:
            token.run_sync_soon(self._run_wake, side)
        except trio.RunFinishedError:
            # Its loop is gone, so nothing is parked there; the end can never act again.
            self.end(side, LOST)

    def _run_wake(self, side: Side) -> None:
        with self.lock:
            side.wake_pending = False
        on_wake = side.on_wake
        if on_wake is not None:
            on_wake()
        else:
            side.lot.unpark_all()

    def end(self, side: Side, how: State) -> None:
        """Close (or mark lost) one end and wake everyone waiting on either end."""
        with self.lock:
            if side.state != OPEN:
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
                sender_closed=self.tx.state != OPEN,
                receiver_closed=self.rx.state != OPEN,
                tasks_waiting_send=self.tx.waiting,
                tasks_waiting_receive=self.rx.waiting,
            )

    def describe(self, side: Side) -> str:
        peer = self.rx if side is self.tx else self.tx
        with self.lock:
            return (
                f"{side.state}{'' if side.token else ' unbound'} "
                f"in_flight={len(self.buffer)}/{self.max_buffer} sent={self.sent} "
                f"received={self.received} waiting_send={self.tx.waiting} "
                f"waiting_receive={self.rx.waiting} peer={peer.state}"
            )


def current_token() -> trio.lowlevel.TrioToken | None:
    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:
        return None


# One system task per trio loop that uses a bridge: when the loop finishes, every end
# still open on it is marked lost (weak refs, so ends that were dropped cost nothing).
_LOOP_ENDS: trio.lowlevel.RunVar[weakref.WeakSet[Losable]] = trio.lowlevel.RunVar(
    "omni_trio_bridge_ends"
)


async def _loop_watcher(ends: weakref.WeakSet[Losable]) -> None:
    try:
        await trio.sleep_forever()
    finally:
        for end in list(ends):
            end._mark_lost()


def watch_current_loop(side: Side) -> None:
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
