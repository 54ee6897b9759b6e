"""The orchestrator: the one owner of every request, from admission to its last output.

``Orchestrator.serve`` runs in the engine's nursery (started after the stage pools, so
requests always stop before stages). Each admitted request runs as one task in it, under its
own cancel scope (abort = cancel that scope), and its whole life is decided by one pure
:class:`~omni_trio.lifecycle.RequestLifecycle`. The request's stages run under
that scope (:class:`~omni_trio.stagerun.StageRunner`: which stage runs in which task, where its
outputs go). Every channel is bounded; no timer, no polling. When the request task ends, its
terminal outputs (or its error) are queued to the consumer through the same queue as every
other output, and nothing of the request remains here or in any stage.

The consumer gets a :class:`RequestHandle`: receive, cancel, cancel-and-wait, status. It never
reads or writes the request's state.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping

import trio

from .config import PipelineConfig
from .errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineOverloadedError,
)
from .observer import ObserverSet
from .outputs import OmniOutput, SamplingParams, StageInput
from .planning import RequestPlan
from .requests import Request, RequestHandle, RequestInfo
from .routing import StageFeed
from .stagerun import StageRunner
from .stages.pool import StagePool
from .stages.processors import InputProcessor, load_processor

__all__ = ["Orchestrator"]

logger = logging.getLogger(__name__)


class Orchestrator:
    """Runs requests through the stage graph. Owned by an :class:`~omni_trio.engine.Engine`."""

    def __init__(self, config: PipelineConfig, pools: Mapping[str, StagePool]) -> None:
        self.config = config
        self._pools = dict(pools)
        self._nursery: trio.Nursery | None = None
        self._closing = trio.Event()
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._processors: dict[str, InputProcessor] = {
            st.id: load_processor(
                st.input_processor, where=f"$.stages[{i}].input_processor", source=config.source
            )
            for i, st in enumerate(config.stages)
            if st.inputs
        }
        self.observers = ObserverSet()
        self._runner = StageRunner(config, self._pools, self._processors, self.observers)
        self.closed = False
        self.n_finished = 0
        self.n_aborted = 0
        self.n_failed = 0
        self.n_total = 0

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the request tasks: report started, run until :meth:`close`, then return once
        every request ended. Checkpoints. Cancelling it cancels every request (each still gets
        its terminal outputs)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await self._closing.wait()
        finally:
            self.close()
            self._nursery = None

    # -- admission -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"omni-{next(self._ids)}"

    def submit(
        self,
        request_id: str,
        first_input: StageInput,
        plan: RequestPlan,
        params: Mapping[str, SamplingParams],
    ) -> RequestHandle:
        """Admit a request and start its task. Synchronous (no checkpoint).

        Raises EngineClosedError, EngineOverloadedError, DuplicateRequestError.
        """
        if self.closed or self._nursery is None:
            raise EngineClosedError("the engine is closed; it accepts no new requests")
        if request_id in self._requests:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in flight")
        limit = self.config.max_requests_in_flight
        if len(self._requests) >= limit:
            raise EngineOverloadedError(
                f"{len(self._requests)} requests in flight, the limit "
                f"(max_requests_in_flight) is {limit}"
            )
        req = Request(
            request_id, plan, first_input, params, self.config.output_buffer, self._runner.output
        )
        self._requests[request_id] = req
        self.n_total += 1
        if self.observers:
            self.observers.emit("request_started", request_id)
        self._nursery.start_soon(self._run_request, req, name=request_id)
        return RequestHandle(req)

    # -- the request task ----------------------------------------------------------------------
    async def _run_request(self, req: Request) -> None:
        feeds: list[StageFeed] = []
        try:
            with req.scope:
                await self._runner.run(req, feeds)
        finally:
            for feed in feeds:
                feed.close()
            self._finish(req)

    def _finish(self, req: Request) -> None:
        status = req.end()
        if status == "failed":
            self.n_failed += 1
        elif status == "aborted":
            self.n_aborted += 1
        else:
            self.n_finished += 1
        del self._requests[req.request_id]
        if self.observers:
            self.observers.emit("request_finished", req.request_id, status)

    # -- control -----------------------------------------------------------------------------
    def abort_nowait(self, request_id: str) -> bool:
        """Cancel a request's scope; False if it is unknown or already ended. Synchronous."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        req.request_abort()
        return True

    async def abort(self, request_id: str) -> list[OmniOutput]:
        """Abort and wait until every stage dropped the request; its outputs so far.

        Always checkpoints. Cancelled before the abort is committed: nothing happens; once
        committed the wait is shielded (bounded by the stages' abort). Unknown or ended ids:
        ``[]``. Raises the request's :class:`StageError` (``exc.partial_outputs`` holds the
        outputs so far) if a stage failed it, even while it was being aborted.
        """
        req = self._requests.get(request_id)
        if req is None:
            await trio.lowlevel.checkpoint()
            return []
        return await req.abort()

    def close(self) -> None:
        """Stop admission and abort every request. Synchronous; :meth:`serve` returns once
        they all ended. Idempotent."""
        self.closed = True
        for req in list(self._requests.values()):
            req.request_abort()
        self._closing.set()

    async def wait_idle(self) -> None:
        """Wait until no request is in flight (event-driven). Always checkpoints."""
        await trio.lowlevel.checkpoint()
        while self._requests:
            await next(iter(self._requests.values())).wait_ended()

    def request_info(self, request_id: str) -> RequestInfo | None:
        """A frozen snapshot of a request in flight, or None (unknown or ended)."""
        req = self._requests.get(request_id)
        return None if req is None else req.info()

    @property
    def requests_in_flight(self) -> int:
        return len(self._requests)

    def __repr__(self) -> str:
        return (
            f"<Orchestrator {self.config.name!r} in_flight={len(self._requests)} "
            f"finished={self.n_finished} aborted={self.n_aborted} failed={self.n_failed}"
            f"{' closed' if self.closed else ''}>"
        )
