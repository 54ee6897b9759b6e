"""The admission gate (omni_trio.engine.admission): the pure rule, FIFO waiting, cancelled waiters,
the hand-over race, reject, max_waiting, pause/resume, close, checkpoints. Unit level, on
trio alone; through the engine: test_engine_admission.py."""

from __future__ import annotations

import dataclasses

import pytest
import trio
from trio.testing import assert_checkpoints, wait_all_tasks_blocked

from omni_trio.engine.admission import AdmissionGate, AdmissionStatistics, decide, grants
from omni_trio.errors import EngineClosedError, EngineOverloadedError


def state(gate: AdmissionGate) -> tuple[int, int, bool]:
    s = gate.statistics()
    return s.in_flight, s.waiting, s.paused


async def admitter(
    gate: AdmissionGate, name: str, admitted: list[str], scope: trio.CancelScope | None = None
) -> None:
    with scope or trio.CancelScope():
        await gate.admit()
        admitted.append(name)


async def queue(nursery: trio.Nursery, gate: AdmissionGate, names: str, admitted: list[str]):
    """One waiter per name, in order: each is parked before the next one starts."""
    for name in names:
        nursery.start_soon(admitter, gate, name, admitted)
        await wait_all_tasks_blocked()


# -- the pure rule ---------------------------------------------------------------------------

BASE = dict(in_flight=0, limit=2, waiting=0, paused=False, closed=False, max_waiting=None)


@pytest.mark.parametrize(
    ("changes", "policy", "expected"),
    [
        ({}, "wait", "admit"),
        ({"in_flight": 1}, "reject", "admit"),
        ({"in_flight": 2}, "wait", "wait"),
        ({"in_flight": 2}, "reject", "full"),
        ({"waiting": 1}, "wait", "wait"),  # room, but a waiter keeps its turn
        ({"paused": True}, "wait", "wait"),
        ({"paused": True}, "reject", "paused"),
        ({"in_flight": 2, "waiting": 3, "max_waiting": 3}, "wait", "queue_full"),
        ({"in_flight": 2, "waiting": 2, "max_waiting": 3}, "wait", "wait"),
        ({"in_flight": 2, "max_waiting": 0}, "wait", "queue_full"),
        ({"closed": True}, "wait", "closed"),
    ],
)
def test_decide(changes, policy, expected):
    assert decide(**{**BASE, **changes}, policy=policy) == expected


def test_grants_fill_the_room_unless_paused():
    assert grants(in_flight=1, limit=3, waiting=5, paused=False) == 2
    assert grants(in_flight=1, limit=3, waiting=1, paused=False) == 1
    assert grants(in_flight=3, limit=3, waiting=5, paused=False) == 0
    assert grants(in_flight=0, limit=3, waiting=5, paused=True) == 0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="max_requests_in_flight"):
        AdmissionGate(0)
    with pytest.raises(ValueError, match="max_waiting"):
        AdmissionGate(1, "wait", -1)
    with pytest.raises(ValueError, match="admission"):
        AdmissionGate(1, "later")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="without a slot"):
        AdmissionGate(1).release()


# -- admitting and waiting -----------------------------------------------------------------


def test_nowait_admits_with_room_and_would_block_at_the_limit():
    gate = AdmissionGate(2)
    gate.admit_nowait()
    gate.admit_nowait()
    with pytest.raises(trio.WouldBlock):
        gate.admit_nowait()
    assert state(gate) == (2, 0, False)  # the refused one took nothing
    gate.release()
    gate.admit_nowait()
    assert state(gate) == (2, 0, False)


async def test_waiters_get_slots_first_in_first_out_and_nobody_overtakes(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        gate = AdmissionGate(1)
        gate.admit_nowait()
        admitted: list[str] = []
        async with trio.open_nursery() as nursery:
            await queue(nursery, gate, "abcde", admitted)
            assert state(gate) == (1, 5, False)
            for expected in "abcde":
                gate.release()
                # the slot went straight to the first waiter: a newcomer cannot take it
                with pytest.raises(trio.WouldBlock):
                    gate.admit_nowait()
                await wait_all_tasks_blocked()
                assert admitted[-1] == expected
        assert admitted == list("abcde")
        gate.release()
        assert state(gate) == (0, 0, False)


async def test_a_cancelled_waiter_leaves_no_trace_and_the_next_gets_the_slot(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        gate = AdmissionGate(1)
        gate.admit_nowait()
        admitted: list[str] = []
        b_scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            await queue(nursery, gate, "a", admitted)
            nursery.start_soon(admitter, gate, "b", admitted, b_scope)
            await wait_all_tasks_blocked()
            await queue(nursery, gate, "c", admitted)
            assert state(gate) == (1, 3, False)
            b_scope.cancel()
            assert state(gate) == (1, 2, False)  # out of the queue at once, not when b runs
            for _ in range(3):
                gate.release()
                await wait_all_tasks_blocked()
        assert admitted == ["a", "c"]
        assert b_scope.cancelled_caught
        assert state(gate) == (0, 0, False)


@pytest.mark.parametrize("order", ["cancel-then-release", "release-then-cancel"])
async def test_a_slot_handed_to_a_waiter_cancelled_in_the_same_instant_passes_on(
    order, autojump_clock
):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        gate = AdmissionGate(1)
        gate.admit_nowait()
        admitted: list[str] = []
        a_scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(admitter, gate, "a", admitted, a_scope)
            await wait_all_tasks_blocked()
            await queue(nursery, gate, "b", admitted)
            # both in one step, before a runs again
            if order == "cancel-then-release":
                a_scope.cancel()
                gate.release()
            else:
                gate.release()  # the slot is a's now...
                assert state(gate) == (1, 1, False)
                a_scope.cancel()  # ...but a is cancelled before it could use it
        assert a_scope.cancelled_caught
        assert admitted == ["b"]
        assert state(gate) == (1, 0, False)  # b's slot, and only it


# -- refusals --------------------------------------------------------------------------------


async def test_reject_raises_at_once_naming_the_limit(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        gate = AdmissionGate(1, "reject")
        gate.admit_nowait()
        limit = r"1 requests in flight, the limit \(max_requests_in_flight\) is 1"
        with pytest.raises(EngineOverloadedError, match=limit):
            gate.admit_nowait()
        with assert_checkpoints(), pytest.raises(EngineOverloadedError, match=limit):
            await gate.admit()
        assert state(gate) == (1, 0, False)
        gate.release()
        with assert_checkpoints():
            await gate.admit()
        assert state(gate) == (1, 0, False)


async def test_max_waiting_bounds_the_queue(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        gate = AdmissionGate(1, "wait", max_waiting=2)
        gate.admit_nowait()
        admitted: list[str] = []
        a_scope = trio.CancelScope()
        bound = r"2 requests already wait for admission, the limit \(max_waiting\) is 2"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(admitter, gate, "a", admitted, a_scope)
            await wait_all_tasks_blocked()
            await queue(nursery, gate, "b", admitted)
            with pytest.raises(EngineOverloadedError, match=bound):
                gate.admit_nowait()
            with assert_checkpoints(), pytest.raises(EngineOverloadedError, match=bound):
                await gate.admit()
            assert state(gate) == (1, 2, False)
            a_scope.cancel()  # a place in the queue frees up
            await queue(nursery, gate, "c", admitted)
            assert state(gate) == (1, 2, False)
            for _ in range(2):
                gate.release()
                await wait_all_tasks_blocked()
        assert admitted == ["b", "c"]


async def test_max_waiting_zero_means_nobody_waits(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        gate = AdmissionGate(1, "wait", max_waiting=0)
        gate.admit_nowait()
        with pytest.raises(EngineOverloadedError, match=r"\(max_waiting\) is 0"):
            await gate.admit()
        assert state(gate) == (1, 0, False)


# -- pause, resume, close --------------------------------------------------------------------


async def test_pause_holds_admissions_with_room_and_resume_lets_them_in_in_order(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        gate = AdmissionGate(3)
        gate.admit_nowait()  # a request in flight
        gate.pause()
        gate.pause()  # idempotent: one resume ends it
        with pytest.raises(trio.WouldBlock):
            gate.admit_nowait()
        admitted: list[str] = []
        async with trio.open_nursery() as nursery:
            await queue(nursery, gate, "abcd", admitted)
            assert state(gate) == (1, 4, True)
            gate.release()  # the request in flight ended while paused: nobody gets its slot
            await wait_all_tasks_blocked()
            assert admitted == []
            assert state(gate) == (0, 4, True)
            gate.resume()
            assert state(gate) == (3, 1, False)  # the first three, in order; d still waits
            await wait_all_tasks_blocked()
            assert sorted(admitted) == ["a", "b", "c"]
            gate.release()
            await wait_all_tasks_blocked()
            assert admitted[-1] == "d"
        assert state(gate) == (3, 0, False)


async def test_pause_with_reject_refuses_even_with_room(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        gate = AdmissionGate(3, "reject")
        gate.pause()
        with pytest.raises(EngineOverloadedError, match=r"paused.*resume\(\)"):
            gate.admit_nowait()
        with assert_checkpoints(), pytest.raises(EngineOverloadedError, match="paused"):
            await gate.admit()
        gate.resume()
        gate.admit_nowait()
        assert state(gate) == (1, 0, False)


async def test_close_fails_every_waiter_and_every_later_admission(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        gate = AdmissionGate(1)
        gate.admit_nowait()
        failed: list[EngineClosedError] = []

        async def waiter() -> None:
            try:
                await gate.admit()
            except EngineClosedError as exc:
                failed.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(waiter)
            await wait_all_tasks_blocked()
            assert state(gate) == (1, 3, False)
            gate.close()
            assert state(gate) == (1, 0, False)
        assert len(failed) == 3
        assert "closed while the request waited" in str(failed[0])
        with pytest.raises(EngineClosedError):
            gate.admit_nowait()
        with assert_checkpoints(), pytest.raises(EngineClosedError):
            await gate.admit()
        gate.release()  # a request in flight at close still ends
        assert gate.statistics() == AdmissionStatistics(0, 0, False, True, 1)


# -- checkpoints, statistics ---------------------------------------------------------------


async def test_admit_always_checkpoints_and_a_cancelled_caller_takes_nothing(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        gate = AdmissionGate(1)
        with trio.CancelScope() as scope:
            scope.cancel()
            await gate.admit()
        assert scope.cancelled_caught
        assert state(gate) == (0, 0, False)
        with assert_checkpoints():
            await gate.admit()  # with room
        done = trio.Event()

        async def waits() -> None:
            with assert_checkpoints():
                await gate.admit()  # without
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waits)
            await wait_all_tasks_blocked()
            gate.release()
        assert done.is_set()
        assert state(gate) == (1, 0, False)


async def test_statistics_are_frozen_and_repr_shows_the_live_state(autojump_clock):
    with trio.fail_after(60):  # a deadlock fails at once under the autojump clock
        gate = AdmissionGate(2, "wait", max_waiting=5)
        gate.admit_nowait()
        gate.pause()
        async with trio.open_nursery() as nursery:
            await queue(nursery, gate, "a", [])
            stats = gate.statistics()
            with pytest.raises(dataclasses.FrozenInstanceError):
                stats.waiting = 0  # type: ignore[misc]
            assert repr(gate) == "<AdmissionGate wait in_flight=1/2 waiting=1/5 paused>"
            nursery.cancel_scope.cancel()
        gate.close()
        assert stats == AdmissionStatistics(
            in_flight=1, waiting=1, paused=True, closed=False, limit=2
        )
        assert repr(gate) == "<AdmissionGate wait in_flight=1/2 waiting=0/5 paused closed>"
