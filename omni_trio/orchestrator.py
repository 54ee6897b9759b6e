"""The orchestrator: the one owner of every request, from admission to its last output.

``Orchestrator.serve`` runs in the engine's nursery (started after the stage pools, so
requests always stop before stages). Each admitted request runs as one task in it, under its
own cancel scope (abort = cancel that scope), and its whole life is decided by one pure
:class:`~omni_trio.lifecycle.RequestLifecycle`. Inside the request task each active stage has
one task that runs the request on the stage's pool and, beside it, routes what the backend
emits: the backend's ``emit`` only puts the output into a bounded per-stage outbox, and the
stage's routing loop (the orchestrator's own code, never a backend's call stack) delivers it
to the caller and to the downstream stages' input processors. Every channel is bounded; no
timer, no polling. When the request task ends, its terminal outputs (or its error) are queued
to the consumer through the same :class:`~omni_trio.transport.queue.OutputQueue` as every
other output, and nothing of the request remains here or in any stage.

The consumer gets a :class:`RequestHandle`: receive, cancel, cancel-and-wait, status. It never
reads or writes the request's state.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import outcome
import trio

from .config import PipelineConfig
from .errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineOverloadedError,
    OmniTrioError,
    StageError,
)
from .lifecycle import ContractViolation, RequestLifecycle, RequestStatus
from .observer import ObserverSet
from .outputs import FINISH_ABORT, OmniOutput, SamplingParams, StageInput, StageOutput
from .planning import RequestPlan
from .routing import StageFeed
from .stages._abc import StageAborted
from .stages.pool import StagePool
from .stages.processors import InputProcessor, load_processor
from .transport.queue import OutputQueue

__all__ = ["Orchestrator", "RequestHandle", "RequestInfo"]

logger = logging.getLogger(__name__)

_Item = OmniOutput | outcome.Error
_STOPPED = StageOutput(finished=True, finish_reason="stop")


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """A snapshot of one request in flight (:meth:`Orchestrator.request_info`)."""

    request_id: str
    status: RequestStatus
    stages: tuple[str, ...]
    finished_stages: tuple[str, ...]
    outputs_produced: int
    outputs_queued: int
    abort_requested: bool

    def __repr__(self) -> str:
        return (
            f"<RequestInfo {self.request_id!r} {self.status} stages={list(self.stages)} "
            f"finished={list(self.finished_stages)} produced={self.outputs_produced} "
            f"queued={self.outputs_queued}{' abort-requested' if self.abort_requested else ''}>"
        )


class _Request:
    """Everything the orchestrator holds for one request; dropped when its task ends."""

    __slots__ = (
        "done",
        "error",
        "first_input",
        "lifecycle",
        "params",
        "plan",
        "produced",
        "queue",
        "scope",
    )

    def __init__(
        self,
        request_id: str,
        plan: RequestPlan,
        first_input: StageInput,
        params: Mapping[str, SamplingParams],
        window: int,
    ) -> None:
        self.plan = plan
        self.first_input = first_input
        self.params = params
        self.lifecycle = RequestLifecycle(request_id, plan.outputs)
        self.queue: OutputQueue[_Item] = OutputQueue(window)
        self.scope = trio.CancelScope()
        self.done = trio.Event()
        self.produced: list[OmniOutput] = []
        self.error: BaseException | None = None  # set when the request ends failed

    @property
    def request_id(self) -> str:
        return self.lifecycle.request_id

    def __repr__(self) -> str:
        return (
            f"<request {self.request_id!r} {self.lifecycle.status} stages={list(self.plan.active)}>"
        )


class RequestHandle:
    """The consumer's narrow handle on one admitted request (see :class:`RequestStream`)."""

    __slots__ = ("_orch", "_req")

    def __init__(self, orchestrator: Orchestrator, request: _Request) -> None:
        self._orch = orchestrator
        self._req = request

    @property
    def request_id(self) -> str:
        return self._req.request_id

    @property
    def status(self) -> RequestStatus:
        return self._req.lifecycle.status

    async def receive(self) -> OmniOutput:
        """The next output, terminals included. Always checkpoints. Raises
        ``trio.EndOfChannel`` after the last one, or the request's error if it failed."""
        item = await self._req.queue.receive()
        if isinstance(item, outcome.Error):
            item.unwrap()
        assert isinstance(item, OmniOutput)
        return item

    def cancel(self) -> None:
        """Abort the request without waiting. Synchronous; a no-op once it ended."""
        self._orch._request_abort(self._req)

    async def cancel_and_wait(self) -> None:
        """Abort the request (if it still runs) and wait, shielded, until every stage dropped
        it. Always checkpoints; not cancellable (the wait is bounded by the stages' abort)."""
        await self._orch._cancel_and_wait(self._req)

    async def abort(self) -> list[OmniOutput]:
        """Abort and wait; the outputs so far (see :meth:`Orchestrator.abort`)."""
        return await self._orch._abort(self._req)

    def close_receiver(self) -> None:
        """The consumer stops reading: later outputs are dropped, and a stage delivering one
        finds the consumer gone, which aborts the request. Synchronous."""
        self._req.queue.close_receiver()


class Orchestrator:
    """Runs requests through the stage graph. Owned by an :class:`~omni_trio.engine.Engine`."""

    def __init__(self, config: PipelineConfig, pools: Mapping[str, StagePool]) -> None:
        self.config = config
        self._pools = dict(pools)
        self._nursery: trio.Nursery | None = None
        self._closing = trio.Event()
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._processors: dict[str, InputProcessor] = {
            st.id: load_processor(
                st.input_processor, where=f"$.stages[{i}].input_processor", source=config.source
            )
            for i, st in enumerate(config.stages)
            if st.inputs
        }
        self._index = {sid: i for i, sid in enumerate(config.stage_ids)}
        self.observers = ObserverSet()
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
        req = _Request(request_id, plan, first_input, params, self.config.output_buffer)
        req.lifecycle.start()
        self._requests[request_id] = req
        self.n_total += 1
        if self.observers:
            self.observers.emit("request_started", request_id)
        self._nursery.start_soon(self._run_request, req, name=request_id)
        return RequestHandle(self, req)

    # -- the request task ----------------------------------------------------------------------
    async def _run_request(self, req: _Request) -> None:
        plan = req.plan
        feeds: list[StageFeed] = []
        try:
            with req.scope:
                async with trio.open_nursery() as nursery:
                    inputs: dict[str, trio.MemoryReceiveChannel[StageInput]] = {}
                    feeds_of: dict[str, list[StageFeed]] = {sid: [] for sid in plan.active}
                    for sid in plan.active:
                        st = self.config.stage(sid)
                        send, receive = trio.open_memory_channel[StageInput](
                            self.config.output_buffer
                        )
                        inputs[sid] = receive
                        if not st.inputs:
                            send.send_nowait(req.first_input)
                            send.close()
                            continue
                        feed = StageFeed(
                            sid,
                            st.inputs,
                            stream=st.stream_input,
                            processor=self._processors[sid],
                            options=st.processor_options,
                            send=send,
                            request_id=req.request_id,
                            observers=self.observers,
                        )
                        feeds.append(feed)
                        for up in st.inputs:
                            feeds_of[up].append(feed)
                    for sid in plan.active:
                        nursery.start_soon(self._run_stage, req, sid, inputs[sid], feeds_of[sid])
        finally:
            for feed in feeds:
                feed.close()
            self._finish(req)

    async def _run_stage(
        self,
        req: _Request,
        sid: str,
        inputs: trio.MemoryReceiveChannel[StageInput],
        feeds: list[StageFeed],
    ) -> None:
        rid = req.request_id
        pool = self._pools[sid]
        outbox_send, outbox = trio.open_memory_channel[StageOutput](self.config.output_buffer)
        completed = False
        status = "aborted"
        if self.observers:
            self.observers.emit("stage_started", rid, sid)

        async def run_backend() -> None:
            # the backend's emit only queues into the outbox: routing happens in this stage's
            # routing loop below, never in the backend's call stack
            nonlocal completed
            async with outbox_send:
                try:
                    with inputs:
                        await pool.run_request(rid, inputs, req.params[sid], outbox_send.send)
                except StageAborted:
                    # dropped through a direct backend/pool abort: an abort, not a failure
                    self._request_abort(req)
                    return
                except Exception as exc:
                    self._fail(req, sid, exc)
                    return
                completed = True

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_backend)
                try:
                    first = True
                    async for out in outbox:
                        await self._route(req, sid, out, feeds, first)
                        first = False
                    if completed and not req.lifecycle.failed:
                        if not req.lifecycle.stage_finished(sid):
                            # the backend ended without a finished output; the caller gets one
                            await self._route(req, sid, _STOPPED, feeds, first)
                        for feed in feeds:
                            if feed.finish(sid):
                                await feed.send_final(feed.final_chunk())
                        status = "finished"
                except OmniTrioError as exc:
                    # a routing failure (contract, input processor): cancels the request,
                    # and with it this stage's backend
                    self._fail(req, sid, exc)
        finally:
            if req.lifecycle.failed and status != "finished":
                status = "failed"
            if self.observers:
                self.observers.emit("stage_finished", rid, sid, status)

    async def _route(
        self, req: _Request, sid: str, out: StageOutput, feeds: list[StageFeed], first: bool
    ) -> None:
        """Deliver one output of stage ``sid``: to the caller (if an output stage) and to the
        downstream feeds. Checkpoints only when a channel is full (backpressure); the routing
        loop that calls it checkpoints per output. Raises StageError (contract or processor
        failures)."""
        try:
            req.lifecycle.stage_output(sid, out.finished)
        except ContractViolation as exc:
            replica = self._pools[sid].replica_of(req.request_id)
            name = replica.name if replica is not None else f"{sid}[?]"
            raise StageError(
                f"replica {name} broke the backend contract: {exc}",
                stage_id=sid,
                request_id=req.request_id,
            ) from None
        index = self._index[sid]
        omni = OmniOutput(
            request_id=req.request_id,
            stage_id=sid,
            stage_index=index,
            kind=self.config.stages[index].output_type,
            text=out.text,
            token_ids=tuple(out.token_ids),
            data=out.data,
            finished=out.finished,
            finish_reason=out.finish_reason,
            metrics=out.metrics,
        )
        req.produced.append(omni)
        if self.observers:
            self.observers.emit("stage_output", req.request_id, sid, first)
        if sid in req.plan.outputs:
            # the routing loop checkpoints on every output it takes from the outbox: pass
            # this one on without another trip through the scheduler unless the window is full
            try:
                try:
                    req.queue.send_nowait(omni)
                except trio.WouldBlock:
                    await req.queue.send(omni)
            except trio.BrokenResourceError:
                # the consumer stopped listening: that is an abort
                self._request_abort(req)
                await trio.lowlevel.checkpoint()
        for feed in feeds:
            chunk = feed.take(sid, out)
            if chunk is not None:
                await feed.send(sid, chunk)

    def _fail(self, req: _Request, sid: str, exc: BaseException) -> None:
        """Record a request-scoped failure of stage ``sid`` and cancel the request."""
        if isinstance(exc, StageError):
            exc.request_id = exc.request_id or req.request_id
            exc.stage_id = exc.stage_id or sid
            error: BaseException = exc
        elif isinstance(exc, OmniTrioError):
            error = exc
        else:
            error = StageError(
                f"stage {sid!r} failed request {req.request_id!r}: {type(exc).__name__}: {exc}",
                stage_id=sid,
                request_id=req.request_id,
            )
            error.__cause__ = exc
        if req.lifecycle.abort_requested:
            # an error while the request is being aborted (or the engine closing) must not
            # vanish into the abort: it fails the request, and it is logged here
            logger.warning(
                "request %r failed in stage %r while being aborted: %r", req.request_id, sid, error
            )
        req.lifecycle.fail(error)
        req.scope.cancel()

    def _finish(self, req: _Request) -> None:
        status = req.lifecycle.end()
        if status == "failed":
            self.n_failed += 1
            req.error = request_error(req.request_id, req.lifecycle.errors)
            req.queue.send_final_nowait(outcome.Error(req.error))
        elif status == "aborted":
            self.n_aborted += 1
            for sid in req.lifecycle.abort_terminals():
                index = self._index[sid]
                req.queue.send_final_nowait(
                    OmniOutput(
                        request_id=req.request_id,
                        stage_id=sid,
                        stage_index=index,
                        kind=self.config.stages[index].output_type,
                        finished=True,
                        finish_reason=FINISH_ABORT,
                    )
                )
        else:
            self.n_finished += 1
        req.queue.close()
        del self._requests[req.request_id]
        if self.observers:
            self.observers.emit("request_finished", req.request_id, status)
        req.done.set()

    # -- control -----------------------------------------------------------------------------
    def _request_abort(self, req: _Request) -> None:
        if req.lifecycle.request_abort():
            req.scope.cancel()

    async def _cancel_and_wait(self, req: _Request) -> None:
        # the one place that aborts a request and waits until every stage dropped it
        self._request_abort(req)
        with trio.CancelScope(shield=True):
            await req.done.wait()

    def abort_nowait(self, request_id: str) -> bool:
        """Cancel a request's scope; False if it is unknown or already ended. Synchronous."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._request_abort(req)
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
        return await self._abort(req)

    async def _abort(self, req: _Request) -> list[OmniOutput]:
        await trio.lowlevel.checkpoint_if_cancelled()
        if req.done.is_set():
            await trio.lowlevel.cancel_shielded_checkpoint()
            return []
        await self._cancel_and_wait(req)
        produced = list(req.produced)
        error = req.error
        if error is not None:
            if isinstance(error, StageError):
                error.partial_outputs = produced
                raise error
            raise StageError(
                f"request {req.request_id!r} failed while being aborted: {error}",
                request_id=req.request_id,
                partial_outputs=produced,
            ) from error
        return produced

    def close(self) -> None:
        """Stop admission and abort every request. Synchronous; :meth:`serve` returns once
        they all ended. Idempotent."""
        self.closed = True
        for req in list(self._requests.values()):
            self._request_abort(req)
        self._closing.set()

    async def wait_idle(self) -> None:
        """Wait until no request is in flight (event-driven). Always checkpoints."""
        await trio.lowlevel.checkpoint()
        while self._requests:
            await next(iter(self._requests.values())).done.wait()

    def request_info(self, request_id: str) -> RequestInfo | None:
        """A frozen snapshot of a request in flight, or None (unknown or ended)."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        lc = req.lifecycle
        return RequestInfo(
            request_id=request_id,
            status=lc.status,
            stages=req.plan.active,
            finished_stages=tuple(s for s in req.plan.active if lc.stage_finished(s)),
            outputs_produced=len(req.produced),
            outputs_queued=req.queue.statistics().items,
            abort_requested=lc.abort_requested,
        )

    @property
    def requests_in_flight(self) -> int:
        return len(self._requests)

    def __repr__(self) -> str:
        return (
            f"<Orchestrator {self.config.name!r} in_flight={len(self._requests)} "
            f"finished={self.n_finished} aborted={self.n_aborted} failed={self.n_failed}"
            f"{' closed' if self.closed else ''}>"
        )


def request_error(request_id: str, errors: tuple[BaseException, ...]) -> BaseException:
    """The one error a failed request raises: its only error, or a StageError naming every
    failure ``from ExceptionGroup`` of them all (no cause dropped). Pure."""
    if len(errors) == 1:
        return errors[0]
    stages = [getattr(e, "stage_id", None) or "?" for e in errors]
    first = errors[0]
    error = StageError(
        f"request {request_id!r} failed in {len(errors)} places (stages {', '.join(stages)}); "
        f"first: {first}",
        stage_id=getattr(first, "stage_id", None),
        request_id=request_id,
    )
    error.__cause__ = BaseExceptionGroup(f"request {request_id!r} failures", list(errors))
    return error
