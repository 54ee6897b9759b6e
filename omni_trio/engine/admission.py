"""Pipeline-level admission: at most ``max_requests_in_flight`` requests run at once.

One :class:`AdmissionGate` per engine. A request takes a slot when it is admitted and gives
it back when it ends (:meth:`AdmissionGate.release`). At the limit, ``admission: wait`` queues
admissions first-in first-out (at most ``max_waiting`` of them) and ``admission: reject``
refuses at once with :class:`~omni_trio.errors.EngineOverloadedError`. A freed slot goes
straight to the first waiter, so a newcomer never overtakes the queue. ``pause()`` holds every
new admission (it waits, or is refused under ``reject``) while the requests in flight go on;
``resume()`` lets the waiters in, in order. ``close()`` fails every waiter with
:class:`~omni_trio.errors.EngineClosedError`.

The rule is two pure functions (:func:`decide`, :func:`grants`); the gate holds the counts
and the parked tasks. A waiter is a parked trio task: cancelling it removes it from the queue
at once (trio calls the abort function synchronously), so it leaves no trace. A waiter that
was handed a slot and then cancelled before it ran passes the slot on to the next one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import outcome
import trio
from trio.lowlevel import Abort, RaiseCancelT, Task

from ..errors import EngineClosedError, EngineOverloadedError

__all__ = ["AdmissionGate", "AdmissionStatistics", "Decision", "Policy", "decide", "grants"]

#: what a request gets at the limit (the config's ``admission``)
Policy = Literal["wait", "reject"]
#: what a new admission gets: a slot now, a place in the queue, or a refusal and its reason
Decision = Literal["admit", "wait", "full", "paused", "queue_full", "closed"]


def decide(
    *,
    in_flight: int,
    limit: int,
    waiting: int,
    paused: bool,
    closed: bool,
    policy: Policy,
    max_waiting: int | None,
) -> Decision:
    """What a new admission gets. Pure.

    A slot only when there is room, admission is not paused and nobody waits (waiters keep
    their turn). Otherwise ``reject`` refuses (``paused`` or ``full``); ``wait`` queues it
    unless ``max_waiting`` admissions already wait (``queue_full``).
    """
    if closed:
        return "closed"
    if not paused and in_flight < limit and waiting == 0:
        return "admit"
    if policy == "reject":
        return "paused" if paused else "full"
    if max_waiting is not None and waiting >= max_waiting:
        return "queue_full"
    return "wait"


def grants(*, in_flight: int, limit: int, waiting: int, paused: bool) -> int:
    """How many waiters, first first, get a slot now. Pure."""
    if paused:
        return 0
    return max(0, min(waiting, limit - in_flight))


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


class AdmissionGate:
    """At most ``limit`` admissions hold a slot at once; see the module docstring.

    ``policy`` is what an admission gets at the limit or while paused (``wait``: queue
    first-in first-out, ``reject``: :class:`EngineOverloadedError`); ``max_waiting`` bounds the
    queue (None: no bound). Raises ValueError for a limit below 1 or a negative max_waiting.
    """

    __slots__ = (
        "_closed",
        "_in_flight",
        "_limit",
        "_max_waiting",
        "_paused",
        "_policy",
        "_waiters",
    )

    def __init__(self, limit: int, policy: Policy = "wait", max_waiting: int | None = None) -> None:
        if limit < 1:
            raise ValueError(f"limit (max_requests_in_flight) must be at least 1, not {limit}")
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

    # -- admission -------------------------------------------------------------------------
    def admit_nowait(self) -> None:
        """Take a slot now. Synchronous. Raises ``trio.WouldBlock`` when the admission would
        have to wait (nothing is taken), :class:`EngineOverloadedError` when it is refused
        (``reject`` at the limit or paused, or ``max_waiting`` admissions already wait),
        :class:`EngineClosedError` after :meth:`close`."""
        # the common case first, without building a decision: room, nobody waits, open
        if (
            self._in_flight < self._limit
            and not self._waiters
            and not self._paused
            and not self._closed
        ):
            self._in_flight += 1
            return
        decision = self._decide()
        if decision == "admit":  # pragma: no cover - the common case above took it
            self._in_flight += 1
        elif decision == "wait":
            raise trio.WouldBlock
        else:
            raise self._refusal(decision)

    async def admit(self) -> None:
        """Take a slot, waiting first-in first-out for one under ``wait``.

        Always checkpoints. Cancelled before it takes a slot (also while it waits, also when
        a slot was handed to it just before the cancellation reached it), it holds nothing
        and is no longer counted; a slot handed to it passes to the next waiter. Raises
        :class:`EngineOverloadedError` when refused (see :meth:`admit_nowait`),
        :class:`EngineClosedError` after :meth:`close`, also when it closes while waiting.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        decision = self._decide()
        if decision == "admit":
            self._in_flight += 1
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        if decision != "wait":
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise self._refusal(decision)
        task = trio.lowlevel.current_task()
        self._waiters[task] = None

        def abort(_: RaiseCancelT) -> Abort:
            # a cancelled waiter leaves the queue at once: no trace, nothing handed to it
            del self._waiters[task]
            return Abort.SUCCEEDED

        # rescheduled by _wake (the slot is ours, counted) or by close (raises)
        await trio.lowlevel.wait_task_rescheduled(abort)
        try:
            # a cancellation that came after the hand-over, before this task ran: the caller
            # no longer wants the slot, so the next waiter gets it
            await trio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            self.release()
            raise

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
        """Refuse every later admission and fail every waiter with
        :class:`EngineClosedError`. Synchronous, idempotent; slots taken can still be
        released."""
        self._closed = True
        waiters, self._waiters = self._waiters, {}
        for task in waiters:
            error = EngineClosedError("the engine closed while the request waited for admission")
            trio.lowlevel.reschedule(task, outcome.Error(error))

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

    def statistics(self) -> AdmissionStatistics:
        """A frozen snapshot: slots taken, waiters, paused, closed, the limit."""
        return AdmissionStatistics(
            in_flight=self._in_flight,
            waiting=len(self._waiters),
            paused=self._paused,
            closed=self._closed,
            limit=self._limit,
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
        )

    def _wake(self) -> None:
        n = grants(
            in_flight=self._in_flight,
            limit=self._limit,
            waiting=len(self._waiters),
            paused=self._paused,
        )
        for _ in range(n):
            task = next(iter(self._waiters))
            del self._waiters[task]
            self._in_flight += 1  # the slot is the waiter's from now: nobody can overtake it
            trio.lowlevel.reschedule(task)

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
        return EngineOverloadedError(
            f"{self._in_flight} requests in flight, the limit (max_requests_in_flight) is "
            f"{self._limit} and admission is 'reject'"
        )

    def __repr__(self) -> str:
        bound = "" if self._max_waiting is None else f"/{self._max_waiting}"
        return (
            f"<AdmissionGate {self._policy} in_flight={self._in_flight}/{self._limit} "
            f"waiting={len(self._waiters)}{bound}"
            f"{' paused' if self._paused else ''}{' closed' if self._closed else ''}>"
        )
