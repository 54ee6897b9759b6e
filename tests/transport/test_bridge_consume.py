"""``BridgeReceiver.consume``: items handed to a synchronous handler, in order, from the
wake-up callback itself (no task switch per wake-up); how it ends (the sender closes, the
handler raises, the receiver closes, the sender's loop is lost); cancellation, also one that
the handler itself causes; one consumer at a time; its checkpoints.

Cross-thread tests use real threads and the real clock under ``trio.fail_after`` (see
test_bridge.py).
"""

from __future__ import annotations

import threading
from functools import partial

import anyio
import pytest
import trio
import trio.testing

from omni_trio.transport import BridgeReceiver, BridgeSender, open_bridge

from .test_bridge import GUARD_S, assert_drained, in_thread


class _Steps(trio.abc.Instrument):
    """Counts the scheduler steps of the tasks named ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name == self.name:
            self.steps += 1


async def test_thread_to_loop_in_order_until_the_sender_closes() -> None:
    tx: BridgeSender[int]
    rx: BridgeReceiver[int]
    tx, rx = open_bridge(16, name="consume")
    got: list[int] = []
    here = threading.get_ident()
    threads: set[int] = set()

    def handler(item: int) -> None:
        threads.add(threading.get_ident())
        got.append(item)

    async def produce() -> None:
        async with tx:
            for i in range(10_000):
                await tx.send(i)

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_thread, produce)
            await rx.consume(handler)
    assert got == list(range(10_000))
    assert threads == {here}
    stats = rx.statistics()
    assert_drained(stats, 10_000)
    assert stats.sender_closed and not stats.receiver_closed


async def test_items_are_handed_on_without_waking_the_consuming_task() -> None:
    # the sender waits for each item to be handled before it sends the next one, so every
    # item needs its own wake-up; a receive() loop would step its task once per item
    tx, rx = open_bridge(4, name="no-switch")
    handled = threading.Semaphore(0)
    got: list[int] = []

    def handler(item: int) -> None:
        got.append(item)
        handled.release()

    def produce() -> None:
        with tx:
            for i in range(50):
                tx.send_nowait(i)
                assert handled.acquire(timeout=GUARD_S)

    steps = _Steps("consumer")
    trio.lowlevel.add_instrument(steps)
    try:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(rx.consume, handler, name="consumer")
                await trio.testing.wait_all_tasks_blocked()
                await trio.to_thread.run_sync(produce)
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert got == list(range(50))
    # its first step (it parks) and its last (the sender closed): none per item
    assert steps.steps == 2


async def test_buffered_items_first_then_returns_at_the_end_with_checkpoints() -> None:
    tx, rx = open_bridge(4)
    for i in range(3):
        tx.send_nowait(i)
    tx.close()
    got: list[int] = []
    with trio.testing.assert_checkpoints():
        await rx.consume(got.append)
    assert got == [0, 1, 2]
    assert_drained(rx.statistics(), 3)


async def test_the_handlers_error_is_raised_and_later_items_stay_buffered() -> None:
    tx, rx = open_bridge(8)
    failure = ValueError("item 1 is bad")

    def handler(item: int) -> None:
        if item == 1:
            raise failure

    # buffered before consume() started: handed on in its own task
    for i in range(3):
        tx.send_nowait(i)
    with trio.testing.assert_checkpoints(), pytest.raises(ValueError) as caught:
        await rx.consume(handler)
    assert caught.value is failure
    assert rx.receive_nowait() == 2

    # arriving while it waits: handed on from the wake-up callback, raised in its task
    async with trio.open_nursery() as nursery:
        errors: list[BaseException] = []

        async def consume() -> None:
            try:
                await rx.consume(handler)
            except ValueError as exc:
                errors.append(exc)

        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        for i in range(3):
            tx.send_nowait(i)
    assert errors == [failure]
    assert rx.receive_nowait() == 2
    assert rx.statistics().tasks_waiting_receive == 0


async def test_items_sent_on_the_same_loop_are_not_handled_in_the_senders_call() -> None:
    tx, rx = open_bridge(8)
    got: list[int] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rx.consume, got.append)
        await trio.testing.wait_all_tasks_blocked()
        tx.send_nowait(1)
        tx.send_nowait(2)
        assert got == []  # not inside send_nowait: from the callback, once this task yields
        await trio.testing.wait_all_tasks_blocked()
        assert got == [1, 2]
        tx.close()
    assert_drained(rx.statistics(), 2)


async def test_cancelled_while_waiting_takes_nothing_and_leaves_no_trace() -> None:
    tx, rx = open_bridge(4)
    got: list[int] = []
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rx.consume, got.append)
            await trio.testing.wait_all_tasks_blocked()
            assert rx.statistics().tasks_waiting_receive == 1
            scope.cancel()
    assert rx.statistics().tasks_waiting_receive == 0
    tx.send_nowait(7)  # no consumer is woken: the item waits in the bridge
    await trio.testing.wait_all_tasks_blocked()
    assert got == []
    # a cancellation that is already there: nothing is taken
    with trio.CancelScope() as scope:
        scope.cancel()
        await rx.consume(got.append)
    assert got == [] and rx.statistics().items_in_flight == 1
    # a later consumer gets it
    tx.close()
    await rx.consume(got.append)
    assert got == [7]


async def test_a_handler_that_cancels_its_consumer_stops_it_after_that_item() -> None:
    tx, rx = open_bridge(8)
    got: list[int] = []
    with trio.CancelScope() as scope:

        def handler(item: int) -> None:
            got.append(item)
            if item == 1:
                scope.cancel()  # reaches the waiting consumer while its handler runs

        async with trio.open_nursery() as nursery:
            nursery.start_soon(rx.consume, handler)
            await trio.testing.wait_all_tasks_blocked()
            for i in range(4):
                tx.send_nowait(i)
    assert scope.cancelled_caught
    assert got == [0, 1]
    stats = rx.statistics()
    assert stats.items_in_flight == 2 and stats.tasks_waiting_receive == 0
    assert [rx.receive_nowait(), rx.receive_nowait()] == [2, 3]


async def test_one_consumer_at_a_time() -> None:
    tx, rx = open_bridge(4)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rx.consume, print)
        await trio.testing.wait_all_tasks_blocked()
        with trio.testing.assert_checkpoints(), pytest.raises(anyio.BusyResourceError):
            await rx.consume(print)
        tx.close()
    # the first one ended: consuming again is fine (and ends at once)
    await rx.consume(print)


async def test_no_receive_while_a_consumer_runs() -> None:
    tx, rx = open_bridge(4)
    got: list[int] = []
    for item in (1, 2):
        tx.send_nowait(item)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rx.consume, got.append)
        await trio.testing.wait_all_tasks_blocked()
        assert got == [1, 2] and repr(rx).endswith(" consuming>")
        tx.send_nowait(3)  # its wake-up is pending: the consumer has not taken it yet
        with pytest.raises(anyio.BusyResourceError):
            rx.receive_nowait()
        with trio.testing.assert_checkpoints(), pytest.raises(anyio.BusyResourceError):
            await rx.receive()
        tx.close()
    assert got == [1, 2, 3]  # the consumer got every item, none was taken from it
    assert "consuming" not in repr(rx)
    with pytest.raises(anyio.EndOfStream):  # once it ended, receiving is fine again
        rx.receive_nowait()


async def test_refusals_while_consuming_meet_a_cancellation_first() -> None:
    # the entry checkpoint of receive() and consume() comes before the refusal: a caller
    # already cancelled gets Cancelled (not BusyResourceError), and nothing is taken
    tx, rx = open_bridge(4)
    got: list[int] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rx.consume, got.append)
        await trio.testing.wait_all_tasks_blocked()  # it waits: nothing was sent yet
        tx.send_nowait(1)  # for the consumer: the calls below must not take it
        for call in (rx.receive, partial(rx.consume, print)):
            with trio.CancelScope() as scope:
                scope.cancel()
                await call()
            assert scope.cancelled_caught
        tx.close()
    assert got == [1]
    assert rx.statistics().tasks_waiting_receive == 0


async def test_a_consumer_on_its_way_out_still_refuses_a_second_one() -> None:
    # the handler cancels its consumer: the consumer's task is woken to meet the cancellation
    # and a second consume() runs in the same scheduler batch, before or after it (trio
    # shuffles a batch: 20 rounds see both orders). It is refused either way, and the bridge
    # is left with no consumer registered: a third one gets the rest.
    for _ in range(20):
        await refusal_round()


async def refusal_round() -> None:
    tx, rx = open_bridge(8)
    got: list[int] = []
    refused: list[BaseException] = []

    async def second() -> None:
        try:
            await rx.consume(got.append)
        except anyio.BusyResourceError as exc:
            refused.append(exc)

    with trio.fail_after(GUARD_S):  # an accepted second consumer would wait forever
        async with trio.open_nursery() as nursery:
            await consume_cancelled_by_its_handler(rx, tx, got, nursery, second)
    assert len(refused) == 1 and got == [0, 1]
    tx.close()
    with trio.fail_after(GUARD_S):
        await rx.consume(got.append)
    assert got == [0, 1, 2, 3]
    assert rx.statistics().tasks_waiting_receive == 0


async def consume_cancelled_by_its_handler(rx, tx, got, nursery, then) -> None:
    """A consumer whose handler, at item 1, cancels it and starts ``then`` in ``nursery``."""
    with trio.CancelScope() as scope:

        def handler(item: int) -> None:
            got.append(item)
            if item == 1:
                scope.cancel()
                nursery.start_soon(then)

        async with trio.open_nursery() as inner:
            inner.start_soon(rx.consume, handler)
            await trio.testing.wait_all_tasks_blocked()
            for i in range(4):
                tx.send_nowait(i)


async def test_receiver_closed_while_waiting_raises_closed() -> None:
    tx, rx = open_bridge(4)
    async with trio.open_nursery() as nursery:
        errors: list[BaseException] = []

        async def consume() -> None:
            try:
                await rx.consume(print)
            except anyio.ClosedResourceError as exc:
                errors.append(exc)

        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        rx.close()
    assert len(errors) == 1
    assert rx.statistics().tasks_waiting_receive == 0


async def test_a_sender_whose_loop_ends_unclosed_breaks_the_consumer() -> None:
    tx, rx = open_bridge(4)
    got: list[int] = []

    async def produce_and_vanish() -> None:
        await tx.send(1)  # binds tx to this thread's loop, which then ends without closing it

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_thread, produce_and_vanish)
            with pytest.raises(anyio.BrokenResourceError):
                await rx.consume(got.append)
    assert got == [1]  # what was sent before is handed on first


async def test_consumers_cancelled_over_and_over_lose_and_repeat_no_item() -> None:
    # a thread sends without pause while consumers here are cancelled after a random number of
    # items (in the callback or in the task, with a wake-up in flight or not) and replaced: every
    # item is handed on exactly once, in order, and no waiter is left counted
    import random

    tx, rx = open_bridge(8, name="churn")
    total = 20_000
    got: list[int] = []
    rng = random.Random(7)

    def produce() -> None:
        with tx:
            for i in range(total):
                while True:
                    try:
                        tx.send_nowait(i)
                        break
                    except anyio.WouldBlock:
                        threading.Event().wait(0.0001)

    consumers = 0
    with trio.fail_after(GUARD_S * 3):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, produce)
            while True:
                consumers += 1
                quota = len(got) + rng.randrange(1, 300)
                with trio.CancelScope() as scope:

                    def handler(
                        item: int, scope: trio.CancelScope = scope, quota: int = quota
                    ) -> None:
                        got.append(item)
                        if len(got) >= quota:
                            scope.cancel()

                    await rx.consume(handler)
                    break  # the sender closed
                assert rx.statistics().tasks_waiting_receive == 0
    assert got == list(range(total))
    assert consumers > 50
    assert_drained(rx.statistics(), total)
