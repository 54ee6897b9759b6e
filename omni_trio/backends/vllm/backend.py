"""The ``vllm`` backend: one replica = one real ``vllm.v1.engine.async_llm.AsyncLLM``.

Each replica owns a worker thread that runs an event loop and hosts the AsyncLLM (see
``worker``): a plain asyncio loop, or with ``loop: trio-asyncio`` trio with
trio-asyncio's loop (the design card's choice, measured at 1.3-1.4x the frontend CPU per
request). The orchestrator's loop never runs vLLM code: requests, aborts, resumes and control
calls are handed to the worker's loop (``EngineWorker.command``, thread-safe, never blocking);
replies and events come back on :mod:`omni_trio.transport.bridge` channels. Outputs come back
on one bridge per replica: everything one engine step produced, for all of its requests,
crosses as one batch with at most one wake-up, and a demultiplexing task hands each request its
items; while a request's task waits with nothing pending, its outputs go straight on through
``emit.nowait`` (into the consumer's window, without waking the request's task). Backpressure
stays per request: each has a window of ``output_buffer`` outputs sent and not yet taken; a
request out of credit leaves its outputs in vLLM's collector (which merges its deltas) until it
has taken half of them, so a slow consumer holds back only its own request. A request whose
outputs nobody streams (see ``outputs_streamed``) asks vLLM for ``FINAL_ONLY``; one whose text
nobody reads (``outputs_text_read``: an intermediate stage handing its token ids on, no caller
or observer reading it) asks vLLM not to detokenize (``detokenize=False``) unless its sampling
params have stop strings: its outputs carry token ids and no text (in an abort's partial
outputs too).
vllm is imported in the worker thread only, so ``import omni_trio`` stays light; without
vllm, start-up raises :class:`~omni_trio.errors.BackendUnavailableError`.

Config (a stage with ``backend: vllm``):

``engine_args``  ``vllm.AsyncEngineArgs`` fields. ``model: "tiny:<preset>"`` builds and uses a
                 local tiny model (:func:`omni_trio.models.resolve_model`). On CPU machines
                 ``dtype=bfloat16, enforce_eager=True, gpu_memory_utilization=0.15,
                 max_model_len=256, max_num_seqs=8`` apply unless set.
``options``      ``cpu_bind`` (str, or a list indexed by replica): ``VLLM_CPU_OMP_THREADS_BIND`` for
                 this engine only, e.g. ``"0"`` for one stage and ``"1"`` for the other (vLLM's
                 ``auto`` pins every engine to core 0); ``core_shutdown_grace_s`` (float, 10): how
                 long the EngineCore gets after SIGTERM before SIGKILL (a clean exit takes 1-2 s);
                 ``output_buffer`` (int, 64): the per-request bridge window; ``abort_timeout_s``
                 (float, 10): bound on waiting for the engine to confirm an abort; ``loop``
                 (``asyncio`` or ``trio-asyncio``, default ``asyncio``): the worker thread's event
                 loop (``trio-asyncio`` needs the ``omni-trio[trio-asyncio]`` extra, else the start
                 raises :class:`~omni_trio.errors.BackendUnavailableError`). Declared by
                 :class:`~omni_trio.config.options.VllmOptions`, checked at load, like
                 ``engine_args`` keys and ``default_sampling_params``.

Inputs: ``StageInput.token_ids`` (what a downstream stage receives) become
``{"prompt_token_ids": ...}``, ``prompt`` a text prompt, ``data`` a vLLM prompt dict. vLLM
cannot start on a partial prompt, so with ``stream_input: true`` the whole input is collected
first (:func:`~omni_trio.stages.collect_input`) and the request starts when it is final.
In an entry stage with more than one replica, a prompt dict's ``multi_modal_data`` items get
``multi_modal_uuids`` scoped to the replica (``<stage>:<replica>:<hash or given uuid>``, see
:mod:`~omni_trio.backends.vllm.multimodal`), so no replica takes a cache hit for data it never
received.

Sampling params: ``None`` or a dict become ``SamplingParams(**d, output_kind=DELTA)``; a
``SamplingParams`` is copied and forced to DELTA. An unknown key or a bad value raises
:class:`~omni_trio.errors.InvalidRequestError` from ``run_request``.

Prefill/decode pairs (:mod:`omni_trio.config.pd`): a stage's ``engine_args.kv_transfer_config``
goes to vLLM as it is; the request core puts a pair's ``kv_transfer_params`` into the
sampling params' ``extra_args`` (where vLLM reads them), and a finished output carries the
``kv_transfer_params`` vLLM returned (``RequestOutput.kv_transfer_params``) in its
``metrics``, beside ``prompt_token_ids``.

Per-request options (``generate(priority=, arrival_time=, lora_request=, trace_headers=,
tokenization_kwargs=)``, read from the request's context): those that are not vLLM's defaults
go to ``AsyncLLM.add_request`` (:func:`~._vllm_protocol.request_options`). ``priority``,
``arrival_time`` and ``trace_headers`` reach every vllm stage of the request; ``lora_request``
and ``tokenization_kwargs`` only an entry stage (they concern the caller's prompt and model).
``tokenization_kwargs`` are applied where the prompt is rendered (vLLM reads them only for raw
prompts). ``priority`` matters under ``engine_args: {scheduling_policy: priority}`` (lower
first); ``trace_headers`` go to vLLM only when the stage's ``otlp_traces_endpoint`` is set
(vLLM drops them otherwise, with a warning that tracing is disabled). An option
vLLM refuses (a LoRA on an engine without ``enable_lora``) fails the request with
:class:`~omni_trio.errors.InvalidRequestError`.

``collective_rpc(method, args, kwargs)`` passes through to ``AsyncLLM.collective_rpc``, except
these control methods, answered by the backend: ``get_num_unfinished_requests``,
``get_num_queued_tokens``, ``engine_core_pids``, ``check_health``, ``reset_prefix_cache``,
``chat_template`` (the tokenizer's default chat template, or None: the server renders chats
with it).

Engine death (the EngineCore process exits): the replica is marked dead, its requests fail
with :class:`~omni_trio.errors.ReplicaDeadError`, ``serve()`` stops the worker and returns.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Sequence
from typing import Any

import anyio
import msgspec
import outcome
import trio

from ...config.options import VllmOptions, parse_options
from ...config.stage import StageConfig
from ...errors import ReplicaDeadError
from ...outputs import SamplingParams, StageInput
from ...stages.backend import StageBackend
from ...stages.emit import Emit, nowait_of
from ...stages.input_stream import InputStream, collect_input
from ...transport.bridge import BridgeReceiver, open_bridge
from ...transport.loop_host import require_loop
from .multimodal import replica_scope
from .outputs import RequestInbox
from .protocol import (
    CPU_ENGINE_DEFAULTS,
    END,
    Abort,
    Batch,
    Died,
    Flow,
    Resume,
    Rpc,
    Segment,
    Submit,
    died_of,
    request_options,
)
from .worker import EngineWorker

__all__ = ["CPU_ENGINE_DEFAULTS", "VllmBackend"]

logger = logging.getLogger(__name__)

THREAD_PREFIX = "omni-trio-vllm"

# The output bridge's window counts batches (one per engine step), not outputs; what bounds
# the memory is each request's own window (Flow), so this one never fills in practice.
_OUTPUT_BATCHES = 1 << 20


class VllmBackend(StageBackend):
    """One replica of a vLLM stage (see the module docstring for config and behaviour)."""

    backend_name = "vllm"

    def __init__(self, config: StageConfig, *, stage_index: int, replica: int = 0) -> None:
        super().__init__(config, stage_index=stage_index, replica=replica)
        self._thread: threading.Thread | None = None
        self._worker: EngineWorker | None = None
        self._evt_rx: BridgeReceiver[Any] | None = None
        self._out_rx: BridgeReceiver[Batch] | None = None
        self._outputs_ended = False  # the worker's output bridge ended (see _demultiplex)
        # request id -> where the demultiplexer puts that request's items
        self._inboxes: dict[str, RequestInbox] = {}
        self._exited = trio.Event()
        self.core_pids: tuple[int, ...] = ()
        self.options = parse_options(
            VllmOptions, config.options, where=f"$.stages[{stage_index}].options", backend="vllm"
        )
        self._out_buffer = self.options.output_buffer
        #: (stage id, replica) this replica's multimodal UUIDs are scoped to, or None
        self.mm_scope = replica_scope(
            self.stage_id, replica, replicas=config.replicas, entry=not config.inputs
        )
        self._abort_timeout = self.options.abort_timeout_s
        self._entry = not config.inputs  # takes the caller's prompt (see request_options)
        # vLLM traces (and takes trace headers) only with an endpoint of its own
        self._traced = bool(config.engine_args.get("otlp_traces_endpoint"))

    @property
    def thread_name(self) -> str:
        return f"{THREAD_PREFIX}-{self.name}"

    # -- lifecycle ----------------------------------------------------------------------------
    async def _start(self) -> None:
        """Start the worker thread and wait until its AsyncLLM is ready (~20 s on CPU).

        Cancellation kills the half-built EngineCore and joins the thread (bounded) before
        re-raising. Raises the worker's start-up error (BackendUnavailableError,
        ConfigError, or vLLM's own) if the engine cannot be built; BackendUnavailableError
        also when ``loop: trio-asyncio`` is set and trio-asyncio is not installed.
        """
        # before the worker's thread: a missing trio-asyncio is a typed error, not a crash of
        # that thread (in a helper thread: an import blocks)
        await trio.to_thread.run_sync(require_loop, self.options.loop)
        evt_tx, evt_rx = open_bridge(8, name=f"{self.name}:events")
        out_tx, out_rx = open_bridge[Batch](_OUTPUT_BATCHES, name=f"{self.name}:outputs")
        self._evt_rx, self._out_rx = evt_rx, out_rx
        token = trio.lowlevel.current_trio_token()
        exited = self._exited

        def on_exit() -> None:
            token.run_sync_soon(exited.set)

        self._worker = EngineWorker(
            name=self.name,
            replica=self.replica,
            engine_args=dict(self.config.engine_args),
            options=msgspec.structs.asdict(self.options),
            evt_tx=evt_tx,
            out_tx=out_tx,
            on_exit=on_exit,
            on_phase=self.mark_phase,
            mm_scope=self.mm_scope,
            loop=self.options.loop,
        )
        # the worker runs in this context (a copy): a model build there reports its steps
        # wherever the caller's do (omni_trio.models.progress)
        run = contextvars.copy_context().run
        self._thread = threading.Thread(target=run, args=(self._worker.run,), name=self.thread_name)
        self._thread.start()
        self.mark_phase("thread_started")
        try:
            started = await evt_rx.receive()
        except anyio.EndOfStream:
            started = outcome.Error(RuntimeError("the worker ended before reporting readiness"))
        except BaseException:
            self._worker.cancel_start()
            raise
        assert isinstance(started, outcome.Outcome)  # the first event: the start's outcome
        self.core_pids = started.unwrap().core_pids
        self.mark_phase("engine_ready")

    async def _serve_forever(self) -> None:
        assert self._evt_rx is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._demultiplex)
            try:
                async for event in self._evt_rx:
                    if isinstance(event, Died):
                        death = ReplicaDeadError(f"replica {self.name}: {event.reason}")
                        death.__cause__ = event.error
                        self._die(death)
                        break
            except anyio.BrokenResourceError:
                pass  # the worker's loop ended: the base class marks the replica dead
            nursery.cancel_scope.cancel()
        crash = self._crash()
        if crash is not None:  # set before the worker closed its bridges
            raise ReplicaDeadError(
                f"replica {self.name}: its worker's loop crashed: {type(crash).__name__}: {crash}"
            ) from crash

    def _crash(self) -> BaseException | None:
        # what ended the worker's loop with an error, if it did
        return self._worker.crash if self._worker is not None else None

    async def _demultiplex(self) -> None:
        """Hand each item of the worker's per-step batches to its request (one wake-up per
        engine step for all of them, handled in the bridge's wake-up callback, not in this
        task; most outputs go straight on, see :class:`RequestInbox`).
        When the worker's output side ends, every request still waiting is told so (its
        inbox closes without END), and so is every later one."""
        assert self._out_rx is not None
        inboxes = self._inboxes

        def hand_on(batch: Batch) -> None:
            for request_id, item in batch:
                inbox = inboxes.get(request_id)
                if inbox is not None:
                    inbox.put(item)

        try:
            # handed on from the bridge's wake-up callback: no task switch per engine step
            await self._out_rx.consume(hand_on)
        except anyio.BrokenResourceError:
            # the worker's thread ended without closing its end: the same as its end, every
            # waiting request fails below (ReplicaDeadError in _run), nothing is dropped
            pass
        finally:
            self._outputs_ended = True
            for inbox in self._inboxes.values():
                inbox.close()

    async def _stop(self) -> None:
        """Stop the AsyncLLM (~1-5 s), reap its processes and join the worker thread.

        Runs shielded under the base class's shutdown deadline.
        """
        if self._worker is not None:
            if self._ready:
                self._worker.stop()
            else:
                self._worker.cancel_start()
        if self._thread is None:
            return
        await self._exited.wait()
        # The thread's last act was to schedule ``exited.set``: this join is immediate.
        self._thread.join()
        for end in (self._evt_rx, self._out_rx):
            if end is not None:
                end.close()
        crash = self._crash()
        if crash is not None and self._ready and not died_of(self.death, crash):
            # the worker failed while stopping, or of something the replica did not die of:
            # the stop failed (the base class raises StageStopError from it)
            raise crash

    # -- requests -----------------------------------------------------------------------------
    async def _run(
        self, request_id: str, inputs: InputStream, sampling_params: SamplingParams, emit: Emit
    ) -> None:
        if not self._takes_segments(request_id):
            await self._submit(request_id, await collect_input(inputs), sampling_params, emit)
            return
        # input in segments: vLLM's streaming input (a resumable request), fed as they come
        try:
            first = await inputs.receive()
        except trio.EndOfChannel:
            first = StageInput()  # no input at all: refused as an empty prompt
        if first.final:
            await self._submit(request_id, first, sampling_params, emit)
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._forward_segments, request_id, inputs)
            done = await outcome.acapture(
                self._submit, request_id, first, sampling_params, emit, segmented=True
            )
            nursery.cancel_scope.cancel()
        done.unwrap()

    def _takes_segments(self, request_id: str) -> bool:
        # a stream_input stage, or an entry stage serving a streaming_input request
        if self.config.stream_input:
            return True
        context = self.request_context(request_id)
        return context is not None and context.streaming_input and not self.config.inputs

    async def _forward_segments(self, request_id: str, inputs: InputStream) -> None:
        # each chunk to the worker as it comes; the end of the input as None
        assert self._worker is not None
        async for chunk in inputs:
            if not self._worker.command(Segment(request_id, chunk)) or chunk.final:
                return
        self._worker.command(Segment(request_id, None))

    async def _submit(
        self,
        request_id: str,
        prompt: StageInput,
        sampling_params: SamplingParams,
        emit: Emit,
        *,
        segmented: bool = False,
    ) -> None:
        worker = self._worker
        assert worker is not None
        flow = Flow(self._out_buffer)

        def resume() -> None:
            # rare: this request ran out of credit; the worker goes on now
            worker.command(Resume(request_id))

        # unbounded: the worker sends at most flow.window outputs not yet taken
        inbox = RequestInbox(flow, resume, nowait_of(emit))
        self._inboxes[request_id] = inbox
        final_only = not self.outputs_streamed(request_id)
        text = self.outputs_text_read(request_id)
        ended = finished = False
        try:
            context = self.request_context(request_id)
            options = (
                None
                if context is None
                else request_options(context, entry=self._entry, traced=self._traced)
            )
            submit = Submit(
                request_id, prompt, sampling_params, final_only, flow, options, segmented, text
            )
            if self._outputs_ended or not worker.command(submit):
                ended = True  # nothing was submitted: nothing to abort
                raise self._worker_gone(f"while request {request_id!r} was submitted")
            try:
                last = await inbox.deliver(emit)
            except trio.EndOfChannel:
                raise self._worker_gone(f"while request {request_id!r} was running") from None
            if last is None:
                finished = True
            elif last is END:
                ended = True
            else:
                assert isinstance(last, outcome.Error)
                if isinstance(last.error, ReplicaDeadError):  # the engine died
                    self._die(last.error)
                last.unwrap()
        finally:
            if not (finished or ended):
                inbox.fast = None  # nothing more is delivered, from any task
                await self._abort_and_drain(request_id, inbox)
            del self._inboxes[request_id]
            inbox.close()

    def _worker_gone(self, when: str) -> ReplicaDeadError:
        return ReplicaDeadError(
            f"replica {self.name}: its worker stopped {when}",
            stage_id=self.stage_id,
            replica=self.replica,
        )

    async def _abort_and_drain(self, request_id: str, inbox: RequestInbox) -> None:
        # The worker sends END only after vLLM dropped the request, so reading up to it is
        # what makes "aborted in the engine before returning" true.
        assert self._worker is not None
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + self._abort_timeout
            if self._worker.command(Abort(request_id)):
                with contextlib.suppress(trio.EndOfChannel):
                    while await inbox.receive() is not END:
                        pass
        if scope.cancelled_caught:
            logger.warning("%s: abort of %r not confirmed in time", self.name, request_id)

    async def _rpc(self, method: str, args: Sequence[object], kwargs: dict[str, object]) -> object:
        assert self._worker is not None
        reply_tx, reply_rx = open_bridge(1, name=f"{self.name}:rpc:{method}")
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            sent = self._worker.command(Rpc(method, tuple(args), dict(kwargs), reply_tx))
            try:
                if not sent:
                    raise anyio.EndOfStream
                reply = await reply_rx.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                raise self._worker_gone(f"before answering {method!r}") from None
        finally:
            reply_rx.close()
        # raises the worker's exception here; the base class names the replica and method
        return reply.unwrap()

    def __repr__(self) -> str:
        base = super().__repr__()[:-1]
        alive = self._thread is not None and self._thread.is_alive()
        return (
            f"{base} thread={'alive' if alive else 'none'} loop={self.options.loop} "
            f"core_pids={list(self.core_pids)}>"
        )
