"""The decisions of live sessions, as pure functions: admission, fences, appends, leases,
the journal's bounds, resume checks and operation-id dedupe.

:mod:`omni_trio.engine.live_session` holds the state and the tasks and asks these; each one
is small enough to test on its own values (``tests/engine/test_live_rules.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

__all__ = [
    "Fence",
    "SessionDecision",
    "admit_session",
    "append_refusal",
    "as_fence",
    "fence_refusal",
    "has_room",
    "input_bytes",
    "lease_deadline",
    "remember",
    "resume_refusal",
    "trim_count",
]

V = TypeVar("V")

#: what a new session gets
SessionDecision = Literal["admit", "full", "exists", "closed"]
#: the lease's state
LeaseState = Literal["attached", "detached"]


@dataclass(frozen=True, slots=True)
class Fence:
    """What a client last saw: the session's ``epoch`` and ``turn_id``."""

    epoch: int
    turn_id: int


def as_fence(fence: Fence | tuple[int, int] | None) -> Fence | None:
    """A ``Fence`` from a fence or an ``(epoch, turn_id)`` pair. Pure. Raises TypeError for
    anything else."""
    if fence is None or isinstance(fence, Fence):
        return fence
    if (
        isinstance(fence, tuple)
        and len(fence) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in fence)
    ):
        return Fence(fence[0], fence[1])
    raise TypeError(f"a fence is a Fence or an (epoch, turn_id) pair of ints, not {fence!r}")


def admit_session(*, held: int, limit: int, exists: bool, closed: bool) -> SessionDecision:
    """Whether a new session may open: the engine is open, its id is not held, and fewer
    than ``limit`` sessions hold a slot (a closing one holds its slot until its stages
    dropped its requests). Pure."""
    if closed:
        return "closed"
    if exists:
        return "exists"
    if held >= limit:
        return "full"
    return "admit"


def fence_refusal(
    fence: Fence | None, *, epoch: int, turn_id: int, check_turn: bool, what: str
) -> str | None:
    """Why a call carrying ``fence`` must be refused, or None. No fence: never refused. An
    epoch other than the current one is stale (a barge-in moved it on); so is another turn
    when ``check_turn`` (appends and commits; a cancel targets the epoch). Pure."""
    if fence is None:
        return None
    if fence.epoch != epoch:
        return (
            f"{what} carries epoch {fence.epoch}, the session is at epoch {epoch} "
            "(a barge-in moved it on); it had no effect"
        )
    if check_turn and fence.turn_id != turn_id:
        return (
            f"{what} carries turn {fence.turn_id}, the session's current turn is {turn_id}; "
            "it had no effect"
        )
    return None


def commits_answered_turn(given: Fence | None, *, answered: Fence, turn_open: bool) -> bool:
    """Whether a commit ends the turn whose response already ended before its commit
    (``answered``) rather than the current one: only while no later turn has input, and for a
    commit without a fence or with that turn's fence. Pure."""
    return not turn_open and (given is None or given == answered)


def append_refusal(
    *,
    turn_open: bool,
    pending_turns: int,
    max_pending_turns: int,
    turn_bytes: int,
    chunk_bytes: int,
    max_pending_input_bytes: int,
    journal_room: bool = True,
) -> str | None:
    """Why an append must be refused (raise, not wait), or None. An append that starts a
    turn when ``max_pending_turns`` turns have a response in flight, or while the journal
    holds as many unread events as it may (``journal_room`` false: a client that does not
    read would otherwise grow it by each turn's start and end), or one that would take its
    turn's input over ``max_pending_input_bytes``. Pure."""
    if not turn_open and pending_turns >= max_pending_turns:
        return (
            f"{pending_turns} turns have a response in flight, the limit "
            f"(sessions.max_pending_turns) is {max_pending_turns}; nothing was appended"
        )
    if not turn_open and not journal_room:
        return (
            "the session's events are not being read (the journal holds as many unread "
            "events as sessions.journal_events / journal_bytes allow); read them before "
            "starting a turn; nothing was appended"
        )
    if turn_bytes + chunk_bytes > max_pending_input_bytes:
        return (
            f"the turn holds {turn_bytes} input bytes, this chunk has {chunk_bytes}, the "
            f"limit (sessions.max_pending_input_bytes) is {max_pending_input_bytes}; "
            "nothing was appended"
        )
    return None


def input_bytes(chunk: object) -> int:
    """An estimate of an input chunk's size in bytes: UTF-8 text, 4 bytes a token id,
    ``nbytes`` of arrays, the length of bytes, the sum over a mapping's values. Pure."""
    if isinstance(chunk, str):
        return len(chunk.encode("utf-8"))
    if isinstance(chunk, (bytes, bytearray, memoryview)):
        return len(chunk)
    nbytes = getattr(chunk, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(chunk, Mapping):
        return sum(input_bytes(v) for v in chunk.values())
    if isinstance(chunk, Sequence):
        return sum(4 if isinstance(v, int) else input_bytes(v) for v in chunk)
    return 0


def lease_deadline(
    *,
    state: LeaseState,
    last_activity: float,
    detached_at: float,
    idle_timeout_s: float,
    detach_grace_s: float,
) -> float:
    """When the lease expires on the trio clock: ``detach_grace_s`` after a detach, else
    ``idle_timeout_s`` after the last activity (a client call or a response event). Pure."""
    if state == "detached":
        return detached_at + detach_grace_s
    return last_activity + idle_timeout_s


def resume_refusal(
    *,
    state: LeaseState,
    token: str | None,
    given: str,
    last_seq: int,
    first_kept_seq: int,
    next_seq: int,
) -> str | None:
    """Why a resume must be refused, or None: the session is not detached (nobody may take
    an attached session), the token is not the one the last detach issued (compare-and-swap
    on the lease generation: a stale or used token loses), or the events after ``last_seq``
    are no longer all in the journal (or ``last_seq`` is ahead of it). Pure."""
    if state != "detached" or token is None:
        return "the session is not detached (another client holds it)"
    if given != token:
        return "the resume token is stale (a later detach or another resume superseded it)"
    if last_seq < first_kept_seq - 1:
        return (
            f"events after seq {last_seq} were trimmed from the journal (it holds seq "
            f"{first_kept_seq} on)"
        )
    if last_seq >= next_seq:
        return f"last_seq {last_seq} is ahead of the session's last event ({next_seq - 1})"
    return None


def has_room(
    *, undelivered_events: int, undelivered_bytes: int, max_events: int, max_bytes: int
) -> bool:
    """Whether one more response delta may go into the journal now: the events nobody read
    yet stay within ``journal_events`` and ``journal_bytes`` (one is always let in). Pure."""
    if undelivered_events == 0:
        return True
    return undelivered_events < max_events and undelivered_bytes < max_bytes


def trim_count(
    sizes: Sequence[int],
    *,
    total_bytes: int,
    first_seq: int,
    delivered_seq: int,
    acked_seq: int,
    max_events: int,
    max_bytes: int,
) -> int:
    """How many of the journal's oldest events to drop (``sizes`` oldest first, the first one
    is seq ``first_seq``; ``total_bytes`` is their sum): every acknowledged one, then delivered
    ones while the journal is over ``max_events`` or ``max_bytes``. Undelivered events are
    never dropped. Pure; reads only the sizes it drops and one more."""
    n = 0
    total = total_bytes
    count = len(sizes)
    while n < count:
        seq = first_seq + n
        over = count - n > max_events or total > max_bytes
        if seq <= acked_seq or (seq <= delivered_seq and over):
            total -= sizes[n]
            n += 1
            continue
        break
    return n


def remember(ops: OrderedDict[str, V], operation_id: str, reply: V, limit: int) -> None:
    """Record the reply of an applied operation, keeping the ``limit`` most recent (a retry
    of an older one is applied again). Mutates ``ops`` only."""
    ops[operation_id] = reply
    ops.move_to_end(operation_id)
    while len(ops) > limit:
        ops.popitem(last=False)
