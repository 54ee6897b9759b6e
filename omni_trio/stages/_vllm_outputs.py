"""The worker side of a vllm replica's outputs: one batch per engine step, credit per request.

vLLM's output handler (an asyncio task of the AsyncLLM) puts each request's output of an
engine step into that request's collector. :class:`StepOutputs` watches the collectors: a
put marks its request, and one loop callback (:meth:`StepOutputs.flush`), which runs after
the handler finished the step (it only yields between steps), takes the output of every
marked request that has credit in its :class:`~._vllm_protocol.Flow` and sends them all as
one batch on the replica's output bridge: one item and at most one wake-up of the
orchestrator's loop per engine step, whatever the number of requests. No task per request
wakes per output. A request without credit stays in vLLM's collector, which merges its
DELTA outputs, until the backend resumes it (:meth:`StepOutputs.mark` again).

Everything here runs on the worker's asyncio loop, in its thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import outcome

from ..outputs import StageOutput
from ..transport.bridge import BridgeSender
from ._vllm_protocol import Batch, End, Flow, engine_died, to_stage_output

__all__ = ["LiveRequest", "StepOutputs"]


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
