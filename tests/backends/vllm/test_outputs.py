"""The backend side of a vllm replica's outputs (RequestInbox in stages/_vllm_outputs.py),
without an engine: the test plays the demultiplexer (``put``), the request's task runs
``deliver`` as the backend does, and the emit chain is the real one (a replica's recording
emitter over a consumer window). Checks that the fast path loses nothing, keeps the order,
respects the window and the flow credit, and stops at an abort."""

from __future__ import annotations

import outcome
import pytest
import trio
import trio.testing

from omni_trio.backends.vllm.outputs import RequestInbox
from omni_trio.backends.vllm.protocol import END, Flow
from omni_trio.outputs import StageOutput
from omni_trio.stages.emit import Emitter
from omni_trio.transport.queue import OutputQueue


def out(i: int, finished: bool = False) -> StageOutput:
    return StageOutput(token_ids=(i,), finished=finished)


class Request:
    """One request as the backend sees it: its inbox, the task running ``deliver``, the
    consumer's window behind the emit the backend is given, and the resumes sent."""

    def __init__(self, window: int, credit: int = 64) -> None:
        self.queue: OutputQueue[StageOutput] = OutputQueue(window)
        self.scope = trio.CancelScope()
        self.emit = Emitter(self._emit, self._nowait)
        self.flow = Flow(credit)
        self.resumes = 0
        self.inbox = RequestInbox(self.flow, self._resume, self.emit.nowait)
        self.result: list[object] = []
        self.fast_calls = 0
        #: what reached the consumer's window, in order (either way)
        self.delivered: list[StageOutput] = []

    async def _emit(self, o: StageOutput) -> None:
        await self.queue.send(o)
        self.delivered.append(o)

    def _nowait(self, o: StageOutput) -> bool:
        self.fast_calls += 1
        try:
            self.queue.send_nowait(o)
        except trio.WouldBlock:
            return False
        self.delivered.append(o)
        return True

    def _resume(self) -> None:
        self.resumes += 1

    async def run(self) -> None:
        with self.scope:
            self.result.append(await self.inbox.deliver(self.emit))

    def put(self, *outs: StageOutput) -> None:
        for o in outs:
            assert self.flow.reserve()  # as the worker does before it sends
            self.inbox.put(o)

    async def take(self, n: int) -> list[StageOutput]:
        return [await self.queue.receive() for _ in range(n)]


async def test_outputs_go_straight_to_the_consumer_while_the_task_waits():
    r = Request(window=8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(r.run)
        await trio.testing.wait_all_tasks_blocked()
        r.put(out(0), out(1), out(2))
        # delivered synchronously, by put itself: the request's task never woke for them
        assert len(r.queue) == 3 and len(r.inbox) == 0 and "waiting" in repr(r.inbox)
        assert r.delivered == [out(0), out(1), out(2)]
        # the finished output goes to the task, which delivers it and ends
        r.put(out(3, finished=True))
        assert len(r.queue) == 3 and len(r.inbox) == 1
    assert r.result == [None] and r.delivered[-1].finished
    assert await r.take(4) == [out(0), out(1), out(2), out(3, finished=True)]
    assert repr(r.flow) == "<Flow in_flight=0/64 stalled=False>"  # every output took its credit


async def test_a_full_window_sends_outputs_through_the_task_in_order():
    r = Request(window=1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(r.run)
        await trio.testing.wait_all_tasks_blocked()
        r.put(out(0))  # fast: the window had room
        r.put(out(1))  # refused (full): the task is woken and waits for room
        await trio.testing.wait_all_tasks_blocked()
        assert len(r.queue) == 1 and r.fast_calls == 2
        r.put(out(2))  # the task is busy: queued behind out(1), the fast path not tried
        assert r.fast_calls == 2 and len(r.inbox) == 1
        # the consumer frees the window; before the task runs, another output comes: it
        # must not overtake out(1), which the task is about to deliver
        assert await r.queue.receive() == out(0)
        r.put(out(3))
        assert len(r.queue) <= 1  # never more than the window
        got = []
        for _ in range(3):
            got.append(await r.queue.receive())
            assert len(r.queue) <= 1
        assert got == [out(1), out(2), out(3)]
        # everything delivered, the task waits again: the fast path is back
        await trio.testing.wait_all_tasks_blocked()
        r.put(out(4, finished=True))
    assert await r.take(1) == [out(4, finished=True)]
    assert r.delivered == [out(i) for i in range(4)] + [out(4, finished=True)]


async def test_fast_path_counts_credit_and_resumes_a_stalled_request():
    r = Request(window=8, credit=4)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(r.run)
        await trio.testing.wait_all_tasks_blocked()
        r.put(*(out(i) for i in range(4)))
        # every output was taken at once: the worker's credit is back, no stall
        assert "in_flight=0/4" in repr(r.flow) and r.resumes == 0
        # the consumer stops reading: the window fills, then the credit runs out
        sent = 4
        while r.flow.reserve():
            r.inbox.put(out(sent))
            sent += 1
        assert "stalled=True" in repr(r.flow) and len(r.queue) == 8
        # the consumer reads: the task delivers the backlog and, half the credit back,
        # tells the worker to resume, once
        got = []
        while len(r.queue) or len(r.inbox):
            got.append(await r.queue.receive())
            await trio.testing.wait_all_tasks_blocked()
        assert got == [out(i) for i in range(sent)]
        assert r.resumes == 1 and "stalled=False" in repr(r.flow)
        r.put(out(sent, finished=True))
    assert r.result == [None] and await r.take(1) == [out(sent, finished=True)]


async def test_abort_mid_stream_stops_the_fast_path_and_drains_to_end():
    r = Request(window=8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(r.run)
        await trio.testing.wait_all_tasks_blocked()
        r.put(out(0), out(1))
        r.scope.cancel()  # abort(): the waiting task is cancelled at once
        r.put(out(2))  # comes after the abort: never delivered, queued for the drain
        assert r.fast_calls == 2 and len(r.queue) == 2 and len(r.inbox) == 1
    assert r.scope.cancelled_caught and r.result == []
    # the drain, as the backend does it: no fast path, read up to END
    r.inbox.fast = None
    r.inbox.put(out(3))
    r.inbox.put(END)
    drained = []
    with trio.CancelScope(shield=True):
        while (item := await r.inbox.receive()) is not END:
            drained.append(item)
    assert drained == [out(2), out(3)] and r.fast_calls == 2
    assert r.delivered == [out(0), out(1)] and await r.take(2) == [out(0), out(1)]


async def test_failures_end_and_close_reach_the_task():
    r = Request(window=8)
    error = outcome.Error(RuntimeError("engine said no"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(r.run)
        await trio.testing.wait_all_tasks_blocked()
        r.put(out(0))
        r.inbox.put(error)
    assert r.result == [error] and await r.take(1) == [out(0)]

    ended = Request(window=8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ended.run)
        await trio.testing.wait_all_tasks_blocked()
        ended.inbox.put(END)
    assert ended.result == [END]

    closed = Request(window=8)
    closed.inbox.put(out(0))  # before anyone waits: queued
    closed.inbox.close()
    closed.inbox.put(out(1))  # after close: ignored
    assert await closed.inbox.receive() == out(0)
    with pytest.raises(trio.EndOfChannel):
        await closed.inbox.receive()
    assert "closed" in repr(closed.inbox)


async def test_receive_checkpoints_and_a_cancelled_receive_takes_nothing():
    inbox = RequestInbox(Flow(8), lambda: None, None)
    inbox.put(out(0))
    with trio.CancelScope() as scope:
        scope.cancel()
        await inbox.receive()
    assert scope.cancelled_caught and len(inbox) == 1
    assert await inbox.receive() == out(0)
    inbox.close()
    with trio.CancelScope() as scope:
        scope.cancel()
        await inbox.receive()  # closed and empty: still a checkpoint
    assert scope.cancelled_caught
