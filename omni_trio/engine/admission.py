"""Pipeline-level admission: at most ``max_requests_in_flight`` requests run at once, and at
most ``max_requests_in_graph`` are in the pipeline at once, counted until their consumer is
done with them.

One :class:`AdmissionGate` per engine. A request takes a slot when it is admitted and gives
it back when it ends (:meth:`AdmissionGate.release`). With ``max_requests_in_graph`` it also
takes a :class:`GraphTicket`, which it holds longer: from its admission until its consumer
took its final output or left (the request's stream releases it, :meth:`GraphTicket.release`,
exactly once; closing the gate releases every ticket still held). A request is admitted when
both a slot and a ticket are free, through one first-in first-out queue. At a limit,
``admission: wait`` queues
admissions first-in first-out (at most ``max_waiting`` of them) and ``admission: reject``
refuses at once with :class:`~omni_trio.errors.EngineOverloadedError`. A freed slot goes
straight to the first waiter, so a newcomer never overtakes the queue. ``pause()`` holds every
new admission (it waits, or is refused under ``reject``) while the requests in flight go on;
``resume()`` lets the waiters in, in order. ``close()`` fails every waiter with
:class:`~omni_trio.errors.EngineClosedError`.

The rule is two pure functions (:func:`decide`, :func:`grants`); the gate holds the counts,
the tickets and the parked tasks. A waiter is a parked trio task: cancelling it removes it
from the queue at once (trio calls the abort function synchronously), so it leaves no
trace. A waiter that was handed a slot (and a ticket) and then cancelled before it ran
passes them on to the next one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import outcome
import trio
from trio.lowlevel import Abort, RaiseCancelT, Task

from ..errors import EngineClosedError, EngineOverloadedError

__all__ = [
    "AdmissionGate",
    "AdmissionStatistics",
    "Decision",
    "GraphTicket",
    "Policy",
    "decide",
    "grants",
]

#: what a request gets at the limit (the config's ``admission``)
Policy = Literal["wait", "reject"]
#: what a new admission gets: a slot now, a place in the queue, or a refusal and its reason
Decision = Literal["admit", "wait", "full", "graph_full", "paused", "queue_full", "closed"]


def decide(
    *,
    in_flight: int,
    limit: int,
    waiting: int,
    paused: bool,
    closed: bool,
    policy: Policy,
    max_waiting: int | None,
    in_graph: int = 0,
    graph_limit: int | None = None,
) -> Decision:
    """What a new admission gets. Pure.

    A slot only when there is room (``in_flight`` under ``limit``, and ``in_graph`` under
    ``graph_limit`` when there is one), admission is not paused and nobody waits (waiters
    keep their turn). Otherwise ``reject`` refuses (``paused``, ``full`` or ``graph_full``);
    ``wait`` queues it unless ``max_waiting`` admissions already wait (``queue_full``).
    """
    if closed:
        return "closed"
    graph_room = graph_limit is None or in_graph < graph_limit
    if not paused and in_flight < limit and graph_room and waiting == 0:
        return "admit"
    if policy == "reject":
        if paused:
            return "paused"
        return "full" if in_flight >= limit else "graph_full"
    if max_waiting is not None and waiting >= max_waiting:
        return "queue_full"
    return "wait"


def grants(
    *,
    in_flight: int,
    limit: int,
    waiting: int,
    paused: bool,
    in_graph: int = 0,
    graph_limit: int | None = None,
) -> int:
    """How many waiters, first first, get a slot (and a ticket) now. Pure."""
    if paused:
        return 0
    room = limit - in_flight
    if graph_limit is not None:
        room = min(room, graph_limit - in_graph)
    return max(0, min(waiting, room))


class GraphTicket:
    """A request's place under ``max_requests_in_graph``, from its admission until its
    consumer is done (see the module docstring). Only its gate makes one."""

    __slots__ = ("_gate",)

    def __init__(self, gate: AdmissionGate) -> None:
        self._gate: AdmissionGate | None = gate

    @property
    def held(self) -> bool:
        """True until it is released."""
        return self._gate is not None

    def release(self) -> None:
        """Give the ticket back to its gate: the first waiter may now be admitted.
        Synchronous; only the first call does anything (a request ends one way, but its
        consumer, its stream and the engine's close may each call it)."""
        gate, self._gate = self._gate, None
        if gate is not None:
            gate._return_ticket(self)

    def __repr__(self) -> str:
        return f"<GraphTicket {'held' if self._gate is not None else 'released'}>"


@dataclass(frozen=True, slots=True)
class AdmissionStatistics:
    """A snapshot of an :class:`AdmissionGate`."""

    #: slots taken: requests admitted and not yet released
    in_flight: int
    #: admissions queued for a slot (or for ``resume()``)
    waiting: int
    paused: bool
    closed: bool
    limit: int
    #: tickets held (``max_requests_in_graph``); None without that limit
    in_graph: int | None = None
    graph_limit: int | None = None
    #: tickets handed out and released since the gate opened (each exactly once)
    tickets_issued: int = 0
    tickets_released: int = 0


class AdmissionGate:
    """At most ``limit`` admissions hold a slot at once; see the module docstring.

    ``policy`` is what an admission gets at the limit or while paused (``wait``: queue
    first-in first-out, ``reject``: :class:`EngineOverloadedError`); ``max_waiting`` bounds the
    queue (None: no bound); ``graph_limit`` is ``max_requests_in_graph`` (None: no tickets).
    Raises ValueError for a limit or graph_limit below 1 or a negative max_waiting.
    """

    __slots__ = (
        "_closed",
        "_graph_limit",
        "_in_flight",
        "_issued",
        "_limit",
        "_max_waiting",
        "_paused",
        "_policy",
        "_released",
        "_tickets",
        "_waiters",
    )

    def __init__(
        self,
        limit: int,
        policy: Policy = "wait",
        max_waiting: int | None = None,
        graph_limit: int | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError(f"limit (max_requests_in_flight) must be at least 1, not {limit}")
        if graph_limit is not None and graph_limit < 1:
            raise ValueError(
                f"graph_limit (max_requests_in_graph) must be None or at least 1, not {graph_limit}"
            )
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be None or at least 0, not {max_waiting}")
        if policy not in ("wait", "reject"):
            raise ValueError(f"policy (admission) must be 'wait' or 'reject', not {policy!r}")
        self._limit = limit
        self._policy: Policy = policy
        self._max_waiting = max_waiting
        self._in_flight = 0
        # parked tasks, first-in first-out (a dict keeps insertion order, removes in O(1))
        self._waiters: dict[Task, None] = {}
        self._paused = False
        self._closed = False
        self._graph_limit = graph_limit
        # the tickets held now (a dict keeps the order they were issued in)
        self._tickets: dict[GraphTicket, None] = {}
        self._issued = 0
        self._released = 0

    # -- admission -------------------------------------------------------------------------
    def admit_nowait(self) -> GraphTicket | None:
        """Take a slot now, and a ticket with ``max_requests_in_graph`` (returned; None
        without that limit). Synchronous. Raises ``trio.WouldBlock`` when the admission would
        have to wait (nothing is taken), :class:`EngineOverloadedError` when it is refused
        (``reject`` at a limit or paused, or ``max_waiting`` admissions already wait),
        :class:`EngineClosedError` after :meth:`close`."""
        # the common case first, without building a decision: room, nobody waits, open
        if (
            self._in_flight < self._limit
            and self._graph_limit is None
            and not self._waiters
            and not self._paused
            and not self._closed
        ):
            self._in_flight += 1
            return None
        decision = self._decide()
        if decision == "admit":
            return self._take()
        if decision == "wait":
            raise trio.WouldBlock
        raise self._refusal(decision)

    async def admit(self) -> GraphTicket | None:
        """Take a slot (and a ticket, see :meth:`admit_nowait`), waiting first-in first-out
        for them under ``wait``.

        Always checkpoints. Cancelled before it takes them (also while it waits, also when
        they were handed to it just before the cancellation reached it), it holds nothing
        and is no longer counted; what was handed to it passes to the next waiter. Raises
        :class:`EngineOverloadedError` when refused (see :meth:`admit_nowait`),
        :class:`EngineClosedError` after :meth:`close`, also when it closes while waiting.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        decision = self._decide()
        if decision == "admit":
            taken = self._take()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return taken
        if decision != "wait":
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise self._refusal(decision)
        task = trio.lowlevel.current_task()
        self._waiters[task] = None

        def abort(_: RaiseCancelT) -> Abort:
            # a cancelled waiter leaves the queue at once: no trace, nothing handed to it
            del self._waiters[task]
            return Abort.SUCCEEDED

        # rescheduled by _wake (the slot and the ticket are ours, counted) or by close
        # (raises)
        ticket: GraphTicket | None = await trio.lowlevel.wait_task_rescheduled(abort)
        try:
            # a cancellation that came after the hand-over, before this task ran: the caller
            # no longer wants them, so the next waiter gets them
            await trio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            if ticket is not None:
                ticket.release()
            self.release()
            raise
        return ticket

    def _take(self) -> GraphTicket | None:
        # a slot, and a ticket under max_requests_in_graph; decide() said there is room
        self._in_flight += 1
        if self._graph_limit is None:
            return None
        ticket = GraphTicket(self)
        self._tickets[ticket] = None
        self._issued += 1
        return ticket

    def _return_ticket(self, ticket: GraphTicket) -> None:
        # GraphTicket.release, once per ticket
        del self._tickets[ticket]
        self._released += 1
        if self._waiters:
            self._wake()

    def release(self) -> None:
        """Give back one slot (a request ended); it goes to the first waiter, if any and not
        paused. Synchronous. Raises RuntimeError when no slot is taken."""
        if self._in_flight <= 0:
            raise RuntimeError("AdmissionGate.release() without a slot taken")
        self._in_flight -= 1
        if self._waiters:
            self._wake()

    # -- control -----------------------------------------------------------------------------
    def pause(self) -> None:
        """Hold every new admission (it waits, or is refused under ``reject``) even with room;
        slots already taken are kept. Synchronous, idempotent."""
        self._paused = True

    def resume(self) -> None:
        """End a pause: the waiters get the free slots, first-in first-out. Synchronous,
        idempotent."""
        self._paused = False
        if self._waiters:
            self._wake()

    def close(self) -> None:
        """Refuse every later admission, fail every waiter with :class:`EngineClosedError`
        and release every ticket still held (their requests' streams may still be read; a
        later release of one is a no-op). Synchronous, idempotent; slots taken can still be
        released."""
        self._closed = True
        waiters, self._waiters = self._waiters, {}
        for task in waiters:
            error = EngineClosedError("the engine closed while the request waited for admission")
            trio.lowlevel.reschedule(task, outcome.Error(error))
        for ticket in list(self._tickets):
            ticket.release()

    # -- state ---------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def in_graph(self) -> int | None:
        """Tickets held (``max_requests_in_graph``); None without that limit."""
        return None if self._graph_limit is None else len(self._tickets)

    def statistics(self) -> AdmissionStatistics:
        """A frozen snapshot: slots taken, waiters, paused, closed, the limit, the tickets."""
        return AdmissionStatistics(
            in_flight=self._in_flight,
            waiting=len(self._waiters),
            paused=self._paused,
            closed=self._closed,
            limit=self._limit,
            in_graph=self.in_graph,
            graph_limit=self._graph_limit,
            tickets_issued=self._issued,
            tickets_released=self._released,
        )

    def _decide(self) -> Decision:
        return decide(
            in_flight=self._in_flight,
            limit=self._limit,
            waiting=len(self._waiters),
            paused=self._paused,
            closed=self._closed,
            policy=self._policy,
            max_waiting=self._max_waiting,
            in_graph=len(self._tickets),
            graph_limit=self._graph_limit,
        )

    def _wake(self) -> None:
        n = grants(
            in_flight=self._in_flight,
            limit=self._limit,
            waiting=len(self._waiters),
            paused=self._paused,
            in_graph=len(self._tickets),
            graph_limit=self._graph_limit,
        )
        for _ in range(n):
            task = next(iter(self._waiters))
            del self._waiters[task]
            # the slot and the ticket are the waiter's from now: nobody can overtake it
            trio.lowlevel.reschedule(task, outcome.Value(self._take()))

    def _refusal(self, decision: Decision) -> EngineClosedError | EngineOverloadedError:
        if decision == "closed":
            return EngineClosedError("the engine is closed; it accepts no new requests")
        if decision == "paused":
            return EngineOverloadedError(
                "admission is paused (engine.pause()) and admission is 'reject': "
                "a new request is refused until resume()"
            )
        if decision == "queue_full":
            return EngineOverloadedError(
                f"{len(self._waiters)} requests already wait for admission, the limit "
                f"(max_waiting) is {self._max_waiting} ({self._in_flight} in flight, "
                f"max_requests_in_flight is {self._limit})"
            )
        if decision == "graph_full":
            return EngineOverloadedError(
                f"{len(self._tickets)} requests in the pipeline (admitted, their consumers "
                f"not done), the limit (max_requests_in_graph) is {self._graph_limit} and "
                "admission is 'reject'"
            )
        return EngineOverloadedError(
            f"{self._in_flight} requests in flight, the limit (max_requests_in_flight) is "
            f"{self._limit} and admission is 'reject'"
        )

    def __repr__(self) -> str:
        bound = "" if self._max_waiting is None else f"/{self._max_waiting}"
        graph = (
            ""
            if self._graph_limit is None
            else f" in_graph={len(self._tickets)}/{self._graph_limit}"
        )
        return (
            f"<AdmissionGate {self._policy} in_flight={self._in_flight}/{self._limit}{graph} "
            f"waiting={len(self._waiters)}{bound}"
            f"{' paused' if self._paused else ''}{' closed' if self._closed else ''}>"
        )
