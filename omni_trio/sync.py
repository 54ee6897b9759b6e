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
from contextlib import AbstractContextManager, ExitStack
from types import TracebackType
from typing import TypeAlias

import trio
from anyio.from_thread import BlockingPortal

from .config.pipeline import PipelineConfig
from .engine.engine import Engine
from .engine.engine import open_engine as _open_engine
from .engine.health import HealthReport
from .outputs import EngineStatistics, OmniOutput, Prompt, SamplingParams
from .transport.loop_host import open_trio_portal

#: what ``open_engine`` takes: a config, a mapping or a path to a config file
EngineConfig: TypeAlias = PipelineConfig | Mapping[str, object] | str | os.PathLike[str]

__all__ = ["SyncEngine", "open_engine"]


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

    def __repr__(self) -> str:
        return f"<SyncEngine {self.engine!r}>"


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
