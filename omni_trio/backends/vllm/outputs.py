"""A vllm replica's outputs: one batch per engine step, credit and an inbox per request.

**Worker side.**

vLLM's output handler (an asyncio task of the AsyncLLM) puts each request's output of an
engine step into that request's collector. :class:`StepOutputs` watches the collectors: a
put marks its request, and one loop callback (:meth:`StepOutputs.flush`), which runs after
the handler finished the step (it only yields between steps), takes the output of every
marked request that has credit in its :class:`~._vllm_protocol.Flow` and sends them all as
one batch on the replica's output bridge: one item and at most one wake-up of the
orchestrator's loop per engine step, whatever the number of requests. No task per request
wakes per output. A request without credit stays in vLLM's collector, which merges its
DELTA outputs, until the backend resumes it (:meth:`StepOutputs.mark` again).

:class:`StepOutputs` and :class:`LiveRequest` run on the worker's asyncio loop, in its thread.

**Backend side.** On the orchestrator's trio loop the replica's demultiplexer hands each
item of a batch to its request's :class:`RequestInbox`, from the output bridge's wake-up
callback (:meth:`~omni_trio.transport.bridge.BridgeReceiver.consume`: no task switch
between the worker's wake-up and the inboxes). While the request's task waits there
with nothing left to deliver, an output is handed straight on through the request's
``emit.nowait`` (:mod:`~omni_trio.stages.emit`): into the consumer's window, without waking
the request's task, so an output costs one task switch (the consumer's), not two.
Everything else (an output the fast path refuses, the finished output, a failure, END,
anything that comes while the task is busy delivering or is being cancelled) is queued for
the task, in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import outcome
import trio

from ...outputs import StageOutput
from ...stages.emit import Emit, EmitNowait
from ...transport.bridge import BridgeSender
from .protocol import Batch, End, Flow, engine_died, to_stage_output

__all__ = ["Item", "LiveRequest", "RequestInbox", "StepOutputs"]

#: a request's items on the backend side: outputs, its failure, END
Item = StageOutput | outcome.Error | End


class LiveRequest:
    """A request in the engine, as the worker tracks it: its flow control, vLLM's output
    collector for it (once added), and whether its last output was taken."""

    __slots__ = ("collector", "done", "finished", "flow")

    def __init__(self, flow: Flow) -> None:
        self.flow = flow
        self.collector: Any = None  # vLLM's RequestOutputCollector
        self.done = asyncio.Event()  # set when the request finished or failed
        self.finished = False

    def take(self, name: str, engine_dead: type[BaseException]) -> StageOutput | outcome.Error:
        """The collector's output as a StageOutput, or the failure it holds (vLLM puts an
        exception into every collector when its engine dies); sets ``done`` on the last
        output or a failure. Only called when the collector holds something."""
        try:
            ro = self.collector.get_nowait()
        except engine_dead as exc:
            self.done.set()
            return engine_died(name, exc)
        except Exception as exc:
            self.done.set()
            return outcome.Error(exc)
        if ro.finished:
            self.finished = True
            self.done.set()
        return to_stage_output(ro)


class StepOutputs:
    """The live requests of one engine and the flush of their outputs (module docstring)."""

    def __init__(
        self,
        name: str,
        loop: asyncio.AbstractEventLoop,
        out: BridgeSender[Batch],
        engine_dead: type[BaseException],
    ) -> None:
        self._name = name
        self._loop = loop
        self._out = out
        self._engine_dead = engine_dead
        self._live: dict[str, LiveRequest] = {}
        self._dirty: dict[str, None] = {}  # requests with output to take (an ordered set)
        self._pending: Batch = []
        self._scheduled = False

    def add(self, request_id: str, flow: Flow) -> LiveRequest:
        live = LiveRequest(flow)
        self._live[request_id] = live
        return live

    def watch(self, request_id: str, collector: Any) -> None:
        """Watch vLLM's collector of a request: each ``put`` (an engine step's output, or an
        error) marks the request for the next flush."""
        live = self._live[request_id]
        put: Callable[[Any], None] = collector.put
        mark = self.mark

        def put_and_mark(output: Any) -> None:
            put(output)
            mark(request_id)

        collector.put = put_and_mark
        live.collector = collector
        if collector.output is not None:
            mark(request_id)

    def remove(self, request_id: str) -> None:
        """Stop taking the request's outputs (vLLM's own "abort" output included)."""
        del self._live[request_id]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def mark(self, request_id: str) -> None:
        """The request has output to take (or resumed): take it in the next flush."""
        self._dirty[request_id] = None
        self._schedule()

    def post(self, request_id: str, item: outcome.Error | End) -> None:
        """Send ``item`` (a failure or END) after the request's outputs, in the next flush."""
        self._pending.append((request_id, item))
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            # a loop callback: it runs after vLLM's output handler has put every output of
            # the engine step it is processing
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send every marked request's output that has credit, as one batch. Synchronous."""
        self._scheduled = False
        dirty, self._dirty = self._dirty, {}
        for rid in dirty:
            live = self._live.get(rid)
            if live is None or live.collector is None or live.collector.output is None:
                continue
            if live.flow.reserve():
                self._pending.append((rid, live.take(self._name, self._engine_dead)))
        if self._pending:
            batch, self._pending = self._pending, []
            try:
                self._out.send_nowait(batch)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the backend is gone; its requests are being cancelled with it

    def __repr__(self) -> str:
        return (
            f"<StepOutputs {self._name} live={len(self._live)} marked={len(self._dirty)} "
            f"pending={len(self._pending)}>"
        )


class RequestInbox:
    """One request's items on the backend side (the module docstring's backend side).

    The demultiplexer calls :meth:`put`, the request's task :meth:`receive`. ``fast`` is the
    request's ``emit.nowait`` (``None``: no fast path); the task sets it to ``None`` before it
    drains an aborted request, so nothing is delivered from then on. ``flow`` counts each
    output taken (by the fast path here, by the task otherwise); ``resume`` tells the worker
    a stalled request has credit again.
    """

    __slots__ = ("_closed", "_items", "_waiter", "fast", "flow", "resume")

    def __init__(self, flow: Flow, resume: Callable[[], object], fast: EmitNowait | None) -> None:
        self.flow = flow
        self.resume = resume
        self.fast = fast
        self._items: list[Item] = []  # at most the flow's window of them
        # the request's task while it waits in receive(); only then is _items empty and every
        # earlier output delivered, so the fast path keeps the order
        self._waiter: trio.lowlevel.Task | None = None
        self._closed = False

    def put(self, item: Item) -> None:
        """Hand the request an item: deliver it now if it is an unfinished output, the task
        waits with nothing pending and ``fast`` takes it; else queue it and wake the task.
        Synchronous; ignored after :meth:`close`."""
        if self._closed:
            return
        waiter = self._waiter
        if waiter is not None:
            fast = self.fast
            # the finished output goes to the task, which must wake to end the request anyway
            if fast is not None and isinstance(item, StageOutput) and not item.finished:
                if fast(item):
                    if self.flow.took():
                        self.resume()
                    return
            self._waiter = None
            trio.lowlevel.reschedule(waiter)
        self._items.append(item)

    def close(self) -> None:
        """No more items: :meth:`receive` raises ``EndOfChannel`` once the queued ones are
        taken. Synchronous, idempotent."""
        self._closed = True
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            trio.lowlevel.reschedule(waiter)

    async def receive(self) -> Item:
        """The next item, in order. Always checkpoints; cancelled, no item is taken. Raises
        ``trio.EndOfChannel`` after :meth:`close` once every queued item was taken."""
        items = self._items
        if items:
            # the usual slow-path case, an item is queued: one checkpoint, then take it
            await trio.lowlevel.checkpoint()
            if items:
                return items.pop(0)
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while not items:
            if self._closed:
                if not waited:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                raise trio.EndOfChannel
            self._waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
            waited = True
        item = items.pop(0)
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return item

    async def deliver(self, emit: Emit) -> outcome.Error | End | None:
        """Take the request's items in order and deliver each output through ``emit`` (the
        awaited one: this is the slow path), counting its credit, until the finished output
        (returns ``None``) or an item that is not an output (returns it: END, or the
        request's failure). Checkpoints at every item. Raises ``trio.EndOfChannel`` if the
        inbox closed first (the worker's output side ended)."""
        while True:
            item = await self.receive()
            if not isinstance(item, StageOutput):
                return item
            if self.flow.took():
                self.resume()
            await emit(item)
            if item.finished:
                return None

    def _abort_wait(self, _: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        # a cancellation reached the waiting task: from now on nothing takes the fast path
        # (called synchronously by trio, before any other task runs)
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "waiting" if self._waiter else "busy"
        fast = "" if self.fast is None else " fast"
        return f"<RequestInbox {state}{fast} queued={len(self._items)} {self.flow!r}>"
