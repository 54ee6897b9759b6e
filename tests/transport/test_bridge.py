"""The thread bridge's ends: order across threads and loops, the credit window, the
non-blocking calls, cancelled waits, typed items, closing before use. Real threads, each
running its own ``trio.run`` (test_bridge_core.py: wake-ups on close, lost loops, binding).

Tests that wait on another thread use the real clock and ``trio.fail_after``, so a
regression fails in seconds instead of hanging. Another thread's loop signals this one with
``TrioToken.run_sync_soon`` (not through a bridge, so a broken bridge cannot hide itself),
and "the task is now blocked" is observed with ``wait_all_tasks_blocked`` on its own loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import trio
import trio.testing

from omni_trio.transport import BridgeReceiver, BridgeSender, BridgeStatistics, open_bridge

GUARD_S = 10


async def in_thread(fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``trio.run(fn)`` in a worker thread; abandoned on cancel, so fail_after works."""
    return await trio.to_thread.run_sync(trio.run, fn, abandon_on_cancel=True)


def signal() -> tuple[trio.Event, Callable[[], None]]:
    """An Event of this loop and a function any thread can call to set it."""
    event = trio.Event()
    token = trio.lowlevel.current_trio_token()
    return event, lambda: token.run_sync_soon(event.set)


def assert_drained(stats: BridgeStatistics, n: int) -> None:
    assert stats.items_in_flight == 0
    assert stats.items_sent == stats.items_received == n
    assert stats.credits_available == stats.max_buffer
    assert stats.tasks_waiting_send == stats.tasks_waiting_receive == 0


async def test_order_preserved_thread_to_loop() -> None:
    tx: BridgeSender[int]
    rx: BridgeReceiver[int]
    tx, rx = open_bridge(16, name="order")

    async def produce() -> None:
        async with tx:
            for i in range(10_000):
                await tx.send(i)

    got: list[int] = []
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_thread, produce)
            async for item in rx:
                got.append(item)
    assert got == list(range(10_000))
    stats = rx.statistics()
    assert_drained(stats, 10_000)
    assert stats.sender_closed and not stats.receiver_closed


async def test_order_preserved_loop_to_thread() -> None:
    tx: BridgeSender[int]
    rx: BridgeReceiver[int]
    tx, rx = open_bridge(8)

    async def consume() -> list[int]:
        return [item async for item in rx]

    async def produce() -> None:
        with tx:
            for i in range(10_000):
                await tx.send(i)

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            got = await in_thread(consume)
    assert got == list(range(10_000))
    assert_drained(tx.statistics(), 10_000)


async def test_backpressure_blocks_exactly_at_max_buffer() -> None:
    tx: BridgeSender[int]
    rx: BridgeReceiver[int]
    tx, rx = open_bridge(8, name="bp")
    blocked, fire = signal()

    async def produce() -> tuple[int, BridgeStatistics]:
        sent = 0

        async def pump() -> None:
            nonlocal sent
            with tx:
                for i in range(20):
                    await tx.send(i)
                    sent += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump)
            await trio.testing.wait_all_tasks_blocked()
            snapshot = (sent, tx.statistics())
            fire()
        return snapshot

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            result: list[tuple[int, BridgeStatistics]] = []

            async def run_producer() -> None:
                result.append(await in_thread(produce))

            nursery.start_soon(run_producer)
            await blocked.wait()
            # Nothing was read yet: the producer is parked with exactly max_buffer unread.
            seen_here = rx.statistics()
            got = [item async for item in rx]
    sent_when_blocked, seen_there = result[0]
    assert sent_when_blocked == 8
    for stats in (seen_here, seen_there):
        assert stats.items_in_flight == 8
        assert stats.credits_available == 0
        assert stats.tasks_waiting_send == 1
    assert got == list(range(20))
    assert_drained(rx.statistics(), 20)


async def test_close_before_other_side_was_ever_used() -> None:
    tx, rx = open_bridge(2)
    rx.close()
    with pytest.raises(anyio.BrokenResourceError, match="receiver was closed"):
        tx.send_nowait(1)
    with pytest.raises(anyio.BrokenResourceError):
        await tx.send(1)

    tx2, rx2 = open_bridge(2)
    tx2.close()
    with pytest.raises(anyio.EndOfStream):
        rx2.receive_nowait()
    with pytest.raises(anyio.EndOfStream):
        await rx2.receive()

    tx3, rx3 = open_bridge(2)
    await tx3.aclose()
    await rx3.aclose()
    with pytest.raises(anyio.ClosedResourceError):
        await tx3.send(1)
    with pytest.raises(anyio.ClosedResourceError):
        rx3.receive_nowait()


async def test_nowait_would_block() -> None:
    tx, rx = open_bridge(3)
    with pytest.raises(anyio.WouldBlock):
        rx.receive_nowait()
    for i in range(3):
        tx.send_nowait(i)
    with pytest.raises(anyio.WouldBlock):
        tx.send_nowait(3)
    stats = tx.statistics()
    assert stats.items_in_flight == 3 and stats.credits_available == 0
    assert [rx.receive_nowait() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(anyio.WouldBlock):
        rx.receive_nowait()
    assert_drained(rx.statistics(), 3)


async def test_same_loop_stream_with_backpressure() -> None:
    tx: BridgeSender[int]
    rx: BridgeReceiver[int]
    tx, rx = open_bridge(3, name="same-loop")

    async def produce() -> None:
        async with tx:
            for i in range(1_000):
                await tx.send(i)

    got: list[int] = []
    full_snapshots: list[BridgeStatistics] = []
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            while True:
                if len(got) % 100 == 0 and len(got) < 900:
                    # Let the producer run until it can go no further: the window is full.
                    await trio.testing.wait_all_tasks_blocked()
                    full_snapshots.append(rx.statistics())
                try:
                    got.append(await rx.receive())
                except anyio.EndOfStream:
                    break
    assert got == list(range(1_000))
    assert len(full_snapshots) == 9
    for stats in full_snapshots:
        assert (stats.items_in_flight, stats.tasks_waiting_send) == (3, 1)
    assert_drained(rx.statistics(), 1_000)


async def test_cancelled_waits_leave_no_trace() -> None:
    tx, rx = open_bridge(1)
    tx.send_nowait("kept")
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tx.send, "never")
            await trio.testing.wait_all_tasks_blocked()
            assert tx.statistics().tasks_waiting_send == 1
            scope.cancel()
    stats = tx.statistics()
    assert stats.tasks_waiting_send == 0 and stats.items_sent == 1
    assert await rx.receive() == "kept"

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rx.receive)
            await trio.testing.wait_all_tasks_blocked()
            assert rx.statistics().tasks_waiting_receive == 1
            scope.cancel()
    assert_drained(rx.statistics(), 1)
    # A cancelled send() sends nothing, even when there is credit.
    with trio.CancelScope() as scope:
        scope.cancel()
        await tx.send("cancelled")
    assert tx.statistics().items_sent == 1


async def test_repr_shows_live_state() -> None:
    tx, rx = open_bridge(4, name="shown")
    assert repr(tx).startswith("<BridgeSender 'shown' open unbound in_flight=0/4")
    tx.send_nowait(1)
    tx.send_nowait(2)
    assert "in_flight=2/4 sent=2 received=0" in repr(rx)
    tx.close()
    assert "peer=closed" in repr(rx)
    assert repr(tx).startswith("<BridgeSender 'shown' closed")


async def test_typed_bridge_carries_none_as_an_item() -> None:
    tx, rx = open_bridge[int | None](2, name="typed")
    assert isinstance(tx, BridgeSender) and isinstance(rx, BridgeReceiver)
    tx.send_nowait(None)
    tx.send_nowait(3)
    assert rx.receive_nowait() is None
    assert await rx.receive() == 3
    with pytest.raises(anyio.WouldBlock):
        rx.receive_nowait()
    tx.close()
    with pytest.raises(anyio.EndOfStream):
        await rx.receive()


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "8"])
def test_max_buffer_must_be_positive_int(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_buffer must be a positive int"):
        open_bridge(bad)


async def test_worker_thread_with_trio_asyncio_loop_streams_into_this_loop() -> None:
    """The vLLM backend's shape: a worker thread runs trio.run + trio_asyncio.open_loop(),
    an asyncio async generator produces, and its trio side sends over the bridge."""
    import asyncio

    trio_asyncio = pytest.importorskip("trio_asyncio")
    tx: BridgeSender[int]
    rx: BridgeReceiver[int]
    tx, rx = open_bridge(4, name="aio-worker")

    async def asyncio_outputs() -> Any:
        for i in range(200):
            await asyncio.sleep(0)
            yield i

    async def worker() -> None:
        async with trio_asyncio.open_loop():
            with tx:
                async for item in trio_asyncio.aio_as_trio(asyncio_outputs()):
                    await tx.send(item)

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_thread, worker)
            got = [item async for item in rx]
    assert got == list(range(200))
    assert_drained(rx.statistics(), 200)
