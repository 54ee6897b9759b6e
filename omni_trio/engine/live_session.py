"""Live sessions: full-duplex conversations on top of streaming-input requests.

Structure (one owner per thing). The engine's
:class:`~omni_trio.engine.live_registry.SessionRegistry` runs in the engine's requests nursery
and owns one task per session; that task owns the session's nursery, which
owns its turns (one task per user turn: it enters the turn's
:class:`~omni_trio.engine.streams.RequestStream` and moves its outputs into the session's
:class:`~omni_trio.engine.live_events.Journal`) and its lease timer. A turn's response runs
in a cancel scope the session owns: a barge-in cancels it, so nothing of an old epoch reaches
a later turn, and an error of a cancelled response is kept on it, never published. Closing a
session (its block, :meth:`Session.aclose`, its lease, a dead replica, the engine's close)
cancels the session's task once; its turns' streams wait, shielded, until every stage dropped
their requests, then ``SessionClosed`` is published and the admission slot given back.

Which bound waits and which raises:

- waits: an append while the entry stage does not keep up (the request's bounded input
  channel, ``output_buffer`` segments); a response delta while the journal holds
  ``journal_events`` / ``journal_bytes`` of events nobody read yet (the request's stages
  then wait on their output channel);
- raises :class:`SessionBackpressureError`: an append over ``max_pending_input_bytes`` (one
  user turn's input), or one starting a turn beyond ``max_pending_turns`` (turns whose
  response has not ended) or while the journal is full of events nobody read;
- raises :class:`SessionLimitError` (retryable): an open beyond ``max_sessions``.

The decisions are pure functions in :mod:`omni_trio.engine.live_rules`.

The seed's duplex calls map as: ``open_duplex_session`` -> :meth:`Engine.open_session`,
``append_duplex_input`` -> :meth:`Session.append`, ``signal_duplex_turn`` ->
:meth:`Session.commit`, ``touch_duplex_session`` -> :meth:`Session.touch`,
``close_duplex_session`` -> :meth:`Session.aclose` (or leaving the block),
``resume_duplex_session`` -> :meth:`Session.detach` + :meth:`Engine.resume_session`.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal, Protocol

import trio

from ..config.pipeline import SessionsConfig
from ..errors import (
    InvalidRequestError,
    OmniTrioError,
    ReplicaDeadError,
    SessionBackpressureError,
    SessionClosedError,
    StaleFenceError,
)
from ..outputs import OmniOutput, Prompt, SamplingParams
from .live_events import (
    Journal,
    ResponseDelta,
    ResponseDone,
    ResponseStarted,
    ResponseStatus,
    SessionClosed,
    SessionEvent,
)
from .live_rules import (
    Fence,
    LeaseState,
    append_refusal,
    as_fence,
    commits_answered_turn,
    fence_refusal,
    input_bytes,
    lease_deadline,
    remember,
)
from .streams import RequestStream


class Generate(Protocol):
    """What a session needs of the engine: ``Engine.generate``'s streaming-input call."""

    def __call__(
        self,
        prompt: Prompt,
        request_id: str | None = ...,
        sampling_params: SamplingParams = ...,
        *,
        streaming_input: bool = ...,
        output_modalities: Sequence[str] | None = ...,
        trace_headers: Mapping[str, str] | None = ...,
    ) -> RequestStream: ...


__all__ = ["AppendReceipt", "Session", "SessionCore", "SessionStatistics"]

#: what ``update()`` and ``open_session(config=...)`` accept
SETTINGS = ("sampling_params", "output_modalities")
#: operation ids remembered per session for dedupe
OPERATIONS_KEPT = 1024


@dataclass(frozen=True, slots=True)
class AppendReceipt:
    """What an append did: the turn and epoch it went to, its index in that turn. A retry
    with the same ``operation_id`` gets the equal receipt and appends nothing."""

    turn_id: int
    epoch: int
    index: int
    operation_id: str | None


@dataclass(frozen=True, slots=True)
class SessionStatistics:
    """A snapshot of a live session."""

    session_id: str
    state: str  # open | closing | closed
    epoch: int
    turn_id: int
    responses_in_flight: int
    responses_total: int
    responses_completed: int
    responses_cancelled: int
    responses_failed: int
    pending_input_bytes: int
    lease_state: LeaseState
    lease_generation: int
    detached: bool
    journal_events: int
    journal_bytes: int
    last_seq: int


class _Turn:
    """One user turn and its response (its request)."""

    __slots__ = (
        "chunks",
        "ended",
        "epoch",
        "input_bytes",
        "late_error",
        "response_id",
        "scope",
        "status",
        "stream",
        "turn_id",
    )

    def __init__(self, turn_id: int, epoch: int, response_id: str, stream: RequestStream) -> None:
        self.turn_id = turn_id
        self.epoch = epoch
        self.response_id = response_id
        self.stream = stream
        self.scope = trio.CancelScope()  # the session cancels it (barge-in)
        self.status: ResponseStatus | None = None  # set once, when ResponseDone is published
        self.ended = trio.Event()  # its task ended: every stage dropped its request
        self.input_bytes = 0
        self.chunks = 0
        self.late_error: BaseException | None = None  # raised after it was cancelled


class SessionCore:
    """The session itself (its state, its task, its turns); :class:`Session` handles reach it
    while their lease holds, and :class:`~omni_trio.engine.live_registry.SessionRegistry`
    owns its task and its admission slot."""

    def __init__(
        self,
        session_id: str,
        settings: dict[str, object],
        *,
        generate: Generate,
        limits: SessionsConfig,
        release: Callable[[SessionCore], None],
        trace_headers: Mapping[str, str] | None = None,
    ) -> None:
        self.generate = generate
        #: the trace context its turns continue (who opened or last resumed it)
        self.trace_headers = trace_headers
        self.limits = limits
        self._release = release  # gives the admission slot back, once the session ended
        self.session_id = session_id
        self.settings = settings
        self.epoch = 0
        self.turn_id = 0
        self.state: Literal["open", "closing", "closed"] = "open"
        self.reason = ""
        self.error: BaseException | None = None
        self.journal = Journal(self.limits.journal_events, self.limits.journal_bytes)
        self.turns: dict[int, _Turn] = {}  # responses in flight (the open turn included)
        self.open_turn: _Turn | None = None  # the turn appends go to
        # the last turn, when its response ended before its commit (it needed no more input)
        self.answered: _Turn | None = None
        self.lock = trio.StrictFIFOLock()  # appends and commits, in order
        self.ops: OrderedDict[str, AppendReceipt] = OrderedDict()
        self.counts = {"total": 0, "completed": 0, "cancelled": 0, "failed": 0}
        # the lease: its generation changes at each detach and resume (compare-and-swap)
        self.generation = 0
        self.lease: LeaseState = "attached"
        self.token: str | None = None
        self.last_activity = trio.current_time()
        self.detached_at = 0.0
        self.lease_changed = trio.Event()
        self.scope = trio.CancelScope()  # the session's task: closing cancels it
        self.nursery: trio.Nursery | None = None
        self.ended = trio.Event()

    # -- the session's task ------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self.scope:
                async with trio.open_nursery() as nursery:
                    self.nursery = nursery
                    nursery.start_soon(self._lease_timer)
                    task_status.started()
                    await trio.sleep_forever()
        finally:
            # the nursery is done: every turn's stream waited until its stages dropped it
            self.nursery = None
            self.state = "closed"
            if not self.reason:
                self.reason = "closed"
            self.journal.append(
                lambda s: SessionClosed(seq=s, reason=self.reason, error=self.error)
            )
            self._release(self)
            self.ended.set()

    def begin_close(self, reason: str, error: BaseException | None = None) -> bool:
        """End the session (once: a later call returns False). Synchronous."""
        if self.state != "open":
            return False
        self.state = "closing"
        self.reason = reason
        self.error = error
        if self.open_turn is not None:
            self.open_turn = None
        self.scope.cancel()
        return True

    async def _lease_timer(self) -> None:
        while True:
            changed = self.lease_changed
            deadline = lease_deadline(
                state=self.lease,
                last_activity=self.last_activity,
                detached_at=self.detached_at,
                idle_timeout_s=self.limits.idle_timeout_s,
                detach_grace_s=self.limits.detach_grace_s,
            )
            if trio.current_time() >= deadline:
                self.begin_close("detach_expired" if self.lease == "detached" else "idle_timeout")
                return
            with trio.move_on_at(deadline):
                await changed.wait()

    def touch(self) -> None:
        self.last_activity = trio.current_time()

    def new_lease(self, state: LeaseState, token: str | None) -> int:
        self.generation += 1
        self.lease = state
        self.token = token
        self.lease_changed.set()
        self.lease_changed = trio.Event()
        return self.generation

    # -- turns ---------------------------------------------------------------------------------
    async def start_turn(self, chunk: Prompt) -> _Turn:
        nursery = self.nursery
        if nursery is None:  # pragma: no cover - only while the session's task starts or ends
            raise SessionClosedError(f"session {self.session_id!r} is closing")
        turn_id = self.turn_id
        response_id = f"{self.session_id}/turn-{turn_id}"
        stream = self.generate(
            chunk,
            request_id=response_id,
            sampling_params=self.settings.get("sampling_params"),
            streaming_input=True,
            output_modalities=self.settings.get("output_modalities"),  # type: ignore[arg-type]
            trace_headers=self.trace_headers,
        )
        turn = _Turn(turn_id, self.epoch, response_id, stream)
        await nursery.start(self._run_turn, turn)
        self.answered = None
        return turn

    async def _run_turn(self, turn: _Turn, *, task_status: trio.TaskStatus[None]) -> None:
        status: ResponseStatus = "cancelled"  # unless it completes or fails
        error: BaseException | None = None
        started = False
        try:
            with turn.scope:
                async with turn.stream:
                    if turn.epoch != self.epoch or turn.turn_id != self.turn_id:
                        raise StaleFenceError(
                            f"a barge-in moved session {self.session_id!r} to epoch "
                            f"{self.epoch} while turn {turn.turn_id} was admitted; nothing "
                            "was appended"
                        )
                    self.turns[turn.turn_id] = turn
                    self.open_turn = turn
                    self.counts["total"] += 1
                    self.journal.append(
                        lambda s: ResponseStarted(
                            seq=s,
                            response_id=turn.response_id,
                            turn_id=turn.turn_id,
                            epoch=turn.epoch,
                        )
                    )
                    started = True
                    task_status.started()
                    async for out in turn.stream:
                        await self.journal.wait_room()
                        self._publish_delta(turn, out)
                    status = "completed"
        except Exception as exc:
            if not started:
                raise  # to the append that starts the turn
            if turn.status is not None:
                turn.late_error = exc  # a cancelled response's error: kept, never published
            else:
                status, error = "failed", exc
                if isinstance(exc, ReplicaDeadError):
                    self._finish(turn, status, error)
                    self.begin_close("replica_dead", exc)
        finally:
            if started:
                self.turns.pop(turn.turn_id, None)
                if self.open_turn is turn:
                    # its response ended before a commit: appends go to the next turn, and
                    # a commit still to come is that turn's (see Session.commit)
                    self.open_turn = None
                    self.answered = turn
                    self.turn_id += 1
                if turn.status is None:
                    # cancelled here means the session is closing: the response ends with it
                    self._finish(turn, status, error)
                turn.ended.set()

    def _publish_delta(self, turn: _Turn, out: OmniOutput) -> None:
        if turn.status is not None:  # pragma: no cover - a cancelled turn's task is cancelled
            return
        self.touch()
        self.journal.append(
            lambda s: ResponseDelta(
                seq=s,
                response_id=turn.response_id,
                stage_id=out.stage_id,
                text=out.text,
                token_ids=tuple(out.token_ids),
                data=out.data,
            )
        )

    def _finish(self, turn: _Turn, status: ResponseStatus, error: BaseException | None) -> None:
        turn.status = status
        self.counts[status] += 1
        self.journal.append(
            lambda s: ResponseDone(seq=s, response_id=turn.response_id, status=status, error=error)
        )

    def cancel_responses(self) -> list[_Turn]:
        """Cancel every response in flight, publish their ``cancelled`` ends, advance the
        epoch. Synchronous."""
        cancelled = [t for t in self.turns.values() if t.status is None]
        for turn in cancelled:
            turn.scope.cancel()
            self._finish(turn, "cancelled", None)
        if self.open_turn is not None:
            self.open_turn = None
            self.turn_id += 1
        self.answered = None
        self.epoch += 1
        return cancelled


class Session:
    """A client's handle on a live session; see the module docstring. Get one from
    :meth:`Engine.open_session <omni_trio.engine.engine.Engine.open_session>` or
    :meth:`Engine.resume_session <omni_trio.engine.engine.Engine.resume_session>`. It is
    valid while its lease holds: after :meth:`detach` (or another resume) its calls raise
    :class:`SessionClosedError`."""

    __slots__ = ("_core", "_cursor", "_generation")

    def __init__(self, core: SessionCore, generation: int, cursor: int) -> None:
        self._core = core
        self._generation = generation
        self._cursor = cursor  # the last seq this handle's events() delivered

    # -- state -----------------------------------------------------------------------------
    @property
    def session_id(self) -> str:
        return self._core.session_id

    @property
    def epoch(self) -> int:
        """Advances at each barge-in."""
        return self._core.epoch

    @property
    def turn_id(self) -> int:
        """The user turn the next append goes to (advances at each commit, and when an open
        turn ends: its response ended or a barge-in cancelled it)."""
        return self._core.turn_id

    @property
    def fence(self) -> Fence:
        """``Fence(epoch, turn_id)`` now: what a client passes to stay in step."""
        return Fence(self._core.epoch, self._core.turn_id)

    @property
    def attached(self) -> bool:
        """True while this handle holds the lease of an open session."""
        core = self._core
        return core.state == "open" and core.generation == self._generation

    def _check(self) -> SessionCore:
        core = self._core
        if core.state != "open":
            raise SessionClosedError(f"session {core.session_id!r} is {core.state} ({core.reason})")
        if core.generation != self._generation:
            raise SessionClosedError(
                f"this handle of session {core.session_id!r} was detached; resume it with "
                "engine.resume_session"
            )
        return core

    async def _checked(
        self, fence: Fence | tuple[int, int] | None, what: str, turn: bool
    ) -> SessionCore:
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            core = self._check()
            try:
                given = as_fence(fence)
            except TypeError as exc:
                raise InvalidRequestError(f"{what}: {exc}") from None
            reason = fence_refusal(
                given, epoch=core.epoch, turn_id=core.turn_id, check_turn=turn, what=what
            )
            if reason is not None:
                raise StaleFenceError(f"session {core.session_id!r}: {reason}")
        except OmniTrioError:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise
        return core

    # -- the client's calls ----------------------------------------------------------------
    async def append(
        self,
        chunk: Prompt,
        *,
        operation_id: str | None = None,
        fence: Fence | tuple[int, int] | None = None,
    ) -> AppendReceipt:
        """Append input (text, token ids, or a prompt dict, e.g. with audio samples) to the
        current user turn; the turn's first append starts its request (a streaming-input
        request to the entry stage) and waits for its admission.

        Waits while the entry stage does not keep up. Always checkpoints; cancelled, nothing
        was appended. A repeated ``operation_id`` is not applied again: it returns the
        first call's (equal) receipt. Raises :class:`SessionBackpressureError` over
        ``max_pending_input_bytes`` or ``max_pending_turns``; :class:`StaleFenceError` for a
        stale ``fence`` (or when a barge-in cancelled the turn while the append waited);
        :class:`SessionClosedError`; :class:`InvalidRequestError` for a bad chunk; the
        engine's admission errors. Nothing was appended when it raises.
        """
        core = await self._checked(fence, "append", True)
        if operation_id is not None and operation_id in core.ops:
            core.touch()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return core.ops[operation_id]
        async with core.lock:
            core = await self._checked(fence, "append", True)  # it may have moved meanwhile
            if operation_id is not None and operation_id in core.ops:
                return core.ops[operation_id]
            size = input_bytes(chunk)
            turn = core.open_turn
            reason = append_refusal(
                turn_open=turn is not None,
                pending_turns=len(core.turns),
                max_pending_turns=core.limits.max_pending_turns,
                turn_bytes=0 if turn is None else turn.input_bytes,
                chunk_bytes=size,
                max_pending_input_bytes=core.limits.max_pending_input_bytes,
                journal_room=core.journal.has_room(),
            )
            if reason is not None:
                raise SessionBackpressureError(f"session {core.session_id!r}: {reason}")
            if turn is None:
                turn = await core.start_turn(chunk)
            else:
                try:
                    await turn.stream.send_input(chunk)
                except InvalidRequestError as exc:
                    if turn.status is None:
                        raise
                    raise StaleFenceError(
                        f"session {core.session_id!r}: turn {turn.turn_id}'s response ended "
                        f"({turn.status}) while the append waited; nothing was appended"
                    ) from exc
            turn.input_bytes += size
            receipt = AppendReceipt(turn.turn_id, turn.epoch, turn.chunks, operation_id)
            turn.chunks += 1
            if operation_id is not None:
                remember(core.ops, operation_id, receipt, OPERATIONS_KEPT)
            core.touch()
            return receipt

    async def commit(self, *, fence: Fence | tuple[int, int] | None = None) -> str:
        """End the current user turn's input; its response goes on streaming as events, and
        the next append starts the next turn (full duplex). Returns the response id.

        A turn whose response ended before its commit (the model needed no more input: the
        turn id moved on then) is still the one a commit without a fence, or with that
        turn's fence, ends: it returns that response's id and changes nothing, once.

        Always checkpoints. Raises :class:`InvalidRequestError` when the turn has no input
        yet, :class:`StaleFenceError`, :class:`SessionClosedError`.
        """
        core = await self._checked(fence, "commit", False)
        async with core.lock:
            core = await self._checked(fence, "commit", False)
            answered = core.answered
            if answered is not None and commits_answered_turn(
                as_fence(fence),
                answered=Fence(answered.epoch, answered.turn_id),
                turn_open=core.open_turn is not None,
            ):
                core.answered = None
                core.touch()
                return answered.response_id
            core = await self._checked(fence, "commit", True)
            turn = core.open_turn
            if turn is None:
                raise InvalidRequestError(
                    f"session {core.session_id!r}: nothing to commit, turn {core.turn_id} has "
                    "no input (append first)"
                )
            core.open_turn = None
            core.turn_id += 1
            core.touch()
            await turn.stream.end_input()
            return turn.response_id

    async def barge_in(self, *, fence: Fence | tuple[int, int] | None = None) -> int:
        """Cancel every response in flight at once (the open turn's too), in every stage:
        each ends ``cancelled`` before this first checkpoints, nothing more of it is
        published (a late error is kept on it, never raised), and ``epoch`` advances.
        Returns how many responses it cancelled, once every stage dropped them.

        Always checkpoints; cancelled before it starts, nothing happens; once started, the
        cancellation is done whatever happens to the caller (cancelling it ends its wait).
        Raises :class:`StaleFenceError` for a ``fence`` of another epoch (no effect),
        :class:`SessionClosedError`.
        """
        core = await self._checked(fence, "cancel", False)
        cancelled = core.cancel_responses()
        core.touch()
        for turn in cancelled:
            await turn.ended.wait()
        await trio.lowlevel.checkpoint()
        return len(cancelled)

    cancel_response = barge_in

    def update(self, **config: object) -> None:
        """Change what later turns use: ``sampling_params``, ``output_modalities``. The
        responses in flight keep theirs. Synchronous. Raises :class:`InvalidRequestError`
        for another key, :class:`SessionClosedError`."""
        core = self._check()
        core.settings.update(check_settings(config))
        core.touch()

    def touch(self) -> None:
        """The client is alive: renew the idle lease. Synchronous. Raises
        :class:`SessionClosedError`."""
        self._check().touch()

    def ack(self, seq: int) -> None:
        """The client processed every event up to ``seq``: the journal drops them (a resume
        can no longer replay them). Synchronous."""
        self._check().journal.ack(seq)

    async def events(self) -> AsyncGenerator[SessionEvent, None]:
        """The session's events in ``seq`` order, from after the last one this handle got
        (after ``last_seq`` for a resumed handle), ending after :class:`SessionClosed`, or
        when this handle is detached. Waiting for an event is a checkpoint; cancelling it
        loses nothing (the journal keeps the events)."""
        core = self._core
        while True:
            if core.generation != self._generation and core.state == "open":
                return
            batch = core.journal.after(self._cursor)
            if not batch:
                if core.journal.closed:
                    return
                await core.journal.wait_after(self._cursor)
                continue
            for event in batch:
                if core.generation != self._generation and core.state == "open":
                    return
                self._cursor = event.seq
                if core.generation == self._generation:
                    core.journal.mark_delivered(event.seq)
                yield event
                if isinstance(event, SessionClosed):
                    return

    async def detach(self) -> str:
        """The client went away: the session lives on for ``detach_grace_s`` and this handle
        is done. Returns the token :meth:`Engine.resume_session` needs. Always checkpoints.
        Raises :class:`SessionClosedError`."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            core = self._check()
        except SessionClosedError:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise
        token = f"{core.generation + 1}.{secrets.token_urlsafe(16)}"
        core.detached_at = trio.current_time()
        core.new_lease("detached", token)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return token

    async def aclose(self) -> None:
        """Close the session (its responses are cancelled) and wait until every stage dropped
        its requests and ``SessionClosed`` was published. Idempotent; a no-op for a handle
        that was detached. Always checkpoints; not cancellable."""
        core = self._core
        if core.generation == self._generation:
            core.begin_close("closed")
        with trio.CancelScope(shield=True):
            if core.generation == self._generation or core.state != "open":
                await core.ended.wait()
            await trio.lowlevel.checkpoint()

    def close_nowait(self, reason: str = "closed") -> None:
        """Begin closing the session, as :meth:`aclose` does, without waiting: its responses
        are cancelled and, once every stage dropped them, ``SessionClosed(reason)`` is
        published by the session's own task. Synchronous, idempotent; a no-op for a handle
        that was detached."""
        core = self._core
        if core.generation == self._generation:
            core.begin_close(reason)

    def statistics(self) -> SessionStatistics:
        """A frozen snapshot. Synchronous."""
        core = self._core
        counts = core.counts
        open_turn = core.open_turn
        return SessionStatistics(
            session_id=core.session_id,
            state=core.state,
            epoch=core.epoch,
            turn_id=core.turn_id,
            responses_in_flight=sum(1 for t in core.turns.values() if t.status is None),
            responses_total=counts["total"],
            responses_completed=counts["completed"],
            responses_cancelled=counts["cancelled"],
            responses_failed=counts["failed"],
            pending_input_bytes=0 if open_turn is None else open_turn.input_bytes,
            lease_state=core.lease,
            lease_generation=core.generation,
            detached=core.lease == "detached",
            journal_events=core.journal.n_events,
            journal_bytes=core.journal.n_bytes,
            last_seq=core.journal.next_seq - 1,
        )

    def __repr__(self) -> str:
        core = self._core
        return (
            f"<Session {core.session_id!r} {core.state} epoch={core.epoch} "
            f"turn={core.turn_id} in_flight={len(core.turns)} lease={core.lease}"
            f"{'' if core.generation == self._generation else ' (this handle detached)'}>"
        )


def check_settings(config: Mapping[str, object] | None) -> dict[str, object]:
    """The settings a session's turns use, checked. Pure. Raises InvalidRequestError naming
    an unknown key or a bad ``output_modalities``."""
    if config is None:
        return {}
    unknown = sorted(set(config) - set(SETTINGS))
    if unknown:
        raise InvalidRequestError(
            f"unknown session setting(s) {unknown}; a session takes {list(SETTINGS)}"
        )
    modalities = config.get("output_modalities")
    if modalities is not None and (
        isinstance(modalities, str)
        or not isinstance(modalities, Sequence)
        or not all(isinstance(m, str) for m in modalities)
    ):
        raise InvalidRequestError(
            f"output_modalities must be a sequence of strings, not {modalities!r}"
        )
    return dict(config)


@asynccontextmanager
async def session_block(opening: Awaitable[Session]) -> AsyncIterator[Session]:
    """The ``async with`` of an open or resumed session: leaving closes it unless this
    handle was detached."""
    session = await opening
    try:
        yield session
    finally:
        await session.aclose()
