"""The per-request capacity gate, ``max_requests_in_graph``: a ticket held from admission
until the consumer took the final output or left, released exactly once on every ending
(finish, abort, failure, consumer cancellation, a plain ``async for`` left early, the
engine's close); over capacity the request waits first-in first-out or is refused as
``admission`` says; visible in ``statistics()``. The pure rule (``decide``, ``grants`` with
tickets), the gate's tickets, and the engine (scripted stages, MockClock), up to 1,000
requests through a capacity-1 gate with random aborts and consumer cancellations, and a
request cancelled at every checkpoint with the gate held."""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

import omni_trio
from omni_trio import EngineClosedError, EngineOverloadedError, StageError
from omni_trio.engine.admission import AdmissionGate, decide, grants
from omni_trio.testing import (
    assert_nothing_in_flight,
    cancel_at_every_checkpoint,
    in_flight_problems,
    scripted_pipeline,
)

BASE = {
    "in_flight": 0,
    "limit": 4,
    "waiting": 0,
    "paused": False,
    "closed": False,
    "max_waiting": None,
    "in_graph": 0,
    "graph_limit": 1,
}


@pytest.mark.parametrize(
    ("changes", "policy", "expected"),
    [
        ({}, "wait", "admit"),
        ({"graph_limit": None, "in_graph": 9}, "wait", "admit"),
        ({"in_graph": 1}, "wait", "wait"),
        ({"in_graph": 1}, "reject", "graph_full"),
        ({"in_graph": 1, "in_flight": 4}, "reject", "full"),
        ({"in_graph": 1, "paused": True}, "reject", "paused"),
        ({"in_graph": 1, "waiting": 3, "max_waiting": 3}, "wait", "queue_full"),
        ({"in_graph": 1, "closed": True}, "wait", "closed"),
    ],
)
def test_decide_with_tickets(changes, policy, expected):
    assert decide(**{**BASE, **changes}, policy=policy) == expected


def test_grants_with_tickets():
    assert grants(in_flight=0, limit=4, waiting=5, paused=False, in_graph=1, graph_limit=3) == 2
    assert grants(in_flight=3, limit=4, waiting=5, paused=False, in_graph=0, graph_limit=3) == 1
    assert grants(in_flight=0, limit=4, waiting=5, paused=False, in_graph=3, graph_limit=3) == 0
    assert grants(in_flight=0, limit=4, waiting=5, paused=False, graph_limit=None) == 4


def test_bad_graph_limit():
    with pytest.raises(ValueError, match="max_requests_in_graph"):
        AdmissionGate(1, graph_limit=0)


async def test_a_ticket_outlives_the_slot_and_is_released_once():
    gate = AdmissionGate(4, graph_limit=1)
    ticket = gate.admit_nowait()
    assert ticket is not None and ticket.held
    gate.release()  # the request's task ended: its slot is back, its ticket is not
    with pytest.raises(trio.WouldBlock):
        gate.admit_nowait()
    async with trio.open_nursery() as nursery:
        got: list[object] = []

        async def waiter() -> None:
            got.append(await gate.admit())

        nursery.start_soon(waiter)
        await wait_all_tasks_blocked()
        assert gate.statistics().waiting == 1
        ticket.release()
        ticket.release()  # a second release does nothing
        assert not ticket.held and repr(ticket) == "<GraphTicket released>"
    (second,) = got
    assert second is not None and second.held  # type: ignore[attr-defined]
    stats = gate.statistics()
    assert (stats.in_graph, stats.tickets_issued, stats.tickets_released) == (1, 2, 1)
    assert "in_graph=1/1" in repr(gate)
    gate.close()  # the close releases what is still held
    assert not second.held  # type: ignore[attr-defined]
    stats = gate.statistics()
    assert (stats.in_graph, stats.tickets_issued, stats.tickets_released) == (0, 2, 2)


async def test_without_a_graph_limit_there_are_no_tickets():
    gate = AdmissionGate(2)
    assert gate.admit_nowait() is None
    assert await gate.admit() is None
    assert gate.statistics().in_graph is None


# -- through the engine ----------------------------------------------------------------------


def gated(
    n: int = 1,
    stages: int = 2,
    *,
    engine_options: dict[str, object] | None = None,
    **options: Any,
) -> omni_trio.PipelineConfig:
    """A scripted pipeline (2 outputs per stage unless said) under max_requests_in_graph=n."""
    options.setdefault("outputs", 2)
    engine = {"max_requests_in_graph": n, **(engine_options or {})}
    return scripted_pipeline(stages, engine_options=engine, **options)


def tickets(engine: omni_trio.Engine) -> tuple[int | None, int, int]:
    stats = engine.orchestrator.admission.statistics()
    return stats.in_graph, stats.tickets_issued, stats.tickets_released


async def test_the_ticket_is_held_until_the_consumer_took_the_final_output(autojump_clock):
    async with omni_trio.open_engine(gated()) as engine, trio.open_nursery() as nursery:
        order: list[str] = []

        async def second() -> None:
            async with engine.generate("b", request_id="b") as stream:
                order.append("b admitted")
                await stream.collect()

        async with engine.generate("a", request_id="a") as first:
            nursery.start_soon(second)
            await engine.orchestrator.wait_idle()  # a ended in every stage, unread
            await wait_all_tasks_blocked()
            stats = engine.statistics()
            assert (stats.requests_in_flight, stats.requests_in_graph) == (0, 1)
            assert stats.requests_waiting == 1  # b waits for a's consumer, not for a stage
            outs = []
            while not outs or not outs[-1].finished:
                outs.append(await first.receive())
            order.append("a read its final output")
            # taking the final item released the ticket, with no checkpoint: b is next
            assert tickets(engine) == (1, 2, 1)
            await wait_all_tasks_blocked()
            assert order == ["a read its final output", "b admitted"]
        await wait_all_tasks_blocked()
    assert order == ["a read its final output", "b admitted"]
    assert tickets(engine) == (0, 2, 2)


async def test_over_capacity_with_reject_is_refused_naming_the_limit(autojump_clock):
    cfg = gated(engine_options={"admission": "reject"})
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("a") as first:
            with pytest.raises(EngineOverloadedError, match=r"max_requests_in_graph\) is 1"):
                async with engine.generate("b"):
                    pytest.fail("admitted")
            await first.collect()
        async with engine.generate("c") as third:  # a's consumer is done: room again
            await third.collect()
        assert tickets(engine) == (0, 2, 2)
        assert_nothing_in_flight(engine)


async def consumer_left_early(engine: omni_trio.Engine) -> None:
    async with engine.generate("x") as stream:
        await stream.receive()


async def consumer_cancelled(engine: omni_trio.Engine) -> None:
    with trio.move_on_after(0.5):
        async with engine.generate("x") as stream:
            await stream.collect()


async def plain_loop_left_early(engine: omni_trio.Engine) -> None:
    stream = engine.generate("x")
    async for _ in stream:
        break
    # the loop's generator is finalized in trio's system nursery: the request ends aborted
    await trio.lowlevel.checkpoint()
    await engine.orchestrator.wait_idle()


async def aborted(engine: omni_trio.Engine) -> None:
    async with engine.generate("x", request_id="ab") as stream:
        await stream.receive()
        engine.abort_nowait("ab")
        outs = await stream.collect()
    assert outs[-1].finish_reason == "abort"


async def plain_collect(engine: omni_trio.Engine) -> None:
    outs = await engine.generate("x").collect()
    assert outs[-1].finished


@pytest.mark.parametrize(
    "ending",
    [plain_collect, consumer_left_early, consumer_cancelled, plain_loop_left_early, aborted],
)
async def test_every_ending_releases_the_ticket_once(autojump_clock, ending):
    cfg = gated(latency_s=1.0)
    async with omni_trio.open_engine(cfg) as engine:
        for _ in range(3):
            await ending(engine)
            assert engine.statistics().requests_in_graph == 0
        assert tickets(engine) == (0, 3, 3)
        assert_nothing_in_flight(engine)


async def test_a_failed_request_releases_its_ticket_when_its_consumer_gets_the_error(
    autojump_clock,
):
    cfg = gated(stage_options={"s1": {"fail_at_output": 1}})
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("x") as stream:
            await engine.orchestrator.wait_idle()
            assert engine.statistics().requests_in_graph == 1  # the error is not read yet
            with pytest.raises(StageError):
                await stream.collect()
            assert engine.statistics().requests_in_graph == 0
        assert tickets(engine) == (0, 1, 1)


async def test_the_engine_close_releases_tickets_and_fails_waiters(autojump_clock):
    cfg = gated(outputs=2, latency_s=1.0)
    engine = omni_trio.open_engine(cfg)
    outcomes: list[str] = []
    async with trio.open_nursery() as nursery:
        async with engine:
            stream = engine.generate("held")
            await stream.__aenter__()

            async def waiter() -> None:
                try:
                    async with engine.generate("waits"):
                        outcomes.append("admitted")
                except EngineClosedError:
                    outcomes.append("closed")

            nursery.start_soon(waiter)
            await wait_all_tasks_blocked()
            assert engine.statistics().requests_waiting == 1
        # closed: the held stream's ticket is back though its consumer never read it
        assert outcomes == ["closed"]
        assert engine.statistics().requests_in_graph == 0
        outs = await stream.collect()  # its terminals can still be read
        assert outs[-1].finish_reason == "abort"
        await stream.__aexit__(None, None, None)
    assert tickets(engine) == (0, 1, 1)


async def test_statistics_without_the_limit_have_no_graph_count(autojump_clock):
    async with omni_trio.open_engine(scripted_pipeline(1)) as engine:
        await engine.generate("x").collect()
        assert engine.statistics().requests_in_graph is None


async def test_a_thousand_requests_through_a_capacity_1_gate(autojump_clock):
    # Random consumers: some read everything slowly (the request ends long before they are
    # done), some leave after a few outputs, some are cancelled (while waiting for
    # admission too), some are aborted from another task. A consumer counts itself in the
    # graph from its admission to its last item or its leaving: never two at once.
    rng = random.Random(36)
    cfg = gated(1, outputs=3, latency_s=0.01)
    holding = [0]
    most = [0]
    ended = {"read": 0, "left": 0, "cancelled": 0, "aborted": 0, "cancelled_waiting": 0}

    def enter() -> None:
        holding[0] += 1
        most[0] = max(most[0], holding[0])
        assert holding[0] == 1, "two consumers in the graph at once"

    async with omni_trio.open_engine(cfg) as engine:

        async def consumer(i: int, nursery: trio.Nursery) -> None:
            kind = rng.choice(["read", "left", "cancelled", "aborted"])
            rid = f"r{i}"
            with trio.CancelScope() as scope:
                if kind == "cancelled":
                    scope.deadline = trio.current_time() + rng.choice([0.001, 0.05, 1.0, 30.0])
                async with engine.generate("x", request_id=rid) as stream:
                    enter()
                    inside = True
                    try:
                        if kind == "aborted":
                            nursery.start_soon(abort_later, rid, rng.choice([0, 0.005, 0.03]))
                        async for out in stream:
                            if out.finished:  # the one output stage: this is its last item
                                holding[0] -= 1
                                inside = False
                            elif kind == "left" and rng.random() < 0.5:
                                break
                            # a slow consumer: its request ends long before it is done
                            await trio.sleep(rng.choice([0, 0.001, 0.05]))
                    finally:
                        if inside:
                            holding[0] -= 1  # before __aexit__ gives the ticket back
            if scope.cancelled_caught:
                ended["cancelled" if "inside" in locals() else "cancelled_waiting"] += 1
            else:
                ended[kind] += 1

        async def abort_later(rid: str, delay: float) -> None:
            await trio.sleep(delay)
            engine.abort_nowait(rid)

        with trio.fail_after(10_000):  # a deadlock fails at once under the autojump clock
            async with trio.open_nursery() as nursery:
                for i in range(1000):
                    nursery.start_soon(consumer, i, nursery)
                    if i % 10 == 0:
                        await trio.sleep(0.01)
        assert sum(ended.values()) == 1000
        assert min(ended.values()) > 0, ended  # every ending happened
        assert most[0] == 1
        in_graph, issued, released = tickets(engine)
        assert in_graph == 0
        assert issued == released == 1000 - ended["cancelled_waiting"]
        assert in_flight_problems(engine) == []


async def test_cancelled_at_every_checkpoint_with_the_gate_held(autojump_clock):
    # three stages streaming into each other, two requests, one ticket: whichever
    # checkpoint the cancellation lands at, each admitted request's ticket is released once
    cfg = gated(1, stages=3, outputs=3, latency_s=0.01, stream_input=True)
    async with omni_trio.open_engine(cfg) as engine:

        async def read(engine: omni_trio.Engine, prompt: str) -> None:
            async with engine.generate(prompt) as stream:
                outs = []
                async for out in stream:
                    outs.append(out)
                    await trio.sleep(0.001)
                assert outs[-1].finished

        async def scenario(engine: omni_trio.Engine) -> None:
            # the first request holds the ticket; the second waits for it, then reads too
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read, engine, "first")
                await wait_all_tasks_blocked()
                nursery.start_soon(read, engine, "second")

        runs = [0]

        def invariant(engine: omni_trio.Engine) -> None:
            runs[0] += 1
            in_graph, issued, released = tickets(engine)
            assert in_graph == 0, f"{in_graph} ticket(s) held"
            # every ticket handed out was released, once (a release counts only once); a
            # waiter cancelled as a ticket was handed to it had it too, and passed it on
            assert issued == released >= engine.statistics().requests_finished

        report = await cancel_at_every_checkpoint(engine, scenario, invariant=invariant)
        report.raise_if_failed()
        assert report.checkpoints > 10
        assert runs[0] == report.runs + 1
        assert engine.statistics().requests_total > report.runs  # both requests ran
