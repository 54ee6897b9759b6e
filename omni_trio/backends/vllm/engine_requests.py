"""The requests in the vLLM worker's running engine: :class:`EngineRequests`.

Runs on the worker's own asyncio loop, in its thread (:mod:`.worker`, which owns the
engine's start and stop, the command inbox and the RPCs). Each submitted request gets one
asyncio task that renders its prompt, adds it to the AsyncLLM, and waits until its last
output was taken or it failed; its outputs never pass through that task but leave in the
per-step batches of :class:`~._vllm_outputs.StepOutputs`. An Abort cancels the task, which
aborts the request in the engine before it posts END; a Segment feeds a segmented request's
input queue (:mod:`.streaming`); a Resume gives a request that ran out of credit its
outputs again.

vLLM's own input preprocessing may hand work to a private executor; every prompt is rendered
here first (the renderer's ``render_cmpl`` path), so ``add_request`` never needs one.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import outcome

from ...errors import InvalidRequestError
from ...outputs import StageInput
from ...transport.bridge import BridgeSender
from .outputs import LiveRequest, StepOutputs
from .prompts import render, sampling_params
from .protocol import END, Abort, Batch, Resume, Segment, Submit, engine_died
from .streaming import Segments, collect_segments, segment_stream, streamable

__all__ = ["EngineRequests", "RequestCommand"]

#: a command about one request (the worker answers RPCs itself)
RequestCommand = Submit | Segment | Abort | Resume


class EngineRequests:
    """The requests of one started AsyncLLM, each as an asyncio task of the worker's loop.

    Built by the worker once its engine started; every method runs on that loop.
    """

    def __init__(
        self,
        *,
        name: str,
        v: SimpleNamespace,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        out_tx: BridgeSender[Batch],
        mm_scope: tuple[str, int] | None,
        on_failure: Callable[[str, BaseException], None],
    ) -> None:
        self.name = name
        #: called with a request's id and what its task raised (not its cancellation)
        self._on_failure = on_failure
        self.v = v
        self.engine = engine
        self._loop = loop
        #: (stage id, replica) that prompts' multimodal UUIDs are scoped to (_vllm_mm)
        self.mm_scope = mm_scope
        #: the requests' outputs, sent on the output bridge once per engine step
        self.outputs = StepOutputs(name, loop, out_tx, v.EngineDeadError)
        self.tasks: dict[str, asyncio.Task[None]] = {}  # request id -> its task
        self._segments: dict[str, Segments] = {}  # segmented requests' input queues

    def command(self, cmd: RequestCommand) -> None:
        """Start, abort, feed or resume a request. Synchronous; a command about a request
        that already ended changes nothing."""
        outputs = self.outputs
        if isinstance(cmd, Submit):
            # tracked before its task runs: an Abort, Resume or Segment may come first
            live = outputs.add(cmd.request_id, cmd.flow)
            if cmd.segmented:
                self._segments[cmd.request_id] = asyncio.Queue()
            task = self._loop.create_task(self._request(cmd, outputs, live))
            task.add_done_callback(functools.partial(self._request_done, cmd.request_id))
            self.tasks[cmd.request_id] = task
        elif isinstance(cmd, Abort):
            running = self.tasks.get(cmd.request_id)
            if running is not None:
                running.cancel()
        elif isinstance(cmd, Segment):
            segments = self._segments.get(cmd.request_id)
            if segments is not None:
                segments.put_nowait(cmd.chunk)
        elif cmd.request_id in outputs:
            outputs.mark(cmd.request_id)

    def _request_done(self, request_id: str, task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            error = task.exception()
            if error is not None:
                self._on_failure(request_id, error)
        # A task aborted before its first step never ran its body (nor its finally): end
        # the request here. Otherwise _request already did.
        outputs = self.outputs
        if request_id in outputs:
            outputs.remove(request_id)
            self.tasks.pop(request_id, None)
            outputs.post(request_id, END)

    async def _request(self, sub: Submit, outputs: StepOutputs, live: LiveRequest) -> None:
        """One request's life in the engine: add it, wait until its last output was taken
        (by the step flush) or it failed, and abort it in the engine if it did not finish.
        Its outputs never pass through this task. Cancelled by an Abort command."""
        v, engine, rid = self.v, self.engine, sub.request_id
        added = False
        try:
            options = sub.options
            try:
                # a segmented request streams its outputs: vLLM refuses FINAL_ONLY for it
                params = sampling_params(
                    v, sub.sampling_params, sub.final_only and not sub.segmented, sub.text
                )
                if options is None:
                    prompt = render(v, engine, sub.prompt, self.mm_scope)
                else:
                    # tokenization_kwargs apply where the prompt is tokenized: here
                    options = dict(options)
                    tokenize = options.pop("tokenization_kwargs", None)
                    prompt = render(v, engine, sub.prompt, self.mm_scope, tokenize)
                if sub.segmented:
                    tok = None if options is None else tokenize
                    prompt = await self._segmented_prompt(sub, params, prompt, tok)
            except (InvalidRequestError, v.ValidationError, ValueError, TypeError) as exc:
                outputs.post(rid, outcome.Error(_as_invalid(exc)))
                return
            added = True
            if options is None:
                collector = await engine.add_request(rid, prompt, params)
            else:
                try:
                    collector = await engine.add_request(rid, prompt, params, **options)
                except (v.ValidationError, ValueError, TypeError) as exc:
                    # vLLM refused an option (a LoRA on an engine without enable_lora ...)
                    outputs.post(rid, outcome.Error(_as_invalid(exc)))
                    return
            outputs.watch(rid, collector)
            await live.done.wait()
        except asyncio.CancelledError:
            pass  # aborted: below, vLLM drops it before the backend hears END
        except v.EngineDeadError as exc:
            outputs.post(rid, engine_died(self.name, exc))
        except Exception as exc:
            outputs.post(rid, outcome.Error(exc))
        finally:
            # first out of the flush's sight: the abort below puts vLLM's own "abort" output
            # into the collector, which nobody must take
            outputs.remove(rid)
            self.tasks.pop(rid, None)
            self._segments.pop(rid, None)
            if not live.finished:
                try:
                    if added:
                        # by our id: also covers an add cancelled before it returned
                        await asyncio.shield(self._abort_in_engine(rid))
                finally:
                    outputs.post(rid, END)

    async def _segmented_prompt(
        self, sub: Submit, params: Any, first: Any, tokenize: Mapping[str, Any] | None
    ) -> Any:
        # vLLM's streaming input (_vllm_streaming), or, for params it cannot stream, every
        # segment merged into one prompt once the input ended
        v, engine = self.v, self.engine
        segments = self._segments[sub.request_id]

        def render_one(chunk: StageInput) -> Any:
            return render(v, engine, chunk, self.mm_scope, tokenize)

        if streamable(params, v.FINAL_ONLY):
            return segment_stream(v.StreamingInput, first, segments, render_one)
        return render_one(await collect_segments(sub.prompt, segments))

    async def _abort_in_engine(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except self.v.EngineDeadError:
            pass  # nothing left to abort in a dead engine

    def __len__(self) -> int:
        return len(self.tasks)

    def __repr__(self) -> str:
        return f"<EngineRequests {self.name} tasks={len(self.tasks)} outputs={self.outputs!r}>"


def _as_invalid(exc: BaseException) -> InvalidRequestError:
    if isinstance(exc, InvalidRequestError):
        return exc
    err = InvalidRequestError(f"invalid request for vllm: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err
