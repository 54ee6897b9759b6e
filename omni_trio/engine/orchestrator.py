"""The orchestrator: the one owner of every request, from admission to its last output.

``Orchestrator.serve`` runs in the engine's nursery (started after the stage pools, so
requests always stop before stages). Each admitted request runs as one task in it, under its
own cancel scope (abort = cancel that scope), and its whole life is decided by one pure
:class:`~omni_trio.request.lifecycle.RequestLifecycle`. The request's stages run under
that scope (:class:`~omni_trio.request.run.StageRunner`: which stage runs in which task, where its
outputs go). Every channel is bounded; no timer, no polling. When the request task ends, its
terminal outputs (or its error) are queued to the consumer through the same queue as every
other output, and nothing of the request remains here or in any stage.

Admission goes through one :class:`~omni_trio.engine.admission.AdmissionGate`
(``max_requests_in_flight``, ``max_requests_in_graph``; at a limit wait first-in first-out or
reject; pause/resume): ``submit_nowait`` admits synchronously when there is room, ``submit``
waits for it; a request gives its slot back when its task ends, and its graph ticket (if
any) when its consumer is done with it (the request holds the ticket's release). A request
waiting for admission is a :class:`~omni_trio.request.state.WaitingRequest`: aborting it
takes it out of the queue at once, it never runs, and its consumer gets its abort terminals
as from any aborted request.

The consumer gets a :class:`RequestHandle`: its outputs, cancel, cancel-and-wait, status. It never
reads or writes the request's state.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping

import trio

from ..config.pipeline import PipelineConfig
from ..context import RequestContext
from ..errors import DuplicateRequestError, EngineClosedError, OmniTrioError
from ..observer import ObserverSet, RequestInfo, payload_nbytes
from ..outputs import OmniOutput, StageInput
from ..request.feeds import StageFeed
from ..request.hooks import remove_artifacts
from ..request.interactions import Interactions
from ..request.lifecycle import RequestStatus
from ..request.output_builder import OutputBuilder
from ..request.planning import RequestPlan
from ..request.run import StageRunner
from ..request.state import Request, RequestHandle, WaitingRequest
from ..request.streaming_input import RequestInput
from ..stages.pool import StagePool
from ..stages.processors import InputProcessor, load_processor
from .admission import AdmissionGate, GraphTicket

__all__ = ["Orchestrator"]

logger = logging.getLogger(__name__)


class Orchestrator:
    """Runs requests through the stage graph. Owned by an
    :class:`~omni_trio.engine.engine.Engine`."""

    def __init__(self, config: PipelineConfig, pools: Mapping[str, StagePool]) -> None:
        self.config = config
        self._pools = dict(pools)
        self._nursery: trio.Nursery | None = None
        self._closing = trio.Event()
        self._requests: dict[str, Request] = {}
        self._waiting: dict[str, WaitingRequest] = {}  # requests waiting for admission
        self._ids = itertools.count()
        #: the admission limit, its queue and pause (``max_requests_in_flight``, ``admission``)
        self.admission = AdmissionGate(
            config.max_requests_in_flight,
            config.admission,
            config.max_waiting,
            config.max_requests_in_graph,
        )
        self._processors: dict[str, InputProcessor] = {
            st.id: load_processor(
                st.input_processor, where=f"$.stages[{i}].input_processor", source=config.source
            )
            for i, st in enumerate(config.stages)
            if st.inputs
        }
        self.observers = ObserverSet()
        self._runner = StageRunner(config, self._pools, self._processors, self.observers)
        # the OmniOutput a caller gets for each stage output
        self._output = OutputBuilder([(st.id, st.output_type) for st in config.stages])
        #: delivers interactions to the requests' entry-stage backends, in order
        self.interactions = Interactions(self._pools)
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

    def _open_nursery(self) -> trio.Nursery:
        # where a new request's task goes; raises if the engine closed
        if self.closed or self._nursery is None:
            raise EngineClosedError("the engine is closed; it accepts no new requests")
        return self._nursery

    def _nursery_for(self, request_id: str) -> trio.Nursery:
        # where a new request's task goes; raises if it may not start
        nursery = self._open_nursery()
        if request_id in self._requests or request_id in self._waiting:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in flight")
        return nursery

    def submit_nowait(
        self,
        request_id: str,
        first_input: StageInput,
        plan: RequestPlan,
        context: RequestContext,
    ) -> RequestHandle:
        """Admit a request now and start its task. Synchronous (no checkpoint).

        Raises ``trio.WouldBlock`` (nothing admitted) when it would have to wait for room
        (``admission: wait`` at ``max_requests_in_flight``, or paused): :meth:`submit` waits.
        Raises EngineClosedError, EngineOverloadedError (``reject`` at the limit or paused,
        or ``max_waiting`` admissions already wait), DuplicateRequestError.
        """
        nursery = self._nursery_for(request_id)
        ticket = self.admission.admit_nowait()
        return self._start(
            nursery, self._new_request(request_id, first_input, plan, context, ticket)
        )

    async def submit(
        self,
        request_id: str,
        first_input: StageInput,
        plan: RequestPlan,
        context: RequestContext,
    ) -> RequestHandle:
        """Admit a request, waiting first-in first-out for room, and start its task.

        Always checkpoints. A waiting request's id counts as in flight, and an abort reaches
        it (:meth:`abort`, :meth:`abort_nowait`): it leaves the queue at once and never runs;
        this returns the handle of a request that ended aborted (its consumer reads one abort
        terminal per output stage). Cancelled before it is admitted (also while it waits),
        nothing is admitted and nothing of it stays queued; once admitted, it returns with no
        checkpoint in between (the caller always gets the handle to end the request with). A
        request that does not run has its ``prompt_transform`` artifacts deleted before this
        returns or raises. Raises EngineClosedError (also when the engine closes while it
        waits), EngineOverloadedError, DuplicateRequestError.
        """
        waiting: WaitingRequest | None = None
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                self._nursery_for(request_id)  # refused before it waits, not after
            except OmniTrioError:
                await trio.lowlevel.cancel_shielded_checkpoint()
                raise
            waiting = self._waiting[request_id] = WaitingRequest(context)
            since = self.observers.clock() if self.observers else None
            admitted = False
            ticket: GraphTicket | None = None
            with waiting.scope:
                ticket = await self.admission.admit()
                admitted = True
            if waiting.scope.cancel_called:
                # aborted while it waited, or as its slot was handed over: it never runs
                if admitted:
                    self._give_back(ticket)  # to the next waiter, if any
                await remove_artifacts(context)
                return self._end_unadmitted(
                    self._new_request(request_id, first_input, plan, context)
                )
            try:
                nursery = self._open_nursery()  # the engine may have closed meanwhile
            except OmniTrioError:
                self._give_back(ticket)
                raise
            req = self._new_request(request_id, first_input, plan, context, ticket)
            return self._start(nursery, req, since)
        except BaseException:
            await remove_artifacts(context)  # it never runs (a cancel-shielded checkpoint)
            raise
        finally:
            if waiting is not None:
                # an abort that came meanwhile waits for this: the request is done with
                del self._waiting[request_id]
                waiting.leave()

    def _give_back(self, ticket: GraphTicket | None) -> None:
        # an admission that will not run: its slot and its ticket go to the next waiter
        if ticket is not None:
            ticket.release()
        self.admission.release()

    def _new_request(
        self,
        request_id: str,
        first_input: StageInput,
        plan: RequestPlan,
        context: RequestContext,
        ticket: GraphTicket | None = None,
    ) -> Request:
        # a request the engine took on (counted), about to run or to end unadmitted
        streamed_input = None
        if context.streaming_input:
            # generate() checked the route has exactly one entry stage
            (entry,) = plan.entries
            streamed_input = RequestInput(request_id, entry, first_input, self.config.output_buffer)
        self.n_total += 1
        return Request(
            request_id,
            plan,
            first_input,
            context,
            self.config.output_buffer,
            self._output,
            streamed_input,
            None if ticket is None else ticket.release,
            self.observers,
        )

    def _announce(self, req: Request, waited_since: float | None) -> None:
        # the observers' first events of a request: in the admitting task (the caller's)
        first = req.first_input
        wait = 0.0 if waited_since is None else self.observers.clock() - waited_since
        info = RequestInfo(
            stages=req.plan.active,
            output_stages=req.plan.outputs,
            trace_headers=req.context.trace_headers,
            admission_wait_s=wait,
            input_tokens=len(first.token_ids),
            input_bytes=payload_nbytes(first.token_ids, first.prompt, first.data),
        )
        self.observers.emit("request_info", req.request_id, info)
        self.observers.emit("request_started", req.request_id)

    def _start(
        self, nursery: trio.Nursery, req: Request, waited_since: float | None = None
    ) -> RequestHandle:
        # the caller took a slot for it; _finish gives it back
        self._requests[req.request_id] = req
        if self.observers:
            self._announce(req, waited_since)
        nursery.start_soon(self._run_request, req, name=req.request_id)
        return RequestHandle(req)

    def _end_unadmitted(self, req: Request) -> RequestHandle:
        # An abort took the request out of the admission queue: it ends aborted without
        # running (no slot, no task, no stage), and its consumer reads its abort terminals
        # like those of any aborted request. It counts as a request that ended aborted.
        if self.observers:
            self._announce(req, None)
        req.request_abort()
        status = self._end(req)
        if self.observers:
            self.observers.emit("request_finished", req.request_id, status)
        return RequestHandle(req)

    # -- the request task ----------------------------------------------------------------------
    async def _run_request(self, req: Request) -> None:
        feeds: list[StageFeed] = []
        try:
            with req.run_scope():
                await self._runner.run(req, feeds)
        finally:
            for feed in feeds:
                feed.close()
            if req.context.artifacts is not None:
                # before the request counts as ended: once its stream is left they are gone
                await remove_artifacts(req.context)
            self._finish(req)

    def _end(self, req: Request) -> RequestStatus:
        # the request ended: its status, its terminals queued, counted
        status = req.end()
        if status == "failed":
            self.n_failed += 1
        elif status == "aborted":
            self.n_aborted += 1
        else:
            self.n_finished += 1
        return status

    def _finish(self, req: Request) -> None:
        status = self._end(req)
        del self._requests[req.request_id]
        self.admission.release()
        if self.observers:
            self.observers.emit("request_finished", req.request_id, status)

    # -- control -----------------------------------------------------------------------------
    def commit_abort(self, request_id: str) -> Request | WaitingRequest | None:
        """Abort a request (cancel its scope) or a request waiting for admission (it leaves
        the queue at once and never runs); what to await ``aborted()`` on, or None if the id
        is unknown or ended. Synchronous."""
        req: Request | WaitingRequest | None = self._requests.get(request_id)
        if req is None:
            req = self._waiting.get(request_id)
            if req is None:
                return None
        req.request_abort()
        return req

    def abort_nowait(self, request_id: str) -> bool:
        """Abort a request, or one waiting for admission, without waiting; False if it is
        unknown or already ended. Synchronous."""
        return self.commit_abort(request_id) is not None

    async def abort(self, request_id: str) -> list[OmniOutput]:
        """Abort and wait until every stage dropped the request; its outputs so far.

        A request waiting for admission leaves the queue at once and never runs: ``[]``
        once its consumer's abort terminals are queued. Always checkpoints. Cancelled before
        the abort is committed: nothing happens. Once committed, the abort completes in the
        background whatever happens to the caller: cancelling the caller ends its wait
        (``trio.Cancelled``), not the abort. Unknown or ended ids: ``[]``. Raises the
        request's :class:`StageError` (``exc.partial_outputs`` holds the outputs so far) if
        a stage failed it, even while it was being aborted.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        aborting = self.commit_abort(request_id)
        if aborting is None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return []
        return await aborting.aborted()

    async def abort_waiting(self, request_id: str, context: RequestContext) -> list[OmniOutput]:
        """:meth:`abort` of the request waiting for admission with this ``context`` (a
        stream not admitted yet): ``[]`` once it left the queue; a no-op (``[]``) if no
        such request waits. Always checkpoints; cancelled, as :meth:`abort`."""
        waiting = self._waiting.get(request_id)
        if waiting is None or waiting.context is not context:
            await trio.lowlevel.checkpoint()
            return []
        return await self.abort(request_id)

    def close(self) -> None:
        """Stop admission (waiting admissions fail with EngineClosedError) and abort every
        request. Synchronous; :meth:`serve` returns once they all ended. Idempotent."""
        self.closed = True
        self.admission.close()
        for req in list(self._requests.values()):
            req.request_abort()
        self._closing.set()

    async def wait_idle(self) -> None:
        """Wait until no request is in flight (event-driven). Always checkpoints."""
        await trio.lowlevel.checkpoint()
        while self._requests:
            await next(iter(self._requests.values())).wait_ended()

    async def interact(
        self, request_id: str, payload: object, *, handle: RequestHandle | None = None
    ) -> bool:
        """Deliver an interaction to a request's entry-stage backend (see
        :mod:`~omni_trio.request.interactions`); ``False`` for an unknown or ended request, or one
        that is not ``handle``'s. Always checkpoints; raises what the backend raises."""
        req = self._requests.get(request_id)
        if req is None or (handle is not None and not handle.refers_to(req)):
            await trio.lowlevel.checkpoint()
            return False
        return await self.interactions.deliver(req, payload)

    @property
    def requests_in_flight(self) -> int:
        return len(self._requests)

    def __repr__(self) -> str:
        return (
            f"<Orchestrator {self.config.name!r} in_flight={len(self._requests)} "
            f"waiting={self.admission.waiting}{' paused' if self.admission.paused else ''} "
            f"finished={self.n_finished} aborted={self.n_aborted} failed={self.n_failed}"
            f"{' closed' if self.closed else ''}>"
        )
