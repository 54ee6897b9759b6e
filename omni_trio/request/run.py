"""How one request's stages run, and where their outputs go: :class:`StageRunner`.

The orchestrator's request task calls :meth:`StageRunner.run` inside the request's cancel
scope. Each active stage runs the request on the stage's pool, in the request task itself
when it is the only one running (a chain of stages each started by the one before needs no
other task), else as tasks in a nursery. Entry stages and ``stream_input`` stages start with
the request; a stage that takes its input whole starts once every upstream finished, in the
task of the last one (without observers: until then it holds no replica binding, channel or
task). What happens to a stage's outputs depends on who needs them
(:func:`~omni_trio.request.planning.stage_path`):

- an output stage that feeds no other stage puts them, as emitted, into the request's bounded
  :class:`~omni_trio.transport.queue.OutputQueue`; the consumer builds each
  :class:`~omni_trio.outputs.OmniOutput` when it reads it (no task between them);
- a stage whose outputs nobody needs as they come keeps them, and once its backend returned
  its task hands them to the downstream stages' input processors;
- any other stage (an output stage that feeds another, a stage feeding a ``stream_input``
  stage, or every stage while observers watch the engine) has a routing task beside it: the
  backend's ``emit`` only fills a bounded outbox, and the routing loop
  (:func:`~omni_trio.request.route.route_stage`) delivers each output to the caller, to the
  observers and to the downstream stages' input processors.

The two stages of a prefill/decode pair (:mod:`~omni_trio.request.pd`) always take their
input whole, observers or not: a prefill stage's input is kept on the request, and once
it finished its decode stage starts with the same prompt (the token ids the prefill
reports, or that input) and the ``kv_transfer_params`` from its finished output (missing
or malformed ones fail the request there).

Input processors and observers never run inside a backend's call stack. A stage's failure
fails the request (:meth:`~omni_trio.request.state.Request.fail`), an abort through its
replica aborts it; nothing here decides the request's outcome.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import replace
from functools import partial

import trio

from ..config.pd import PDPair, pd_pairs
from ..config.pipeline import PipelineConfig
from ..context import RequestContext
from ..errors import OmniTrioError, StageAborted, StageError
from ..observer import ObserverSet
from ..outputs import StageInput, StageOutput
from ..stages.emit import Emit, Emitter
from ..stages.pool import StagePool
from ..stages.processors import InputProcessor, reads_text
from ..transport.queue import OutputQueue
from .companions import companion_key, run_with_companions
from .emits import CollectEmit, FirstOutputEmit, OutboxEmit, pulled_emitter
from .feeds import StageFeed, StageInputs, WholeInput
from .pd import decode_input, decode_sampling_params, kv_transfer_params_of
from .planning import RequestPlan, StagePath, stage_path
from .route import COMPLETED, NONE_READY, STOPPED, Ready, finish_feeds, route_stage
from .state import Request

__all__ = ["StageRunner"]

#: one stage task of a request (a backend run or a routing loop); returns what it made ready
Run = Callable[[], Awaitable[Ready]]
#: a stage's path, whether its outputs are streamed, whether their text is read
Layout = tuple[StagePath, bool, bool]


class StageRunner:
    """Runs the stages of the orchestrator's requests. Owned by the
    :class:`~omni_trio.engine.orchestrator.Orchestrator`."""

    def __init__(
        self,
        config: PipelineConfig,
        pools: Mapping[str, StagePool],
        processors: Mapping[str, InputProcessor],
        observers: ObserverSet,
    ) -> None:
        self.config = config
        self._pools = pools
        self._processors = processors
        self.observers = observers
        self._stages = {st.id: st for st in config.stages}
        # each stage's upstream ids as a tuple, which every feed of it shares
        self._upstream = {st.id: tuple(st.inputs) for st in config.stages}
        # per route: each active stage's path, whether its outputs are streamed and whether
        # their text is read (they depend on the plan and the config only); RoutePlanner
        # keeps a bounded set of plans (by the plan's id, checked against the plan itself: no
        # hash of the plan per stage)
        self._layouts: dict[int, tuple[RequestPlan, dict[str, Layout]]] = {}
        # prefill/decode pairs (request/pd.py): by decode stage, and every stage of one,
        # each of which starts only once its input is whole, observers or not
        pairs = pd_pairs(config.stages, config.source)
        self._pd_decodes: dict[str, PDPair] = {p.decode: p for p in pairs}
        self._pd_stages = frozenset(self._pd_decodes) | {p.prefill for p in pairs}

    def _layout(self, plan: RequestPlan) -> dict[str, Layout]:
        """Each active stage's path without observers, its ``streamed`` flag and its
        ``text`` flag (see :meth:`_stage_tasks`), computed once per plan. Synchronous."""
        known = self._layouts.get(id(plan))
        if known is not None and known[0] is plan:
            return known[1]
        layout: dict[str, Layout] = {}
        # linear in the active stages and their edges: a 2,000-stage chain plans at once
        active = set(plan.active)
        downstream = self.config.graph().downstream
        for sid in plan.active:
            down = [self._stages[d] for d in downstream[sid] if d in active]
            output = sid in plan.output_set
            streamed = output or any(st.stream_input for st in down)
            path = stage_path(output=output, feeds=len(down), streamed=streamed, observed=False)
            text = output or any(
                reads_text(self._processors[st.id], st.processor_options) for st in down
            )
            layout[sid] = (path, streamed, text)
        if len(self._layouts) < 256 or known is not None:
            self._layouts[id(plan)] = (plan, layout)
        return layout

    def run(self, req: Request, feeds: list[StageFeed]) -> Coroutine[object, object, None]:
        """Run every active stage of ``req`` until each ended; the feeds between them are
        appended to ``feeds`` (the caller closes them): await what this returns (a
        coroutine, as if this were an ``async def``; the feeds are built when it is called).
        Awaiting it checkpoints; await it inside the request's cancel scope. Failures fail
        the request, they are not raised."""
        # the driver's own coroutine, not one awaiting it: a frame less per request in flight
        return self._drive(req, self._request_runs(req, feeds))

    async def _drive(self, req: Request, runs: list[Run]) -> None:
        """Run ``runs``, then the deferred stages each one made ready: a single run in this
        task (a loop, not a call chain: a finished stage's frame is gone before the next one
        runs), several in one nursery (:meth:`_drive_in`). Checkpoints."""
        while len(runs) == 1:
            # only the run's coroutine is held while it runs: not its partial, nor the list
            work = runs.pop()()
            del runs
            runs = self._ready_runs(req, await work)
        if runs:
            async with trio.open_nursery() as nursery:
                await self._drive_in(req, runs, nursery)

    async def _drive_in(self, req: Request, runs: list[Run], nursery: trio.Nursery) -> None:
        """Run the last of ``runs`` in this task and start the others as tasks of
        ``nursery``, each going on the same way with what its run made ready. Every task of
        the request is a child of that one nursery: no nursery or frame nests per stage, so a
        chain of thousands of stages runs as deep as a chain of two. Checkpoints."""
        while runs:
            for run in runs[:-1]:
                nursery.start_soon(self._drive_in, req, [run], nursery, name=req.request_id)
            work = runs[-1]()
            del runs
            runs = self._ready_runs(req, await work)

    def _ready_runs(self, req: Request, ready: Ready) -> list[Run]:
        """What runs for the deferred stages whose input just became complete, each with its
        final chunk as its whole input. Synchronous."""
        if not ready:
            return []
        if self.observers:
            for feed, chunk in ready:
                feed.handed_whole(chunk)
        if not self._pd_stages:
            return [
                run
                for feed, chunk in ready
                for run in self._stage_tasks(req, feed.stage_id, WholeInput(chunk), feed.onward)
            ]
        runs: list[Run] = []
        for feed, chunk in ready:
            sid = feed.stage_id
            pair = self._pd_decodes.get(sid)
            if pair is not None:
                try:
                    chunk = self._decode_start(req, pair)
                except StageError as exc:
                    req.fail(sid, exc)  # that request only: nothing of the decode started
                    continue
            elif sid in self._pd_stages and chunk is not None:
                req.keep_input(sid, chunk)  # a prefill stage's: its decode stage's input
            runs.extend(self._stage_tasks(req, sid, WholeInput(chunk), feed.onward))
        return runs

    def _decode_start(self, req: Request, pair: PDPair) -> StageInput:
        """The whole input of ``pair``'s decode stage, its prefill having finished: the
        prompt the prefill computed (``decode_input``); its params (set on the request) with
        the ``kv_transfer_params`` the prefill returned. Synchronous. Raises StageError
        naming the pair when they are missing or malformed."""
        rid = req.request_id
        outputs = req.stage_outputs(pair.prefill)
        kv = kv_transfer_params_of(outputs, pair, rid)  # outputs[-1]: the finished one
        prefill_input = (
            req.kept_input(pair.prefill) if self._upstream[pair.prefill] else req.first_input
        )
        if prefill_input is None:
            raise StageError(
                f"{pair.label}: prefill stage {pair.prefill!r} got no input for request "
                f"{rid!r} (its input processor sent none), so there is no prompt to decode",
                stage_id=pair.decode,
                request_id=rid,
            )
        params = req.sampling_params(pair.decode)
        assert isinstance(params, Mapping)  # pd_request_params checked it
        req.set_stage_params(pair.decode, decode_sampling_params(params, kv, rid))
        return decode_input(prefill_input, outputs[-1].metrics, pair)

    def _request_runs(self, req: Request, feeds: list[StageFeed]) -> list[Run]:
        """Build every active stage's feed (appended to ``feeds``; deferred ones, without a
        channel, unless observers watch) and return what runs at once. Synchronous."""
        plan = req.plan
        defer = not self.observers.routes
        inputs: dict[str, StageInputs] = {}
        feeds_of: dict[str, list[StageFeed]] = {sid: [] for sid in plan.active}
        context = req.context
        companion_stage = context.companion_stage if context.companions else None
        for sid in plan.active:
            st = self._stages[sid]
            if not st.inputs:
                inputs[sid] = req.entry_input()
                continue
            upstream: Sequence[str] = self._upstream[sid]
            stream = st.stream_input
            if companion_stage is not None and companion_stage in upstream:
                # it also takes the companions' outputs, and waits for all of them
                roles = [companion_key(companion_stage, c.role) for c in context.companions]
                upstream, stream = [*upstream, *roles], False
            send: trio.MemorySendChannel[StageInput] | None = None
            if not ((defer or sid in self._pd_stages) and not stream):
                send, inputs[sid] = trio.open_memory_channel[StageInput](self.config.output_buffer)
            feed = StageFeed(
                sid,
                upstream,
                stream=stream,
                processor=self._processors[sid],
                options=st.processor_options,
                send=send,
                request_id=req.request_id,
                observers=self.observers,
                context=req.context,
            )
            feeds.append(feed)
            for up in st.inputs:
                feeds_of[up].append(feed)
        onward = {sid: tuple(fs) for sid, fs in feeds_of.items()}
        for feed in feeds:
            feed.onward = onward[feed.stage_id]
        return [
            run
            for sid in plan.active
            if sid in inputs
            for run in self._stage_tasks(req, sid, inputs[sid], onward[sid])
        ]

    def _stage_tasks(
        self, req: Request, sid: str, inputs: StageInputs, feeds: Sequence[StageFeed]
    ) -> list[Run]:
        """What runs for stage ``sid`` of a request: one or two tasks (see ``stage_path``).
        ``streamed``: a caller or a ``stream_input`` stage needs the outputs as they come
        (else the backend may send its finished output only). ``text``: a caller or a
        downstream input processor reads the outputs' text (else the backend may leave it out;
        only a collected stage has nobody else to read it)."""
        path, streamed, text = self._layout(req.plan)[sid]
        if self.observers.routes:
            path = "routed"
        if path == "pulled":
            return [partial(self._run_pulled, req, sid, inputs)]
        if path == "collected":
            return [partial(self._run_collected, req, sid, inputs, feeds, text)]
        outbox: OutputQueue[StageOutput] = OutputQueue(self.config.output_buffer)
        return [
            partial(self._run_backend, req, sid, inputs, outbox, streamed, feeds),
            partial(route_stage, req, sid, outbox, feeds, streamed, self.observers),
        ]

    async def _run_pulled(self, req: Request, sid: str, inputs: StageInputs) -> Ready:
        # An output stage that feeds no other stage: its outputs go into the request's own
        # queue, as they are, and the consumer turns them into OmniOutputs when it reads them
        # (Request.next_output): no routing task, no scheduler trip between the backend and
        # the consumer. The queue's window is the backpressure.

        emitter = pulled_emitter(req, sid)
        seen = self._watch(req, sid, emitter)
        status = "aborted"
        try:
            if await self._run_stage(
                req, sid, inputs, emitter if seen is None else seen.emitter(), streamed=True
            ):
                if not req.failed and not req.stage_finished(sid):
                    # the backend ended without a finished output; the caller gets one
                    await req.send_output(sid, STOPPED)
                status = "finished"
        finally:
            if seen is not None:
                self._report(req, sid, seen, status)
        return NONE_READY

    def _watch(self, req: Request, sid: str, emitter: Emitter) -> FirstOutputEmit | None:
        """With observers (none needing routing), tell them the stage starts and note when
        its first output comes; else None. Synchronous."""
        observers = self.observers
        if not observers:
            return None
        observers.emit("stage_started", req.request_id, sid)
        return FirstOutputEmit(emitter, observers.clock, req.n_produced)

    def _report(self, req: Request, sid: str, seen: FirstOutputEmit, status: str) -> None:
        """A stage without a routing task ended: its outputs and its end, to the observers
        (see :mod:`omni_trio.observer`). Synchronous."""
        observers, rid = self.observers, req.request_id
        if req.failed and status != "finished":
            status = "failed"
        outs = req.stage_outputs(sid, seen.since)
        if outs and seen.first is not None:
            observers.emit_at(seen.first, "stage_output", rid, sid, True)
        for out in outs:
            observers.emit("stage_delta", rid, sid, out)
        observers.emit("stage_finished", rid, sid, status)

    async def _run_collected(
        self,
        req: Request,
        sid: str,
        inputs: StageInputs,
        feeds: Sequence[StageFeed],
        text: bool,
    ) -> Ready:
        # A stage whose outputs nobody needs as they come (no caller, no streaming downstream
        # stage): the backend's outputs are kept, and routed here once it returned (out of
        # its call stack), straight to the downstream stages' input: no routing task.
        collect = CollectEmit(req, sid)
        emitter = collect.emitter()
        seen = self._watch(req, sid, emitter)
        status = "aborted"
        try:
            ran = await self._run_stage(
                req,
                sid,
                inputs,
                emitter if seen is None else seen.emitter(),
                streamed=False,
                text=text,
                feeds=feeds,
            )
            if not ran:
                return NONE_READY
            ready: list[tuple[StageFeed, StageInput | None]] = []
            try:
                if not req.failed:
                    if not req.stage_finished(sid):
                        await collect.emit(STOPPED)
                    outs = collect.outputs()
                    for feed in feeds:
                        feed.collect(sid, outs)  # none streams: this stage would be routed
                    for feed, chunk in finish_feeds(sid, feeds, ready):
                        await feed.send_final(chunk)
                    status = "finished"
            except OmniTrioError as exc:
                # an input processor failed: a failure of its own (downstream) stage
                req.fail(sid, exc)
                return NONE_READY
            return ready
        finally:
            if seen is not None:
                self._report(req, sid, seen, status)

    async def _run_stage(
        self,
        req: Request,
        sid: str,
        inputs: StageInputs,
        emit: Emit,
        *,
        streamed: bool,
        text: bool = True,
        feeds: Sequence[StageFeed] = (),
    ) -> bool:
        """Run the request on stage ``sid``'s pool (bound to a replica, run there, released);
        whether the backend returned normally (``streamed`` and ``text``: see
        ``StageBackend.run_request``). An abort through the replica (``StageBackend.abort``)
        aborts the request, any failure fails it. Its companions (on the entry stage that made
        them) run beside it on the same replica, their outputs into ``feeds``, and keep their
        text; it returns once they ended too. Checkpoints."""
        pool = self._pools[sid]
        rid = req.request_id
        try:
            with inputs:
                waited = 0.0
                try:
                    backend = pool.bind_nowait(rid)
                except trio.WouldBlock:
                    # no replica takes it now: wait (FIFO) for a slot or a restarting one
                    waited = self.observers.clock()
                    backend = await pool.bind(rid)
                    waited = self.observers.clock() - waited
                try:
                    context = req.context
                    if self.observers:
                        context = self._observed(req, sid, backend.replica, waited)
                    if context.companions and sid == context.companion_stage:
                        await run_with_companions(
                            req, pool, backend, sid, feeds, inputs, emit, streamed
                        )
                    else:
                        await backend.run_request(
                            rid,
                            inputs,
                            req.sampling_params(sid),
                            emit,
                            streamed=streamed,
                            text=text,
                            context=context,
                        )
                finally:
                    pool.release(rid)
        except StageAborted:
            # dropped through the replica's own abort: an abort, not a failure
            req.request_abort()
        except Exception as exc:
            req.fail(sid, exc)
        else:
            return True
        return False

    def _observed(self, req: Request, sid: str, replica: int, waited: float) -> RequestContext:
        """Tell the observers the stage bound the request; the context its backend gets
        (with the tracing headers of its stage span when a tracer gives them). Synchronous."""
        observers = self.observers
        observers.emit("stage_bound", req.request_id, sid, replica, waited)
        headers = observers.trace_headers(req.request_id, sid)
        if headers is None:
            return req.context
        return replace(req.context, trace_headers=headers)

    async def _run_backend(
        self,
        req: Request,
        sid: str,
        inputs: StageInputs,
        outbox: OutputQueue[StageOutput],
        streamed: bool,
        feeds: Sequence[StageFeed],
    ) -> Ready:
        # Runs the request on the stage's pool. The backend's emit only puts its outputs into
        # the stage's bounded outbox (with room it does not even yield); the stage's routing
        # task (route_stage: the orchestrator's code, never the backend's call stack)
        # delivers them. The outbox ends with a completion marker only on a normal end.
        emitter = OutboxEmit(req, outbox).emitter()
        try:
            if await self._run_stage(req, sid, inputs, emitter, streamed=streamed, feeds=feeds):
                outbox.send_final_nowait(COMPLETED)
        finally:
            outbox.close()
        return NONE_READY
