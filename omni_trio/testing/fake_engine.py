"""A fake batching engine, and the stage backend that drives it: fakes for tests and benchmarks.

:class:`FakeEngine` has the shape of a batching inference engine, with no model: it runs up
to ``slots`` requests at once; one step takes ``step_s`` seconds on the trio clock and gives
every running request one token; a request added while every slot is taken waits, first
in, first out, for a free one; every request gets ``tokens`` tokens. Token ``k`` of a
request whose prompt is ``P`` is ``P[k % len(P)] + 1`` (an empty prompt counts as ``[0]``),
so a chain of fake engines adds 1 per hop, as a chain of ``scripted`` stages does.

:class:`FakeEngineBackend` is a stage whose replica drives one FakeEngine. Name it in a
pipeline config::

    stages:
      - id: thinker
        backend: "omni_trio.testing.fake_engine:FakeEngineBackend"
        options: {slots: 8, step_s: 0.002, tokens: 16}

or build a linear pipeline of them with :func:`omni_trio.testing.fake_engine_pipeline`. Its
options are :class:`FakeEngineOptions`, checked when the config is loaded. A stage whose
outputs nobody needs as they come asks its engine for the finished output only, as the vllm
backend asks vLLM for ``FINAL_ONLY`` output; a stage whose outputs are streamed hands each
step's token to its consumer through ``emit.nowait`` while the consumer waits, as a vllm
replica does, so a step costs the loop what a real engine's output costs it.

Use it where an engine's shape matters (slots, a queue for them, steps that take time):
tests of scheduling, backpressure and cancellation under
``trio.testing.MockClock(autojump_threshold=0)``, where every step takes no real time, and
benchmarks of what the orchestrator costs engines that share its loop
(``benchmarks/bench_orchestrator.py``). For scripted outputs, failures, hangs and crashes,
use the ``scripted`` backend.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import outcome
import trio
from msgspec import Meta

from ..backends.scripted import input_tokens
from ..config.options import parse_options
from ..config.stage import StageConfig
from ..outputs import StageOutput
from ..stages.backend import StageBackend
from ..stages.emit import Emit, EmitNowait, nowait_of
from ..stages.input_stream import InputStream

__all__ = [
    "FakeEngine",
    "FakeEngineBackend",
    "FakeEngineOptions",
    "FakeEngineStatistics",
    "FakeRequest",
]


class FakeEngineOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A fake engine stage's ``options:`` (checked when the config is loaded)."""

    slots: Annotated[int, Meta(ge=1, description="requests the engine runs at once")] = 8
    step_s: Annotated[
        float, Meta(ge=0, description="trio-clock seconds one step takes (one token each)")
    ] = 0.002
    tokens: Annotated[int, Meta(ge=1, description="tokens per request")] = 16


@dataclass(frozen=True, slots=True)
class FakeEngineStatistics:
    """A snapshot of a :class:`FakeEngine`: its slots, the requests running in them and
    those waiting for one (cancelled ones left out of both, though a cancelled request
    keeps its slot until the step under way ends), and the steps taken so far."""

    slots: int
    running: int
    waiting: int
    steps: int


class FakeRequest:
    """One request inside a :class:`FakeEngine` (what :meth:`FakeEngine.add` returns): its
    tokens not yet received, and the task waiting for them.

    ``fast`` is the request's fast path (a stage's ``emit.nowait``): while the reader waits
    with nothing pending, a step hands it an unfinished output directly instead of waking
    the reader, as a vllm replica's demultiplexer does.
    """

    __slots__ = (
        "cancelled",
        "done",
        "fast",
        "final_only",
        "index",
        "pending",
        "prompt",
        "tokens",
        "waiter",
    )

    def __init__(
        self, prompt: list[int], tokens: int, final_only: bool, fast: EmitNowait | None
    ) -> None:
        self.prompt = prompt or [0]
        self.tokens = tokens
        self.index = 0
        self.final_only = final_only
        self.fast = fast
        self.pending: list[int] = []
        self.done = False
        self.cancelled = False
        self.waiter: trio.lowlevel.Task | None = None

    def _step(self) -> None:
        # one token per engine step; a final-only request wakes its reader at the end only
        token = self.prompt[self.index % len(self.prompt)] + 1
        self.index += 1
        self.done = self.index == self.tokens
        waiter = self.waiter
        if waiter is not None and not self.done and not self.final_only:
            fast = self.fast
            if fast is not None and fast(StageOutput(token_ids=(token,))):
                return
        self.pending.append(token)
        if (self.done or not self.final_only) and waiter is not None:
            self.waiter = None
            trio.lowlevel.reschedule(waiter)

    async def receive(self) -> tuple[tuple[int, ...], bool]:
        """The tokens produced since the last call (all of them at once for a
        ``final_only`` request) and whether the request finished. Waits only when nothing
        is pending, like vLLM's output collector. Always checkpoints. Cancelling it leaves
        the request running (pending tokens stay) and turns its fast path off.

        Raises :class:`trio.EndOfChannel` once the finished tokens were received, and
        :class:`trio.ClosedResourceError` once the request was cancelled and nothing is
        pending (also in a task waiting here when :meth:`cancel` is called).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while not self.pending or (self.final_only and not self.done):
            if self.cancelled:
                raise trio.ClosedResourceError("the fake engine request was cancelled")
            if self.done:
                raise trio.EndOfChannel("the fake engine request finished: nothing more comes")
            self.waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
            waited = True
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()
        delta, self.pending = tuple(self.pending), []
        return delta, self.done

    def _abort_wait(self, _: Any) -> trio.lowlevel.Abort:
        # a cancelled reader: nothing takes the fast path any more
        self.waiter = None
        self.fast = None
        return trio.lowlevel.Abort.SUCCEEDED

    def cancel(self) -> None:
        """Take the request out of its engine (an abort): a waiting request never runs, a
        running one leaves its slot when the step under way ends; it gets no more tokens.
        A task waiting in :meth:`receive` gets :class:`trio.ClosedResourceError`. Does
        nothing to a finished request. Synchronous."""
        self.fast = None
        if self.done or self.cancelled:
            return
        self.cancelled = True
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            error = trio.ClosedResourceError("the fake engine request was cancelled")
            trio.lowlevel.reschedule(waiter, outcome.Error(error))

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled else "done" if self.done else "running"
        return (
            f"<FakeRequest {state} tokens={self.index}/{self.tokens} "
            f"pending={len(self.pending)} final_only={self.final_only}>"
        )


class FakeEngine:
    """A batching engine with fixed-time steps on the trio clock (see the module docstring):
    ``slots`` requests at once, one step of ``step_s`` seconds gives one token to each,
    ``tokens`` tokens per request. Nothing happens until :meth:`serve` runs. Raises
    :class:`ValueError` for a negative ``step_s`` or fewer than one slot or token."""

    def __init__(self, slots: int = 8, step_s: float = 0.002, tokens: int = 16) -> None:
        if slots < 1 or tokens < 1 or step_s < 0:
            raise ValueError(
                "a fake engine needs slots >= 1, tokens >= 1 and step_s >= 0, got "
                f"slots={slots}, tokens={tokens}, step_s={step_s}"
            )
        self.slots = slots
        self.step_s = step_s
        self.tokens = tokens
        self._waiting: deque[FakeRequest] = deque()
        self._active: list[FakeRequest] = []
        self._work = trio.lowlevel.ParkingLot()
        #: steps taken so far
        self.steps = 0

    def add(
        self, prompt: list[int], *, final_only: bool = False, fast: EmitNowait | None = None
    ) -> FakeRequest:
        """Queue a request for a slot; read its tokens with :meth:`FakeRequest.receive`.
        ``final_only``: its reader wakes once, with every token, when it finishes. ``fast``:
        see :class:`FakeRequest`. Synchronous."""
        request = FakeRequest(prompt, self.tokens, final_only, fast)
        self._waiting.append(request)
        if self._work:
            self._work.unpark()
        return request

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the engine until cancelled: fill free slots from the queue, then take a step
        of ``step_s`` trio-clock seconds (sleeping while no request runs). Reports started
        at once."""
        task_status.started()
        while True:
            while self._waiting and len(self._active) < self.slots:
                request = self._waiting.popleft()
                if not request.cancelled:
                    self._active.append(request)
            if not self._active:
                await self._work.park()
                continue
            await trio.sleep(self.step_s)
            self.steps += 1
            for request in self._active:
                if not request.cancelled:
                    request._step()
            self._active = [r for r in self._active if not (r.done or r.cancelled)]

    def statistics(self) -> FakeEngineStatistics:
        """A frozen snapshot (see :class:`FakeEngineStatistics`). Synchronous."""
        return FakeEngineStatistics(
            slots=self.slots,
            running=sum(not r.cancelled for r in self._active),
            waiting=sum(not r.cancelled for r in self._waiting),
            steps=self.steps,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<FakeEngine slots={s.running}/{s.slots} waiting={s.waiting} steps={s.steps} "
            f"step_s={self.step_s} tokens={self.tokens}>"
        )


class FakeEngineBackend(StageBackend):
    """A stage replica that drives one :class:`FakeEngine` (see the module docstring). Its
    options are :class:`FakeEngineOptions`; ``engine`` is its engine.

    A request's input (token ids, or a text prompt's UTF-8 bytes) is its prompt; it enters
    the engine once the whole input has arrived. Its outputs carry the tokens of each step
    (the finished one with ``finish_reason="length"``), or one finished output with every
    token when nobody streams the stage. Cancelling a request (an abort) cancels it in the
    engine. Subclasses may override :meth:`_on_input` and :meth:`_on_finished` (a
    benchmark's timestamps)."""

    backend_name = "fake-engine"
    Options = FakeEngineOptions

    def __init__(self, config: StageConfig, *, stage_index: int, replica: int = 0) -> None:
        super().__init__(config, stage_index=stage_index, replica=replica)
        self.options: FakeEngineOptions = parse_options(
            FakeEngineOptions,
            config.options,
            where=f"$.stages[{stage_index}].options",
            backend=self.backend_name,
        )
        self.engine = FakeEngine(self.options.slots, self.options.step_s, self.options.tokens)

    async def _start(self) -> None:
        await trio.lowlevel.checkpoint()

    async def _serve_forever(self) -> None:
        await self.engine.serve()

    def _on_input(self, request_id: str) -> None:
        """Called once a request's whole input arrived, before it enters the engine: a hook
        for subclasses, which does nothing here. Synchronous."""

    def _on_finished(self, request_id: str) -> None:
        """Called once a request's last tokens are in, before its finished output goes
        out: a hook for subclasses, which does nothing here. Synchronous."""

    async def _run(
        self, request_id: str, inputs: InputStream, sampling_params: Any, emit: Emit
    ) -> None:
        prompt: list[int] = []
        async for chunk in inputs:
            prompt.extend(input_tokens(chunk))
            if chunk.final:
                break
        self._on_input(request_id)
        streamed = self.outputs_streamed(request_id)
        request = self.engine.add(prompt, final_only=not streamed, fast=nowait_of(emit))
        try:
            while True:
                delta, done = await request.receive()
                if done:
                    self._on_finished(request_id)
                    await emit(StageOutput(token_ids=delta, finished=True, finish_reason="length"))
                    return
                await emit(StageOutput(token_ids=delta))
        finally:
            request.cancel()
