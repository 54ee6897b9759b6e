"""Admission through the engine (issue 10, fair admission): at max_requests_in_flight,
streams wait first-in first-out; a cancelled waiter leaves no trace; reject and max_waiting;
await engine.pause() / engine.resume() while requests in flight go on; close fails waiters;
nothing left behind after many requests with random cancellations. Scripted stages, MockClock."""

from __future__ import annotations

import random

import pytest
import trio
from trio.testing import assert_checkpoints, wait_all_tasks_blocked

import omni_trio
from omni_trio import DuplicateRequestError, EngineClosedError, EngineOverloadedError
from omni_trio.engine.streams import RequestStream
from omni_trio.observer import EngineObserver
from omni_trio.testing import assert_nothing_in_flight, scripted_pipeline


def limited(limit: int, **engine_options: object) -> dict[str, object]:
    return {"max_requests_in_flight": limit, **engine_options}


def assert_gate_empty(engine: omni_trio.Engine) -> None:
    stats = engine.statistics()
    assert (stats.requests_in_flight, stats.requests_waiting) == (0, 0)
    assert engine.orchestrator.admission.in_flight == 0  # every slot was given back
    assert_nothing_in_flight(engine)


async def consume(engine: omni_trio.Engine, rid: str, admitted: list[str]) -> None:
    async with engine.generate(rid, request_id=rid) as stream:
        admitted.append(rid)
        outs = [out async for out in stream]
    assert outs[-1].finished


async def enter(
    engine: omni_trio.Engine,
    rid: str,
    admitted: list[str],
    scope: trio.CancelScope | None = None,
) -> None:
    """Enter a request's stream (waiting for admission) and leave at once (an abort)."""
    with scope or trio.CancelScope():
        async with engine.generate(rid, request_id=rid):
            admitted.append(rid)


async def hold_and_queue(
    engine: omni_trio.Engine, nursery: trio.Nursery, admitted: list[str], a_scope: trio.CancelScope
) -> RequestStream:
    """Admit h (limit 1, a hanging stage), then queue a (under ``a_scope``), then b."""
    holder = engine.generate("h", request_id="h")
    await holder.__aenter__()
    nursery.start_soon(enter, engine, "a", admitted, a_scope)
    await wait_all_tasks_blocked()
    nursery.start_soon(enter, engine, "b", admitted)
    await wait_all_tasks_blocked()
    assert engine.statistics().requests_waiting == 2
    return holder


async def test_waiting_requests_are_admitted_first_in_first_out(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        cfg = scripted_pipeline(1, outputs=2, latency_s=1.0, engine_options=limited(1))
        admitted: list[str] = []
        async with omni_trio.open_engine(cfg) as engine, trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(consume, engine, f"r{i}", admitted)
                await wait_all_tasks_blocked()
            stats = engine.statistics()
            assert (stats.requests_in_flight, stats.requests_waiting) == (1, 4)
            assert engine.generate("late").status == "pending"
        assert admitted == [f"r{i}" for i in range(5)]
        assert engine.statistics().requests_finished == 5
        assert_gate_empty(engine)


async def test_a_cancelled_waiter_leaves_no_trace_and_the_next_one_is_admitted(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        cfg = scripted_pipeline(1, hang=True, engine_options=limited(1))
        admitted: list[str] = []
        a_scope = trio.CancelScope()

        async with omni_trio.open_engine(cfg) as engine:
            async with trio.open_nursery() as nursery:
                holder = await hold_and_queue(engine, nursery, admitted, a_scope)
                a_scope.cancel()
                assert engine.statistics().requests_waiting == 1
                await holder.__aexit__(None, None, None)  # aborts h: its slot goes to b
            assert a_scope.cancelled_caught
            assert admitted == ["b"]
            stats = engine.statistics()
            assert (stats.requests_total, stats.requests_aborted) == (2, 2)  # h and b, never a
            assert_gate_empty(engine)


class _CancelOnFinish(EngineObserver):
    """Cancels a scope in the same step as a request ends (its slot is handed over then)."""

    def __init__(self, scope: trio.CancelScope) -> None:
        self.scope = scope

    def request_finished(self, request_id: str, status: str, t: float) -> None:
        if request_id == "h":
            self.scope.cancel()


async def test_a_waiter_cancelled_as_its_slot_is_handed_over_passes_it_on(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        cfg = scripted_pipeline(1, hang=True, engine_options=limited(1))
        admitted: list[str] = []
        a_scope = trio.CancelScope()
        async with omni_trio.open_engine(cfg) as engine:
            engine.add_observer(_CancelOnFinish(a_scope))
            async with trio.open_nursery() as nursery:
                holder = await hold_and_queue(engine, nursery, admitted, a_scope)
                await holder.__aexit__(None, None, None)
            assert a_scope.cancelled_caught
            assert admitted == ["b"]
            assert engine.statistics().requests_total == 2
            assert_gate_empty(engine)


async def test_reject_and_max_waiting_refuse_at_once_and_waiting_checkpoints(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        cfg = scripted_pipeline(1, hang=True, engine_options=limited(1, max_waiting=1))
        async with omni_trio.open_engine(cfg) as engine:
            admitted = trio.Event()

            async def waits() -> None:
                with assert_checkpoints():
                    async with engine.generate("w", request_id="w"):
                        admitted.set()

            async with trio.open_nursery() as nursery:
                async with engine.generate("h"):
                    nursery.start_soon(waits)
                    await wait_all_tasks_blocked()
                    bound = r"1 requests already wait for admission, the limit \(max_waiting\) is 1"
                    with assert_checkpoints(), pytest.raises(EngineOverloadedError, match=bound):
                        await engine.generate("x").__aenter__()
                    with assert_checkpoints(), pytest.raises(DuplicateRequestError):
                        await engine.generate("y", request_id="w").__aenter__()
                    assert not admitted.is_set()
            assert admitted.is_set()
            assert engine.statistics().requests_total == 2
            assert_gate_empty(engine)


class _CloseOnFinish(EngineObserver):
    """Closes the orchestrator in the same step as a request ends (its slot handed over)."""

    def __init__(self, engine: omni_trio.Engine) -> None:
        self.engine = engine

    def request_finished(self, request_id: str, status: str, t: float) -> None:
        self.engine.orchestrator.close()


async def test_a_waiter_handed_a_slot_as_the_engine_closes_fails_and_gives_it_back(
    autojump_clock,
):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        cfg = scripted_pipeline(1, hang=True, engine_options=limited(1))
        failed: list[EngineClosedError] = []
        async with omni_trio.open_engine(cfg) as engine:

            async def waits() -> None:
                try:
                    async with engine.generate("w", request_id="w"):
                        pass
                except EngineClosedError as exc:
                    failed.append(exc)

            holder = engine.generate("h")
            await holder.__aenter__()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(waits)
                await wait_all_tasks_blocked()
                engine.add_observer(_CloseOnFinish(engine))
                await holder.__aexit__(None, None, None)
            assert len(failed) == 1 and "closed" in str(failed[0])
            assert engine.statistics().requests_total == 1
            assert_gate_empty(engine)


async def test_pause_holds_admissions_while_requests_in_flight_go_on(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        cfg = scripted_pipeline(1, outputs=3, latency_s=1.0, engine_options=limited(2))
        admitted: list[str] = []
        async with omni_trio.open_engine(cfg) as engine, trio.open_nursery() as nursery:
            running = engine.generate("run", request_id="run")
            await running.__aenter__()
            with assert_checkpoints():
                await engine.pause()
            assert engine.statistics().paused
            for rid in "abc":
                nursery.start_soon(consume, engine, rid, admitted)
                await wait_all_tasks_blocked()
            stats = engine.statistics()
            assert (stats.requests_in_flight, stats.requests_waiting) == (1, 3)  # room held
            outs = [out async for out in running]  # the request in flight goes on
            assert len(outs) == 3 and outs[-1].finished
            await running.__aexit__(None, None, None)
            await wait_all_tasks_blocked()
            assert admitted == []
            assert engine.statistics().requests_in_flight == 0
            engine.resume()
            await wait_all_tasks_blocked()
            assert sorted(admitted) == ["a", "b"]  # the first two, as far as the limit allows
            assert engine.statistics().requests_waiting == 1
            assert not engine.statistics().paused
        assert admitted[-1] == "c"
        assert_gate_empty(engine)


async def test_pause_with_reject_refuses_and_pause_after_close_raises(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        cfg = scripted_pipeline(1, outputs=1, engine_options=limited(4, admission="reject"))
        engine = omni_trio.open_engine(cfg)
        async with engine:
            with trio.CancelScope() as scope:
                scope.cancel()
                await engine.pause()  # cancelled before it took effect: nothing paused
            assert scope.cancelled_caught and not engine.statistics().paused
            await engine.pause()
            assert engine.statistics().paused
            with assert_checkpoints(), pytest.raises(EngineOverloadedError, match="paused"):
                await engine.generate("x").__aenter__()
            engine.resume()
            assert len(await engine.generate("y").collect()) == 1
            assert engine.statistics().requests_total == 1
        with assert_checkpoints(), pytest.raises(EngineClosedError):
            await engine.pause()
        engine.resume()  # a no-op after close


async def test_close_fails_waiting_admissions_with_engine_closed(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        cfg = scripted_pipeline(1, hang=True, engine_options=limited(1))
        failed: list[EngineClosedError] = []

        async with omni_trio.open_engine(cfg) as engine:

            async def waits(rid: str) -> None:
                try:
                    async with engine.generate(rid, request_id=rid):
                        pass
                except EngineClosedError as exc:
                    failed.append(exc)

            holder = engine.generate("h")
            await holder.__aenter__()
            async with trio.open_nursery() as nursery:
                for rid in "ab":
                    nursery.start_soon(waits, rid)
                await wait_all_tasks_blocked()
                assert engine.statistics().requests_waiting == 2
                await engine.aclose()
            await holder.__aexit__(None, None, None)
        assert len(failed) == 2 and "waited for admission" in str(failed[0])
        stats = engine.statistics()
        assert (stats.requests_total, stats.requests_waiting) == (1, 0)
        assert_gate_empty(engine)


async def test_nothing_left_after_many_requests_with_random_cancellations(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        cfg = scripted_pipeline(
            2, outputs=3, latency_s=0.01, engine_options=limited(4, max_waiting=50)
        )
        rng = random.Random(10)
        outcomes = {"finished": 0, "cancelled": 0, "overloaded": 0}
        async with omni_trio.open_engine(cfg) as engine:

            async def client(i: int, patience: float) -> None:
                try:
                    with trio.move_on_after(patience) as scope:
                        await engine.generate(f"p{i}").collect()
                    outcomes["cancelled" if scope.cancelled_caught else "finished"] += 1
                except EngineOverloadedError:
                    outcomes["overloaded"] += 1

            async with trio.open_nursery() as nursery:
                for i in range(300):
                    nursery.start_soon(client, i, rng.choice([0.005, 0.03, 0.2, 10.0]))
                    if i % 20 == 0:
                        await trio.sleep(0.01)
            stats = engine.statistics()
            assert sum(outcomes.values()) == 300
            assert min(outcomes.values()) > 0, outcomes  # every path was taken
            assert stats.requests_finished == outcomes["finished"]
            assert stats.requests_total == stats.requests_finished + stats.requests_aborted
            assert_gate_empty(engine)
