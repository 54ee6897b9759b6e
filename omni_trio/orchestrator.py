"""The orchestrator: one task per request, routing outputs through the stage graph.

Each request runs as one task in the engine's nursery, under its own cancel scope (abort =
cancel that scope). Inside it, one task per active stage runs the request on that stage's
pool; a stage's outputs go to the caller (if it is an output stage) and to its downstream
stages' input channels (through their input processors), as they arrive: no timer, no
polling. Every channel is bounded, so a slow caller slows the stages down instead of
queueing without limit. When the request task ends, nothing of the request is left here or
in any stage: :meth:`Orchestrator.statistics` and the pools' statistics prove it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from .config import PipelineConfig
from .errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineOverloadedError,
    OmniTrioError,
    StageError,
)
from .observer import ObserverSet, payload_nbytes
from .outputs import FINISH_ABORT, OmniOutput, StageInput, StageOutput
from .planning import RequestPlan, plan_request, resolve_sampling_params
from .stages._abc import StageAborted
from .stages.pool import StagePool
from .stages.processors import InputProcessor, load_processor

__all__ = ["Orchestrator", "RequestPlan", "RequestState", "plan_request", "resolve_sampling_params"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class RequestState:
    """Everything the orchestrator holds for one request; dropped when the request ends."""

    request_id: str
    plan: RequestPlan
    send: trio.MemorySendChannel[OmniOutput]
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)
    produced: list[OmniOutput] = field(default_factory=list)
    finished_stages: set[str] = field(default_factory=set)
    tail: list[OmniOutput] = field(default_factory=list)
    error: BaseException | None = None
    status: str = "running"  # running | finished | aborted | failed
    closing: bool = False

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.scope.cancel()

    def __repr__(self) -> str:
        return (
            f"<RequestState {self.request_id!r} {self.status} stages={list(self.plan.active)} "
            f"finished={sorted(self.finished_stages)} outputs={len(self.produced)}>"
        )


class _Feed:
    """Collects upstream outputs for one downstream stage of one request and sends its input."""

    def __init__(
        self,
        stage_id: str,
        upstream: Sequence[str],
        stream: bool,
        processor: InputProcessor,
        options: Mapping[str, Any],
        send: trio.MemorySendChannel[StageInput],
        request_id: str = "",
        observers: ObserverSet | None = None,
    ) -> None:
        self.stage_id = stage_id
        self.request_id = request_id
        self.observers = observers
        self.pending = set(upstream)
        self.order = list(upstream)
        self.stream = stream
        self.processor = processor
        self.options = options
        self.send = send
        self.collected: dict[str, list[StageOutput]] = {u: [] for u in upstream}
        self.closed = False

    async def _send(self, chunk: StageInput) -> None:
        try:
            await self.send.send(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The downstream stage no longer reads its input: it finished on what it had,
            # or it failed (then the request's scope is cancelled and the next checkpoint
            # of this stage raises Cancelled). Either way nothing more goes there.
            self.closed = True

    async def on_output(self, source: str, out: StageOutput) -> None:
        if self.closed:
            return
        if self.stream:
            chunk = self.processor({source: [out]}, final=False, options=self.options)
            if chunk is not None:
                self._observe(source, chunk)
                await self._send(chunk)
        else:
            self.collected[source].append(out)

    async def on_finished(self, source: str) -> None:
        self.pending.discard(source)
        if self.pending:
            return
        if self.stream:
            chunk = self.processor({}, final=True, options=self.options)
        else:
            chunk = self.processor(
                {u: self.collected[u] for u in self.order}, final=True, options=self.options
            )
        self.collected = {}
        if chunk is not None and not self.closed:
            self._observe(",".join(self.order), chunk)
            await self._send(chunk)
        await self.send.aclose()

    def _observe(self, source: str, chunk: StageInput) -> None:
        if self.observers:
            nbytes = payload_nbytes(chunk.token_ids, chunk.prompt, chunk.data)
            self.observers.emit("transfer", self.request_id, source, self.stage_id, nbytes)


class Orchestrator:
    """Runs requests through the stage graph. Owned by an :class:`~omni_trio.engine.Engine`."""

    def __init__(self, config: PipelineConfig, pools: Mapping[str, StagePool]) -> None:
        self.config = config
        self.pools = dict(pools)
        self._nursery: trio.Nursery | None = None
        self._requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self._processors = {
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

    def attach(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    # -- admission -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"omni-{next(self._ids)}"

    def submit(
        self, request_id: str, first_input: StageInput, plan: RequestPlan, params: dict[str, Any]
    ) -> tuple[RequestState, trio.MemoryReceiveChannel[OmniOutput]]:
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
        send, receive = trio.open_memory_channel[OmniOutput](self.config.output_buffer)
        state = RequestState(request_id=request_id, plan=plan, send=send)
        self._requests[request_id] = state
        self.n_total += 1
        if self.observers:
            self.observers.emit("request_started", request_id)
        self._nursery.start_soon(self._run_request, state, first_input, params, name=request_id)
        return state, receive

    # -- the request task ----------------------------------------------------------------------
    async def _run_request(
        self, state: RequestState, first_input: StageInput, params: dict[str, Any]
    ) -> None:
        plan = state.plan
        try:
            with state.scope:
                async with trio.open_nursery() as nursery:
                    inputs: dict[str, trio.MemoryReceiveChannel[StageInput]] = {}
                    feeds: dict[str, list[_Feed]] = {sid: [] for sid in plan.active}
                    for sid in plan.active:
                        st = self.config.stage(sid)
                        send, receive = trio.open_memory_channel[StageInput](
                            self.config.output_buffer
                        )
                        inputs[sid] = receive
                        if not st.inputs:
                            send.send_nowait(first_input)
                            send.close()
                            continue
                        feed = _Feed(
                            sid,
                            st.inputs,
                            st.stream_input,
                            self._processors[sid],
                            st.processor_options,
                            send,
                            state.request_id,
                            self.observers,
                        )
                        for up in st.inputs:
                            feeds[up].append(feed)
                    for sid in plan.active:
                        nursery.start_soon(
                            self._run_stage, state, sid, inputs[sid], params[sid], feeds[sid]
                        )
        finally:
            self._finish(state)

    async def _run_stage(
        self,
        state: RequestState,
        sid: str,
        inputs: trio.MemoryReceiveChannel[StageInput],
        sampling_params: Any,
        feeds: list[_Feed],
    ) -> None:
        deliver = sid in state.plan.outputs
        index = self._index[sid]
        kind = self.config.stages[index].output_type
        rid = state.request_id
        last_finished = False
        first = True
        observers = self.observers

        async def emit(out: StageOutput) -> None:
            nonlocal last_finished, first
            omni = OmniOutput(
                request_id=rid,
                stage_id=sid,
                stage_index=index,
                kind=kind,
                text=out.text,
                token_ids=tuple(out.token_ids),
                data=out.data,
                finished=out.finished,
                finish_reason=out.finish_reason,
                metrics=out.metrics,
            )
            state.produced.append(omni)
            last_finished = out.finished
            if observers:
                observers.emit("stage_output", rid, sid, first)
            first = False
            if deliver:
                try:
                    await state.send.send(omni)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    # the caller stopped listening: that is an abort
                    state.scope.cancel()
                    await trio.lowlevel.checkpoint()
            for feed in feeds:
                await feed.on_output(sid, out)

        status = "aborted"
        try:
            async with inputs:
                if observers:
                    observers.emit("stage_started", rid, sid)
                await self.pools[sid].run_request(rid, inputs, sampling_params, emit)
            if not last_finished:
                # the backend ended without a finished output; the caller still gets one
                await emit(StageOutput(finished=True, finish_reason="stop"))
            state.finished_stages.add(sid)
            status = "finished"
            for feed in feeds:
                await feed.on_finished(sid)
        except StageAborted:
            # dropped through a direct backend/pool abort: an abort, not a failure
            state.scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            # a downstream stage of this request is gone: the request is failing already
            if state.error is None and not state.scope.cancel_called:
                state.fail(StageError(f"stage {sid!r}: downstream closed: {exc!r}", stage_id=sid))
        except OmniTrioError as exc:
            if isinstance(exc, StageError):
                exc.request_id = exc.request_id or rid
                exc.stage_id = exc.stage_id or sid
            state.fail(exc)
        except Exception as exc:
            # e.g. a user input processor raising: that request fails, nothing else
            err = StageError(
                f"stage {sid!r} failed request {rid!r}: {type(exc).__name__}: {exc}",
                stage_id=sid,
                request_id=rid,
            )
            err.__cause__ = exc
            state.fail(err)
        finally:
            if state.error is not None and status != "finished":
                status = "failed"
            if observers:
                observers.emit("stage_finished", rid, sid, status)

    def _finish(self, state: RequestState) -> None:
        if state.error is not None:
            state.status = "failed"
            self.n_failed += 1
        elif not set(state.plan.outputs) <= state.finished_stages:
            state.status = "aborted"
            self.n_aborted += 1
            for sid in state.plan.outputs:
                if sid not in state.finished_stages:
                    index = self._index[sid]
                    state.tail.append(
                        OmniOutput(
                            request_id=state.request_id,
                            stage_id=sid,
                            stage_index=index,
                            kind=self.config.stages[index].output_type,
                            finished=True,
                            finish_reason=FINISH_ABORT,
                        )
                    )
        else:
            state.status = "finished"
            self.n_finished += 1
        state.send.close()
        if self.observers:
            self.observers.emit("request_finished", state.request_id, state.status)
        self._requests.pop(state.request_id, None)
        state.done.set()

    # -- control -----------------------------------------------------------------------------
    def get(self, request_id: str) -> RequestState | None:
        return self._requests.get(request_id)

    def abort_nowait(self, request_id: str) -> bool:
        """Cancel a request's scope; False if it is unknown or already finished. Synchronous."""
        state = self._requests.get(request_id)
        if state is None:
            return False
        state.scope.cancel()
        return True

    async def abort(self, request_id: str) -> list[OmniOutput]:
        """Abort and wait until every stage dropped the request; its outputs so far.

        Checkpoints. Unknown or finished ids: ``[]``. Cancelling the caller does not undo the
        abort (it is already requested) but stops the wait.
        """
        state = self._requests.get(request_id)
        if state is None:
            await trio.lowlevel.checkpoint()
            return []
        state.scope.cancel()
        await state.done.wait()
        return list(state.produced)

    async def close(self) -> None:
        """Stop admission, abort every request, wait until all are gone. Checkpoints."""
        self.closed = True
        states = list(self._requests.values())
        for state in states:
            state.closing = True
            state.scope.cancel()
        for state in states:
            await state.done.wait()

    async def wait_any_done(self) -> None:
        """Wait until one of the requests now in flight has ended. Checkpoints."""
        for state in list(self._requests.values()):
            await state.done.wait()
            return
        await trio.lowlevel.checkpoint()

    @property
    def requests_in_flight(self) -> int:
        return len(self._requests)

    def __repr__(self) -> str:
        return (
            f"<Orchestrator {self.config.name!r} in_flight={len(self._requests)} "
            f"finished={self.n_finished} aborted={self.n_aborted} failed={self.n_failed}"
            f"{' closed' if self.closed else ''}>"
        )
