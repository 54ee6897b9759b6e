"""A live session's events and its journal.

Every event is frozen and carries ``seq``, strictly increasing within a session:
:class:`ResponseStarted`, :class:`ResponseDelta`, :class:`ResponseDone`, and
:class:`SessionClosed` (always the last one). The :class:`Journal` keeps them for the
session's reader and for a resume: it drops acknowledged events at once and delivered ones
beyond its bounds (``journal_events``, ``journal_bytes``); events nobody read yet are never
dropped, so a response's deltas wait for room instead (control events never wait).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

import trio

from .live_rules import has_room, input_bytes, trim_count

__all__ = [
    "Journal",
    "ResponseDelta",
    "ResponseDone",
    "ResponseStarted",
    "ResponseStatus",
    "SessionClosed",
    "SessionEvent",
    "event_bytes",
]

#: how a response ended
ResponseStatus = Literal["completed", "cancelled", "failed"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionEvent:
    """Base of a session's events: ``seq`` increases strictly within the session."""

    seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseStarted(SessionEvent):
    """A user turn's response began (its request was admitted)."""

    response_id: str
    turn_id: int
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseDelta(SessionEvent):
    """One output of a response's request: a stage's text and token ids (deltas) or data
    (audio samples...)."""

    response_id: str
    stage_id: str
    text: str
    token_ids: tuple[int, ...]
    data: object = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseDone(SessionEvent):
    """A response ended: ``completed``, ``cancelled`` (a barge-in) or ``failed`` (``error``
    is its exception)."""

    response_id: str
    status: ResponseStatus
    error: BaseException | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionClosed(SessionEvent):
    """The session ended, the last event: ``reason`` is ``closed``, ``idle_timeout``,
    ``detach_expired``, ``engine_closed`` or ``replica_dead`` (then ``error`` is set)."""

    reason: str
    error: BaseException | None = None


E = TypeVar("E", bound=SessionEvent)


def event_bytes(event: SessionEvent) -> int:
    """An estimate of what an event holds, for ``journal_bytes``. Pure."""
    if isinstance(event, ResponseDelta):
        return 64 + input_bytes(event.text) + 4 * len(event.token_ids) + input_bytes(event.data)
    return 64


class Journal:
    """A session's events in ``seq`` order, with the reader's and the client's positions.
    See the module docstring. Owned by one session; its methods never checkpoint except
    :meth:`wait_room` and :meth:`wait_after`."""

    __slots__ = (
        "_bytes",
        "_changed",
        "_events",
        "_pending_sizes",
        "_room",
        "_sizes",
        "_undelivered_bytes",
        "acked",
        "closed",
        "delivered",
        "max_bytes",
        "max_events",
        "next_seq",
    )

    def __init__(self, max_events: int, max_bytes: int) -> None:
        self.max_events = max_events
        self.max_bytes = max_bytes
        self._events: deque[SessionEvent] = deque()
        self._sizes: deque[int] = deque()
        self._bytes = 0
        # the sizes of the events no reader got yet (the newest ones), and their sum
        self._pending_sizes: deque[int] = deque()
        self._undelivered_bytes = 0
        self.next_seq = 1
        self.delivered = 0  # highest seq handed to a reader
        self.acked = 0  # highest seq the client acknowledged
        self.closed = False  # SessionClosed is in
        self._changed = trio.Event()  # set when an event is appended
        self._room = trio.Event()  # set when delivered, acknowledged or trimmed

    @property
    def first_seq(self) -> int:
        """The oldest seq still held (``next_seq`` when empty)."""
        return self._events[0].seq if self._events else self.next_seq

    @property
    def n_events(self) -> int:
        return len(self._events)

    @property
    def n_bytes(self) -> int:
        return self._bytes

    def _undelivered_count(self) -> int:
        return self.next_seq - 1 - max(self.delivered, self.first_seq - 1)

    def has_room(self) -> bool:
        return has_room(
            undelivered_events=self._undelivered_count(),
            undelivered_bytes=self._undelivered_bytes,
            max_events=self.max_events,
            max_bytes=self.max_bytes,
        )

    async def wait_room(self) -> None:
        """Wait until a response delta may go in (see :func:`has_room`). Always
        checkpoints."""
        await trio.lowlevel.checkpoint()
        while not self.has_room():
            room = self._room = trio.Event() if self._room.is_set() else self._room
            await room.wait()

    def append(self, make: Callable[[int], E]) -> E:
        """Append ``make(seq)`` with the next seq; wake the readers. Synchronous."""
        if self.closed:
            raise RuntimeError("the journal is closed: SessionClosed was its last event")
        event = make(self.next_seq)
        self.next_seq += 1
        size = event_bytes(event)
        self._events.append(event)
        self._sizes.append(size)
        self._bytes += size
        self._undelivered_bytes += size
        self._pending_sizes.append(size)
        self.closed = isinstance(event, SessionClosed)
        self._changed.set()
        self._changed = trio.Event()
        self._trim()
        return event

    def after(self, seq: int) -> list[SessionEvent]:
        """The held events after ``seq``, oldest first. Synchronous."""
        n = len(self._events) - max(0, seq + 1 - self.first_seq)
        if n <= 0:
            return []
        newest = list(itertools.islice(reversed(self._events), n))
        newest.reverse()
        return newest

    async def wait_after(self, seq: int) -> None:
        """Wait until an event after ``seq`` is in (returns at once if one is, or if the
        journal is closed). Always checkpoints."""
        if self.next_seq - 1 > seq or self.closed:
            await trio.lowlevel.checkpoint()
            return
        await self._changed.wait()

    def mark_delivered(self, seq: int) -> None:
        """A reader got every event up to ``seq``. Synchronous."""
        if seq > self.delivered:
            self.delivered = seq
            # the newly delivered are the oldest undelivered ones
            keep = self._undelivered_count()
            while len(self._pending_sizes) > keep:
                self._undelivered_bytes -= self._pending_sizes.popleft()
            self._trim()
            self._room.set()

    def ack(self, seq: int) -> None:
        """The client processed every event up to ``seq``: they are dropped. Synchronous."""
        if seq > self.acked:
            self.acked = min(seq, self.next_seq - 1)
            self.mark_delivered(self.acked)
            self._trim()
            self._room.set()

    def restart_delivery(self, seq: int) -> None:
        """A resumed reader starts after ``seq``: what follows counts as undelivered
        again. Synchronous."""
        self.delivered = seq
        n = self._undelivered_count()
        self._pending_sizes = deque(itertools.islice(reversed(self._sizes), n))
        self._pending_sizes.reverse()
        self._undelivered_bytes = sum(self._pending_sizes)

    def _trim(self) -> None:
        n = trim_count(
            self._sizes,
            total_bytes=self._bytes,
            first_seq=self.first_seq,
            delivered_seq=self.delivered,
            acked_seq=self.acked,
            max_events=self.max_events,
            max_bytes=self.max_bytes,
        )
        for _ in range(n):
            self._events.popleft()
            self._bytes -= self._sizes.popleft()

    def __repr__(self) -> str:
        return (
            f"<Journal seq {self.first_seq}..{self.next_seq - 1} events={len(self._events)} "
            f"bytes={self._bytes} delivered={self.delivered} acked={self.acked}"
            f"{' closed' if self.closed else ''}>"
        )
