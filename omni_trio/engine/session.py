"""An engine session's life: start its stages and its orchestrator, close them in order, and
end the calls the close cancels. Owned by an :class:`~omni_trio.engine.engine.Engine`.

Structure: entering the session opens one nursery. Into it go, in this order, the stages (one
task owning every :class:`~omni_trio.stages.pool.StagePool`, hence every replica, worker
thread and engine process; all started in parallel) and then the
:class:`~omni_trio.engine.orchestrator.Orchestrator` (``nursery.start(orchestrator.serve)``), which
owns one task per request. Leaving closes the orchestrator first (admission stops, every
request is aborted and its consumer gets its terminal outputs) and only once every request
ended are the stages cancelled and stopped, in parallel, each bounded by its
``shutdown_timeout``. The stages run under a shield while requests are in flight, so a
cancellation from outside reaches the requests first and the stages after them: "requests
stop before stages" is structure, not call order. The exception policy is in
:mod:`omni_trio.engine.engine`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import TypeVar

import trio

from ..config.checks import check_vllm_stages
from ..config.pipeline import PipelineConfig
from ..errors import EngineClosedError, InvalidRequestError
from ..failures import single_leaf
from ..request.hooks import ArtifactKeeper
from ..stages.group import StageGroup
from .live_registry import SessionRegistry
from .orchestrator import Orchestrator

__all__ = ["EngineSession"]

logger = logging.getLogger("omni_trio.engine.engine")  # where these records were always logged

T = TypeVar("T")


class EngineSession:
    """The state of one engine session (``new``, ``starting``, ``open``, ``closing``,
    ``closed``), the task structure behind it, and the pending calls its close cancels. It can
    be entered once."""

    def __init__(
        self,
        config: PipelineConfig,
        stage_group: StageGroup,
        orchestrator: Orchestrator,
        keeper: ArtifactKeeper,
        sessions: SessionRegistry,
        *,
        check_vllm: bool = False,
    ) -> None:
        self._config = config
        self._check_vllm = check_vllm and any(st.backend == "vllm" for st in config.stages)
        self._stage_group = stage_group
        self._orchestrator = orchestrator
        self._sessions = sessions  # live sessions: closed before the requests are
        self._keeper = keeper  # the prompt hooks' artifacts, dropped once every request ended
        self._run_cm: AbstractAsyncContextManager[None] | None = None  # while open
        self._state = "new"  # new | starting | open | closing | closed
        self._stop_error_raised = False
        # pending calls (collective_rpc, add_replica): their scope (close cancels it) -> set
        # when they end
        self._calls: dict[trio.CancelScope, trio.Event] = {}

    @property
    def state(self) -> str:
        return self._state

    @property
    def closed(self) -> bool:
        """True from the moment the session starts closing."""
        return self._state in ("closing", "closed")

    def check_open(self) -> None:
        """Raise :class:`EngineClosedError` unless the session is open. Synchronous."""
        if self._state != "open":
            raise EngineClosedError(
                "the engine is closed; it accepts no new work"
                if self._state in ("closing", "closed")
                else f"the engine is not open yet ({self._state}); use `async with open_engine()`"
            )

    async def checked(self, check: Callable[[], T]) -> T:
        """The checks of a call that always checkpoints: once the session is checked open,
        ``check()``'s result. Cancelled, it raises before checking; refused
        (:class:`EngineClosedError`, :class:`InvalidRequestError`), it checkpoints and raises."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self.check_open()
            return check()
        except (EngineClosedError, InvalidRequestError):
            await trio.lowlevel.cancel_shielded_checkpoint()  # checkpoints on every path
            raise

    async def until_close(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """``await call()``, cancelled if the session closes meanwhile: then raises
        :class:`EngineClosedError` naming ``what``. The caller's own cancellation propagates.
        The close waits (shielded) until the call ended."""
        scope = trio.CancelScope()
        ended = self._calls[scope] = trio.Event()
        done = False
        try:
            with scope:
                result = await call()
                done = True
        finally:
            del self._calls[scope]
            ended.set()
        if not done:
            # only close cancels this scope (the caller's own cancellation propagates)
            raise EngineClosedError(f"the engine closed while {what} was pending")
        return result

    # -- entering and leaving --------------------------------------------------------------------
    async def enter(self) -> None:
        """Start every stage in parallel, then the orchestrator; see
        :meth:`Engine.__aenter__ <omni_trio.engine.engine.Engine.__aenter__>`."""
        if self._state != "new":
            raise RuntimeError("an Engine session can be entered only once")
        self._state = "starting"
        run = self._run()
        try:
            if self._check_vllm:
                # vLLM's own field checks import vllm: seconds, so never on this event loop
                await trio.to_thread.run_sync(check_vllm_stages, self._config)
                self._check_vllm = False
            await run.__aenter__()
        except BaseExceptionGroup as group:
            self._state = "closed"
            leaf = single_leaf(group)
            if leaf is not None:
                raise leaf from leaf.__cause__  # `from None` would erase the leaf's own cause
            raise
        except BaseException:
            self._state = "closed"
            raise
        self._run_cm = run

    async def exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        """Leave the block: close, then raise what the exception policy says."""
        run, self._run_cm = self._run_cm, None
        if run is None:
            return False
        try:
            return bool(await run.__aexit__(exc_type, exc, tb))
        except BaseExceptionGroup as group:
            leaf = single_leaf(group)
            if leaf is not None:
                raise leaf from leaf.__cause__  # `from None` would erase the leaf's own cause
            raise

    @asynccontextmanager
    async def _run(self) -> AsyncIterator[None]:
        body_error: BaseException | None = None
        async with trio.open_nursery() as nursery:
            await nursery.start(self._stage_group.serve)
            try:
                async with trio.open_nursery() as requests:
                    await requests.start(self._orchestrator.serve)
                    await requests.start(self._sessions.serve)
                    self._state = "open"
                    try:
                        yield
                    except BaseException as exc:
                        # kept aside: it leaves open_engine unwrapped once all is stopped
                        body_error = exc
                    finally:
                        self._begin_close()
            finally:
                # also when a cancellation from outside ends the requests' nursery: the
                # stages' scope is shielded, so only this cancels it
                with trio.CancelScope(shield=True):
                    await self._calls_ended()
                    # every request ended: what is left is of streams never entered
                    await self._keeper.aclose()
                self._stage_group.stop()
        if body_error is not None:
            if self._stage_group.stop_error is not None and not self._stop_error_raised:
                logger.error("while leaving on %r: %s", body_error, self._stage_group.stop_error)
            raise body_error
        self._raise_stop_error()

    def _begin_close(self) -> None:
        if self._state in ("closing", "closed"):
            return
        self._state = "closing"
        self._sessions.close()  # each session cancels its turns, then the rest is aborted
        self._orchestrator.close()
        for scope in self._calls:
            scope.cancel()

    async def _calls_ended(self) -> None:
        await trio.lowlevel.checkpoint()
        while self._calls:
            await next(iter(self._calls.values())).wait()

    def _raise_stop_error(self) -> None:
        self._state = "closed"
        stop_error = self._stage_group.stop_error
        if stop_error is not None and not self._stop_error_raised:
            self._stop_error_raised = True
            raise stop_error

    async def aclose(self) -> None:
        """End the session; see :meth:`Engine.aclose <omni_trio.engine.engine.Engine.aclose>`."""
        self._begin_close()
        with trio.CancelScope(shield=True):
            await self._sessions.wait_closed()
            await self._orchestrator.wait_idle()
            await self._calls_ended()
            self._stage_group.stop()
            await self._stage_group.wait_stopped()
        self._raise_stop_error()
