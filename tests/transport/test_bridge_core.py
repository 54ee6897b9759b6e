"""The bridge's shared state across loops (``_bridge_core``): closing an end wakes the
waiters on either end, whichever thread closes it; an end whose loop finishes while it is
open breaks the bridge; an end binds to the loop that first uses it, and an end in a thread
without a trio loop is left unbound (non-blocking calls only).

Real threads, each running its own ``trio.run``; see test_bridge.py for how the tests wait.
"""

from __future__ import annotations

import threading

import anyio
import pytest
import trio
import trio.testing

from omni_trio.transport import BridgeReceiver, BridgeSender, open_bridge

from .test_bridge import GUARD_S, assert_drained, in_thread, signal


async def test_receiver_close_wakes_sender_blocked_in_another_thread() -> None:
    tx, rx = open_bridge(4, name="rx-close")
    blocked, fire = signal()

    async def produce() -> str:
        async with trio.open_nursery() as nursery:
            outcome: list[str] = []

            async def pump() -> None:
                try:
                    for i in range(100):
                        await tx.send(i)
                except anyio.BrokenResourceError:
                    outcome.append("broken")

            nursery.start_soon(pump)
            await trio.testing.wait_all_tasks_blocked()
            fire()
        return outcome[0]

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            result: list[str] = []

            async def run_producer() -> None:
                result.append(await in_thread(produce))

            nursery.start_soon(run_producer)
            await blocked.wait()
            assert rx.statistics().tasks_waiting_send == 1
            rx.close()
    assert result == ["broken"]
    stats = rx.statistics()
    assert stats.receiver_closed
    assert stats.items_in_flight == 0 and stats.items_discarded == 4
    assert stats.tasks_waiting_send == 0
    with pytest.raises(anyio.ClosedResourceError):
        await rx.receive()


@pytest.mark.parametrize("n_items", [0, 3])
async def test_sender_close_wakes_consumer_after_draining(n_items: int) -> None:
    tx: BridgeSender[int]
    rx: BridgeReceiver[int]
    tx, rx = open_bridge(4, name="tx-close")
    blocked, fire = signal()

    async def consume() -> tuple[list[int], int]:
        got: list[int] = []

        async def drain() -> None:
            async for item in rx:
                got.append(item)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            await trio.testing.wait_all_tasks_blocked()
            waiting = rx.statistics().tasks_waiting_receive
            fire()
        return got, waiting

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            result: list[tuple[list[int], int]] = []

            async def run_consumer() -> None:
                result.append(await in_thread(consume))

            nursery.start_soon(run_consumer)
            await blocked.wait()
            # Send and close without a checkpoint between: the consumer must still get all.
            for i in range(n_items):
                tx.send_nowait(i)
            tx.close()
    got, waiting = result[0]
    assert waiting == 1
    assert got == list(range(n_items))
    assert_drained(rx.statistics(), n_items)
    with pytest.raises(anyio.ClosedResourceError):
        tx.send_nowait(3)


async def test_close_from_foreign_thread_wakes_that_ends_own_waiters() -> None:
    tx, rx = open_bridge(1, name="foreign-close")
    blocked, fire = signal()

    async def produce() -> str:
        await tx.send(0)
        async with trio.open_nursery() as nursery:
            outcome: list[str] = []

            async def pump() -> None:
                try:
                    await tx.send(1)
                except anyio.ClosedResourceError:
                    outcome.append("closed")

            nursery.start_soon(pump)
            await trio.testing.wait_all_tasks_blocked()
            fire()
        return outcome[0]

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            result: list[str] = []

            async def run_producer() -> None:
                result.append(await in_thread(produce))

            nursery.start_soon(run_producer)
            await blocked.wait()
            tx.close()  # from this loop, while the sender's own loop has a task parked
    assert result == ["closed"]
    assert await rx.receive() == 0
    with pytest.raises(anyio.EndOfStream):
        await rx.receive()


async def test_receiver_loop_exit_breaks_blocked_sender() -> None:
    tx, rx = open_bridge(8, name="rx-lost")
    for i in range(8):
        tx.send_nowait(i)

    async def receive_one_and_leave() -> int:
        # Reads one item (one credit back: below the batch that would wake the sender),
        # then the loop ends without closing the receiver.
        item: int = rx.receive_nowait()
        return item

    outcome: list[str] = []

    async def blocked_send() -> None:
        try:
            await tx.send(99)
        except anyio.BrokenResourceError as exc:
            outcome.append(str(exc))

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(blocked_send)
            await trio.testing.wait_all_tasks_blocked()
            assert tx.statistics().tasks_waiting_send == 1
            assert await in_thread(receive_one_and_leave) == 0
    assert outcome == ["bridge 'rx-lost': the receiver's loop has finished"]
    stats = tx.statistics()
    assert stats.receiver_closed and not stats.sender_closed
    assert stats.items_in_flight == 0 and stats.tasks_waiting_send == 0
    assert "lost" in repr(rx)
    tx.close()
    rx.close()  # its loop is gone: closing again is a no-op, not an error


async def test_sender_loop_exit_breaks_consumer_after_draining() -> None:
    tx, rx = open_bridge(8, name="tx-lost")

    async def send_two_and_leave() -> None:
        await tx.send("a")
        await tx.send("b")

    with trio.fail_after(GUARD_S):
        await in_thread(send_two_and_leave)
        assert await rx.receive() == "a"
        assert rx.receive_nowait() == "b"
        with pytest.raises(anyio.BrokenResourceError, match="without closing"):
            await rx.receive()
    assert rx.statistics().sender_closed
    rx.close()
    tx.close()


async def test_end_is_bound_to_the_loop_that_first_used_it() -> None:
    tx, rx = open_bridge(4)
    tx.send_nowait(1)

    async def use_elsewhere() -> str:
        try:
            tx.send_nowait(2)
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    with trio.fail_after(GUARD_S):
        message = await in_thread(use_elsewhere)
    assert "bound to another trio loop" in message
    assert tx.statistics().items_sent == 1


async def test_a_thread_without_a_trio_loop_sends_without_blocking_and_closes() -> None:
    """The vLLM worker's shape: an asyncio loop in a plain thread, which can only use the
    non-blocking calls; the trio side is woken per item and sees the end."""
    import asyncio

    tx, rx = open_bridge[int](2, name="asyncio-worker")
    outcome: list[object] = []

    def worker() -> None:
        async def main() -> None:
            tx.send_nowait(1)
            tx.send_nowait(2)
            try:
                tx.send_nowait(3)
            except anyio.WouldBlock:
                outcome.append("full")
            tx.close()

        asyncio.run(main())

    # the worker never blocks: it runs to its end before the trio side reads
    thread = threading.Thread(target=worker)
    thread.start()
    await trio.to_thread.run_sync(thread.join)
    got = [item async for item in rx]
    assert got == [1, 2] and outcome == ["full"]
    stats = rx.statistics()
    assert stats.sender_closed and stats.items_in_flight == 0
