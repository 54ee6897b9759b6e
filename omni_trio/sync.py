"""A blocking facade for callers that are not async: the same engine, run in a trio loop in a
thread of its own through an anyio blocking portal (``transport.loop_host.open_trio_portal``).

    with omni_trio.sync.open_engine(config) as engine:
        for out in engine.generate("Hello"):
            print(out.text)

Every method blocks the calling thread until the engine's loop answered. Leaving a
``generate()`` loop early (``break``) aborts that request in every stage before the loop
statement finishes, as the async API does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from types import TracebackType
from typing import TypeAlias

import trio
from anyio.from_thread import BlockingPortal

from .config.pipeline import PipelineConfig
from .engine.engine import Engine
from .engine.engine import open_engine as _open_engine
from .engine.health import HealthReport
from .engine.live_events import SessionEvent
from .engine.live_rules import Fence
from .engine.live_session import AppendReceipt, Session, SessionStatistics
from .outputs import EngineStatistics, OmniOutput, Prompt, SamplingParams
from .transport.loop_host import open_trio_portal

#: what ``open_engine`` takes: a config, a mapping or a path to a config file
EngineConfig: TypeAlias = PipelineConfig | Mapping[str, object] | str | os.PathLike[str]

__all__ = ["SyncEngine", "SyncSession", "open_engine"]

_END = object()  # the end of a session's events, across the portal


class SyncEngine:
    """The blocking twin of :class:`~omni_trio.engine.engine.Engine`. Get one from
    :func:`open_engine`."""

    def __init__(self, portal: BlockingPortal, engine: Engine) -> None:
        self._portal = portal
        self.engine = engine

    def generate(
        self,
        prompt: Prompt,
        request_id: str | None = None,
        sampling_params: SamplingParams = None,
        final_stage_id: str | int | None = None,
        output_stages: Sequence[str | int] | None = None,
    ) -> Iterator[OmniOutput]:
        """Yield the request's outputs as they arrive (blocking). Closing the iterator early
        aborts the request everywhere first. Raises what ``Engine.generate`` raises."""
        stream = self._portal.call(
            lambda: self.engine.generate(
                prompt, request_id, sampling_params, final_stage_id, output_stages
            )
        )
        with self._portal.wrap_async_context_manager(stream):
            while True:
                try:
                    out = self._portal.call(stream.receive)
                except trio.EndOfChannel:
                    return
                yield out

    def abort(self, request_id: str) -> list[OmniOutput]:
        """Abort a request; its outputs so far. Blocks until every stage dropped it."""
        return self._portal.call(self.engine.abort, request_id)

    def collective_rpc(
        self,
        method: str,
        args: Sequence[object] | None = (),
        kwargs: Mapping[str, object] | None = None,
        stage_ids: Sequence[str | int] | None = None,
        timeout: float | None = None,
    ) -> list[object]:
        """``Engine.collective_rpc``, blocking."""
        return self._portal.call(
            lambda: self.engine.collective_rpc(method, args, kwargs, stage_ids, timeout)
        )

    def statistics(self) -> EngineStatistics:
        return self._portal.call(self.engine.statistics)

    def interact(self, request_id: str, payload: object) -> bool:
        """``Engine.interact``: blocks until the request's entry stage accepted the payload;
        ``False`` for an unknown or ended request."""
        return self._portal.call(self.engine.interact, request_id, payload)

    def check_health(self) -> HealthReport:
        """``Engine.check_health``: the frozen health report."""
        return self._portal.call(self.engine.check_health)

    def pause(self) -> None:
        """``Engine.pause``, blocking until the pause is in effect."""
        self._portal.call(self.engine.pause)

    def resume(self) -> None:
        """``Engine.resume``."""
        self._portal.call(self.engine.resume)

    def add_replica(self, stage: str | int) -> int:
        """``Engine.add_replica``: blocks until the new replica is ready; its index."""
        return self._portal.call(self.engine.add_replica, stage)

    def remove_replica(self, stage: str | int, index: int, drain_timeout: float = 30.0) -> None:
        """``Engine.remove_replica``: blocks until the replica drained and stopped."""
        self._portal.call(self.engine.remove_replica, stage, index, drain_timeout)

    @contextmanager
    def open_session(
        self, session_id: str | None = None, *, config: Mapping[str, object] | None = None
    ) -> Iterator[SyncSession]:
        """``Engine.open_session``, blocking: ``with engine.open_session() as session:``;
        leaving the block closes the session unless it was detached."""
        block = self._portal.call(lambda: self.engine.open_session(session_id, config=config))
        with self._portal.wrap_async_context_manager(block) as session:
            yield SyncSession(self._portal, session)

    @contextmanager
    def resume_session(
        self, session_id: str, token: str, *, last_seq: int = 0
    ) -> Iterator[SyncSession]:
        """``Engine.resume_session``, blocking."""
        block = self._portal.call(
            lambda: self.engine.resume_session(session_id, token, last_seq=last_seq)
        )
        with self._portal.wrap_async_context_manager(block) as session:
            yield SyncSession(self._portal, session)

    def __repr__(self) -> str:
        return f"<SyncEngine {self.engine!r}>"


class SyncSession:
    """The blocking twin of :class:`~omni_trio.engine.live_session.Session`: each method
    blocks until the engine's loop answered and raises what the async one raises."""

    def __init__(self, portal: BlockingPortal, session: Session) -> None:
        self._portal = portal
        self.session = session

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def fence(self) -> Fence:
        return self._portal.call(lambda: self.session.fence)

    def append(
        self,
        chunk: Prompt,
        *,
        operation_id: str | None = None,
        fence: Fence | tuple[int, int] | None = None,
    ) -> AppendReceipt:
        return self._portal.call(
            lambda: self.session.append(chunk, operation_id=operation_id, fence=fence)
        )

    def commit(self, *, fence: Fence | tuple[int, int] | None = None) -> str:
        return self._portal.call(lambda: self.session.commit(fence=fence))

    def barge_in(self, *, fence: Fence | tuple[int, int] | None = None) -> int:
        return self._portal.call(lambda: self.session.barge_in(fence=fence))

    cancel_response = barge_in

    def update(self, **config: object) -> None:
        self._portal.call(lambda: self.session.update(**config))

    def touch(self) -> None:
        self._portal.call(self.session.touch)

    def ack(self, seq: int) -> None:
        self._portal.call(self.session.ack, seq)

    def detach(self) -> str:
        return self._portal.call(self.session.detach)

    def close(self) -> None:
        self._portal.call(self.session.aclose)

    def statistics(self) -> SessionStatistics:
        return self._portal.call(self.session.statistics)

    def events(self) -> Iterator[SessionEvent]:
        """The session's events as they come (blocking between them)."""
        events = self._portal.call(self.session.events)

        async def next_event() -> object:
            try:
                return await events.__anext__()
            except StopAsyncIteration:
                return _END

        try:
            while True:
                event = self._portal.call(next_event)
                if event is _END:
                    return
                assert isinstance(event, SessionEvent)
                yield event
        finally:
            self._portal.call(events.aclose)

    def __repr__(self) -> str:
        return f"<SyncSession {self.session!r}>"


class _SyncSession(AbstractContextManager["SyncEngine"]):
    def __init__(self, config: EngineConfig, overrides: dict[str, object]) -> None:
        self._config = config
        self._overrides = overrides
        self._stack = ExitStack()

    def __enter__(self) -> SyncEngine:
        with ExitStack() as stack:
            portal = stack.enter_context(open_trio_portal(name="omni-trio-sync"))
            engine = portal.call(lambda: _open_engine(self._config, **self._overrides))
            stack.enter_context(portal.wrap_async_context_manager(engine))
            self._stack = stack.pop_all()
        return SyncEngine(portal, engine)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stack.__exit__(exc_type, exc, tb)


def open_engine(config: EngineConfig, **overrides: object) -> AbstractContextManager[SyncEngine]:
    """``with open_engine(cfg) as engine:`` - start the pipeline on a trio loop in a thread
    of its own; leaving the block closes it there (aborting requests, stopping stages) and
    joins the thread, as the interpreter's exit does for an engine never closed. Raises
    ConfigError / StageStartError like the async ``open_engine``."""
    return _SyncSession(config, overrides)
