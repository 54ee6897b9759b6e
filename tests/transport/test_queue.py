"""OutputQueue: a window for ordinary items, final items that never wait, no polling."""

import pytest
import trio
import trio.testing

from omni_trio.transport.queue import OutputQueue


async def test_window_backpressure_and_order(autojump_clock):
    q: OutputQueue[int] = OutputQueue(2)
    await q.send(1)
    await q.send(2)
    with trio.move_on_after(5) as scope:
        await q.send(3)  # the window is full: waits
    assert scope.cancelled_caught
    assert q.statistics().items == 2  # the cancelled send left nothing behind
    async with trio.open_nursery() as nursery:
        nursery.start_soon(q.send, 3)
        await trio.testing.wait_all_tasks_blocked()
        assert q.statistics().senders_waiting == 1
        assert await q.receive() == 1
    assert [await q.receive(), await q.receive()] == [2, 3]


async def test_final_items_pass_a_full_window_and_end_the_queue(autojump_clock):
    q: OutputQueue[str] = OutputQueue(1)
    await q.send("out")
    q.send_final_nowait("terminal-a")
    q.send_final_nowait("terminal-b")
    q.close()
    assert [await q.receive() for _ in range(3)] == ["out", "terminal-a", "terminal-b"]
    with pytest.raises(trio.EndOfChannel):
        await q.receive()
    with pytest.raises(trio.ClosedResourceError):
        q.send_final_nowait("late")


async def test_receiver_leaving_breaks_waiting_senders(autojump_clock):
    q: OutputQueue[int] = OutputQueue(1)
    await q.send(1)

    async def blocked_send() -> None:
        with pytest.raises(trio.BrokenResourceError):
            await q.send(2)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(blocked_send)
        await trio.testing.wait_all_tasks_blocked()
        q.close_receiver()
    q.send_final_nowait(3)  # nobody can read it: dropped, not queued
    assert q.statistics().items == 0
    with pytest.raises(trio.ClosedResourceError):
        await q.receive()


async def test_receive_waits_for_an_item_without_polling(autojump_clock):
    q: OutputQueue[int] = OutputQueue(4)
    got = []

    async def consumer() -> None:
        got.append(await q.receive())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        assert q.statistics().receiver_waiting
        await q.send(7)
    assert got == [7]
    with pytest.raises(trio.WouldBlock):
        q.receive_nowait()


async def test_send_and_receive_always_checkpoint(autojump_clock):
    q: OutputQueue[int] = OutputQueue(4)
    with trio.testing.assert_checkpoints():
        await q.send(1)
    with trio.testing.assert_checkpoints():
        await q.receive()
    q.close()
    with trio.testing.assert_checkpoints(), pytest.raises(trio.EndOfChannel):
        await q.receive()
    # cancelled before sending: nothing is queued
    q2: OutputQueue[int] = OutputQueue(4)
    with trio.CancelScope() as cs:
        cs.cancel()
        await q2.send(2)
    assert q2.statistics().items == 0
    assert "items=0/4" in repr(q2)


async def test_send_nowait_respects_the_window(autojump_clock):
    q: OutputQueue[int] = OutputQueue(1)
    q.send_nowait(1)
    with pytest.raises(trio.WouldBlock):
        q.send_nowait(2)
    assert q.receive_nowait() == 1
    q.close_receiver()
    with pytest.raises(trio.BrokenResourceError):
        q.send_nowait(3)


async def test_a_batch_receiver_wakes_on_a_full_window_or_the_end(autojump_clock):
    q: OutputQueue[int] = OutputQueue(3)
    woke: list[int] = []

    async def batch_receiver() -> None:
        await q.wait_full()
        woke.append(q.statistics().items)
        await q.wait_full()  # the window is still full: returns at once
        woke.append(q.statistics().items)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(batch_receiver)
        await q.send(1)
        await q.send(2)
        await trio.testing.wait_all_tasks_blocked()
        assert woke == []  # two items, no wake-up yet
        await q.send(3)
    assert woke == [3, 3]
    q2: OutputQueue[int] = OutputQueue(3)
    await q2.send(1)
    q2.close()
    with trio.testing.assert_checkpoints():
        await q2.wait_full()  # closed: returns at once, still a checkpoint


async def test_one_receiver_at_a_time():
    q: OutputQueue[int] = OutputQueue(2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(q.receive)
        await trio.testing.wait_all_tasks_blocked()
        assert q.statistics().receiver_waiting
        with pytest.raises(trio.BusyResourceError):
            await q.receive()
        q.send_nowait(1)  # the waiting receiver takes it
    assert not q.statistics().receiver_waiting and q.statistics().items == 0
