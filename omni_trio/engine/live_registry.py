"""The engine's live sessions: admission (``max_sessions``, unique ids, the resume
compare-and-swap) and the nursery that owns every session's task.

A slot is taken synchronously when an open is admitted (so concurrent opens never exceed
``max_sessions``) and given back only when the session's task ended, that is once every stage
dropped its turns' requests: a session whose cleanup is slow keeps its slot, and no other
session waits for it. The decisions are :func:`~omni_trio.engine.live_rules.admit_session`
and :func:`~omni_trio.engine.live_rules.resume_refusal`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

import trio

from ..config.pipeline import SessionsConfig
from ..errors import (
    EngineClosedError,
    InvalidRequestError,
    OmniTrioError,
    SessionExistsError,
    SessionLimitError,
    SessionResumeError,
)
from .live_rules import admit_session, resume_refusal
from .live_session import Generate, Session, SessionCore, check_settings

__all__ = ["SessionRegistry"]


class SessionRegistry:
    """The engine's live sessions: admission (``max_sessions``, unique ids) and the nursery
    that owns every session's task. Owned by the engine session (it runs in its requests
    nursery and closes before the orchestrator)."""

    def __init__(self, generate: Generate, limits: SessionsConfig) -> None:
        self.generate = generate
        self.limits = limits
        self._sessions: dict[str, SessionCore] = {}  # every session holding a slot
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._closing = trio.Event()
        self._done = trio.Event()
        self.opened_total = 0

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the sessions' tasks until :meth:`close`, then wait until every one ended."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await self._closing.wait()
        finally:
            self._nursery = None
            self._done.set()

    def close(self) -> None:
        """Refuse new sessions and close every one (``engine_closed``). Synchronous,
        idempotent."""
        self._closed = True
        for core in list(self._sessions.values()):
            core.begin_close("engine_closed")
        self._closing.set()

    async def wait_closed(self) -> None:
        """Wait until every session ended (after :meth:`close`). Always checkpoints."""
        await trio.lowlevel.checkpoint()
        if self._nursery is not None or not self._closed:
            await self._done.wait()

    def release(self, core: SessionCore) -> None:
        """Give back an ended session's slot. Synchronous."""
        if self._sessions.get(core.session_id) is core:
            del self._sessions[core.session_id]

    @property
    def held(self) -> int:
        """Sessions holding a slot (open, detached, or closing)."""
        return len(self._sessions)

    @property
    def detached(self) -> int:
        """Sessions detached and waiting for a resume. O(sessions)."""
        return sum(1 for core in self._sessions.values() if core.lease == "detached")

    async def open(
        self,
        session_id: str | None,
        config: Mapping[str, object] | None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> Session:
        await trio.lowlevel.checkpoint_if_cancelled()
        sid = uuid.uuid4().hex if session_id is None else session_id
        try:
            if not isinstance(sid, str) or not sid:
                raise InvalidRequestError(f"session_id must be a non-empty string, not {sid!r}")
            settings = check_settings(config)
            decision = admit_session(
                held=len(self._sessions),
                limit=self.limits.max_sessions,
                exists=sid in self._sessions,
                closed=self._closed or self._nursery is None,
            )
            if decision == "closed":
                raise EngineClosedError("the engine is closed; it opens no new session")
            if decision == "exists":
                raise SessionExistsError(f"session {sid!r} is already open")
            if decision == "full":
                raise SessionLimitError(
                    f"{len(self._sessions)} sessions hold a slot, the limit "
                    f"(sessions.max_sessions) is {self.limits.max_sessions}; retry later"
                )
        except OmniTrioError:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise
        core = self._sessions[sid] = SessionCore(  # the slot, taken now
            sid,
            settings,
            generate=self.generate,
            limits=self.limits,
            release=self.release,
            trace_headers=trace_headers,
        )
        assert self._nursery is not None
        try:
            await self._nursery.start(core.serve)
        except BaseException:
            self.release(core)
            raise
        self.opened_total += 1
        return Session(core, core.generation, 0)

    async def resume(
        self,
        session_id: str,
        token: str,
        last_seq: int,
        trace_headers: Mapping[str, str] | None = None,
    ) -> Session:
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            core = self._sessions.get(session_id)
            if core is None or core.state != "open":
                raise SessionResumeError(f"session {session_id!r} is not open")
            reason = resume_refusal(
                state=core.lease,
                token=core.token,
                given=token,
                last_seq=last_seq,
                first_kept_seq=core.journal.first_seq,
                next_seq=core.journal.next_seq,
            )
            if reason is not None:
                raise SessionResumeError(f"cannot resume session {session_id!r}: {reason}")
        except OmniTrioError:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise
        generation = core.new_lease("attached", None)  # the swap: no checkpoint since the check
        core.trace_headers = trace_headers
        core.touch()
        core.journal.restart_delivery(last_seq)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return Session(core, generation, last_seq)
