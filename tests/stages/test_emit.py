"""The emit contract's fast path (stages/_emit.py) and the replica's recording emitter
(RunningRequest.emitter): what ``nowait`` delivers, records and refuses."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from omni_trio.errors import StageError
from omni_trio.outputs import StageOutput
from omni_trio.stages._running import RunningRequest
from omni_trio.stages.emit import Emitter, never, nowait_of
from omni_trio.transport.queue import OutputQueue


def out(i: int, finished: bool = False) -> StageOutput:
    return StageOutput(token_ids=(i,), finished=finished)


def queue_emitter(queue: OutputQueue[StageOutput]) -> Emitter:
    """A consumer behind a window, as the orchestrator gives one to a backend."""

    async def emit(o: StageOutput) -> None:
        await queue.send(o)

    def emit_nowait(o: StageOutput) -> bool:
        try:
            queue.send_nowait(o)
        except (trio.WouldBlock, trio.BrokenResourceError):
            return False
        return True

    return Emitter(emit, emit_nowait)


async def test_an_emitter_awaits_its_emit_and_plain_emits_have_no_fast_path():
    got: list[StageOutput] = []

    async def emit(o: StageOutput) -> None:
        got.append(o)

    plain = Emitter(emit)
    await plain(out(1))
    assert got == [out(1)] and plain.nowait(out(2)) is False and got == [out(1)]
    assert nowait_of(emit) is None and nowait_of(plain) is None and never(out(3)) is False
    fast = Emitter(emit, lambda o: True)
    assert nowait_of(fast) is fast.nowait and fast.nowait(out(3))
    assert "Emitter" in repr(plain)


async def test_recording_emitter_fast_and_slow_outputs_keep_one_order():
    queue: OutputQueue[StageOutput] = OutputQueue(2)
    running = RunningRequest("r", "s", "s[0]")
    emit = running.emitter(queue_emitter(queue))
    assert emit.nowait(out(0)) and emit.nowait(out(1))
    # the window is full: refused, nothing delivered, the awaited emit waits for room
    assert not emit.nowait(out(2)) and len(queue) == 2
    async with trio.open_nursery() as nursery:
        nursery.start_soon(emit, out(2))
        await trio.testing.wait_all_tasks_blocked()
        assert len(queue) == 2  # backpressure: still waiting
        assert await queue.receive() == out(0)
    assert emit.nowait(out(3, finished=True)) is False  # full again
    assert await queue.receive() == out(1)
    assert emit.nowait(out(3, finished=True)) and running.finished
    assert [await queue.receive() for _ in range(2)] == [out(2), out(3, finished=True)]


async def test_recording_emitter_refuses_after_finished_cancel_or_a_refusal():
    queue: OutputQueue[StageOutput] = OutputQueue(8)
    running = RunningRequest("r", "s", "s[0]")
    emit = running.emitter(queue_emitter(queue))
    assert emit.nowait(out(0, finished=True))
    # after the finished output the fast path refuses; the awaited emit raises the violation
    assert emit.nowait(out(1)) is False and len(queue) == 1
    with pytest.raises(StageError, match="after its finished output"):
        await emit(out(1))
    assert running.violation is not None

    # once the request is cancelled (abort, replica death), nothing more is delivered
    cancelled = RunningRequest("c", "s", "s[0]")
    emit = cancelled.emitter(queue_emitter(queue))
    cancelled.cancel()
    assert cancelled.scope.cancel_called and emit.nowait(out(2)) is False
    assert not cancelled.finished and len(queue) == 1

    # the consumer gone: refused, nothing recorded (the awaited emit reports it)
    gone = RunningRequest("g", "s", "s[0]")
    emit = gone.emitter(queue_emitter(queue))
    queue.close_receiver()
    assert emit.nowait(out(3)) is False and not gone.finished

    # an emit without a fast path: the recording emitter has none either
    async def plain(o: StageOutput) -> None:
        pass

    assert RunningRequest("p", "s", "s[0]").emitter(plain).nowait(out(4)) is False
