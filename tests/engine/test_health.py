"""Engine health: the pure ``assess_health`` over constructed statistics, then
``Engine.check_health()`` on scripted pipelines under the MockClock."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import get_args

import pytest
import trio

import omni_trio
from omni_trio.engine.health import HealthReport, ReplicaHealth, assess_health
from omni_trio.outputs import EngineStatistics, ReplicaState, ReplicaStatistics, StageStatistics
from omni_trio.testing import scripted_pipeline

ALL_STATES: tuple[ReplicaState, ...] = get_args(ReplicaState)
CRASH = "StageError: scripted crash at request {}"  # a scripted replica's last_error


def replica(
    index: int,
    state: ReplicaState,
    *,
    requests_in_flight: int = 0,
    failures: int = 0,
    restarts: int = 0,
    last_error: str | None = None,
) -> ReplicaStatistics:
    return ReplicaStatistics(
        replica=index,
        alive=state == "ready",
        requests_in_flight=requests_in_flight,
        requests_finished=0,
        requests_aborted=0,
        requests_failed=0,
        state=state,
        restarts=restarts,
        failures=failures,
        last_error=last_error,
    )


def stage(
    stage_id: str, *replicas: ReplicaStatistics, requests_waiting: int = 0
) -> StageStatistics:
    return StageStatistics(
        stage_id=stage_id,
        stage_index=0,
        backend="scripted",
        requests_in_flight=sum(r.requests_in_flight for r in replicas),
        live_replicas=sum(r.alive for r in replicas),
        replicas=replicas,
        requests_waiting=requests_waiting,
    )


def engine_stats(
    *stages: StageStatistics,
    closed: bool = False,
    requests_in_flight: int = 0,
    requests_waiting: int = 0,
    paused: bool = False,
) -> EngineStatistics:
    return EngineStatistics(
        requests_in_flight=requests_in_flight,
        requests_finished=0,
        requests_aborted=0,
        requests_failed=0,
        requests_total=0,
        closed=closed,
        stages=stages,
        requests_waiting=requests_waiting,
        paused=paused,
    )


# -- the pure rules ----------------------------------------------------------------------------
@pytest.mark.parametrize("state", ALL_STATES)
def test_only_a_ready_replica_is_live_and_only_a_stopped_one_is_no_member(state):
    report = assess_health(engine_stats(stage("a", replica(0, state))))
    a = report.stage("a")
    assert a.replicas[0].state == state
    assert a.replicas[0].live is (state == "ready")
    assert a.live_replicas == (1 if state == "ready" else 0)
    assert a.total_replicas == (0 if state == "stopped" else 1)
    assert a.healthy is (state == "ready")
    assert report.healthy is (state == "ready")
    assert report.status == ("ok" if state == "ready" else "unhealthy")
    assert report.unhealthy_stages == (() if state == "ready" else ("a",))


@pytest.mark.parametrize("other", [s for s in ALL_STATES if s not in ("ready", "stopped")])
def test_a_stage_with_one_ready_replica_is_healthy_but_degraded(other):
    report = assess_health(engine_stats(stage("a", replica(0, other), replica(1, "ready"))))
    a = report.stage("a")
    assert (a.live_replicas, a.total_replicas) == (1, 2)
    assert a.healthy and a.degraded
    assert report.status == "degraded" and report.healthy
    assert report.unhealthy_stages == ()
    assert f"a[0] {other}" in report.message


def test_a_removed_replica_does_not_degrade_its_stage():
    report = assess_health(engine_stats(stage("a", replica(0, "stopped"), replica(1, "ready"))))
    assert report.status == "ok" and report.healthy
    assert (report.stage("a").live_replicas, report.stage("a").total_replicas) == (1, 1)
    assert len(report.stage("a").replicas) == 2  # still listed, with its state


def test_a_draining_replica_serves_its_requests_but_is_not_live():
    draining = replica(0, "draining", requests_in_flight=3)
    report = assess_health(engine_stats(stage("a", replica(0, "ready")), stage("b", draining)))
    b = report.stage("b")
    assert b.live_replicas == 0 and b.total_replicas == 1
    assert b.requests_in_flight == 3 and b.replicas[0].requests_in_flight == 3
    assert not b.healthy
    assert report.status == "unhealthy" and not report.healthy
    assert report.unhealthy_stages == ("b",)
    assert report.message == "stage(s) b have no ready replica: b[0] draining"


def test_every_unhealthy_stage_is_named_in_pipeline_order_with_its_replicas_errors():
    report = assess_health(
        engine_stats(
            stage("thinker", replica(0, "dead", failures=1, last_error="StageError: boom")),
            stage("talker", replica(0, "ready")),
            stage("code2wav", replica(0, "restarting", failures=2, restarts=1)),
        )
    )
    assert report.unhealthy_stages == ("thinker", "code2wav")
    assert report.status == "unhealthy"
    assert report.message == (
        "stage(s) thinker, code2wav have no ready replica: "
        "thinker[0] dead (StageError: boom); code2wav[0] restarting"
    )
    dead = report.stage("thinker").replicas[0]
    assert (dead.failures, dead.restarts, dead.last_error) == (1, 0, "StageError: boom")
    back = report.stage("code2wav").replicas[0]
    assert (back.failures, back.restarts, back.last_error) == (2, 1, None)


def test_a_stage_without_any_replica_is_unhealthy():
    report = assess_health(engine_stats(stage("a")))
    assert report.unhealthy_stages == ("a",)
    assert report.message == "stage(s) a have no ready replica"


def test_closed_comes_first_and_is_not_healthy():
    report = assess_health(engine_stats(stage("a", replica(0, "stopped")), closed=True))
    assert report.status == "closed" and report.closed and not report.healthy
    assert report.message == "the engine is closed"


def test_counters_are_carried_and_a_pause_is_reported_not_unhealthy():
    report = assess_health(
        engine_stats(
            stage("a", replica(0, "ready", requests_in_flight=2), requests_waiting=4),
            requests_in_flight=2,
            requests_waiting=7,
            paused=True,
        )
    )
    assert report.status == "ok" and report.healthy
    assert (report.requests_in_flight, report.requests_waiting, report.paused) == (2, 7, True)
    assert report.stage("a").requests_waiting == 4
    assert report.stage("a").requests_in_flight == 2


def test_the_report_is_frozen_and_an_unknown_stage_is_a_key_error():
    report = assess_health(engine_stats(stage("a", replica(0, "ready"))))
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.status = "unhealthy"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.stage("a").replicas[0].state = "dead"  # type: ignore[misc]
    with pytest.raises(KeyError, match="nope"):
        report.stage("nope")


def replica_of(report: HealthReport, stage_id: str, index: int) -> ReplicaHealth:
    (found,) = [r for r in report.stage(stage_id).replicas if r.replica == index]
    return found


# -- Engine.check_health ----------------------------------------------------------------------
async def test_check_health_before_during_and_after_the_session(autojump_clock):
    engine = omni_trio.open_engine(scripted_pipeline(["a", "b"], outputs=4, latency_s=1.0))
    before = engine.check_health()
    assert before.status == "unhealthy" and before.unhealthy_stages == ("a", "b")
    assert {r.state for s in before.stages for r in s.replicas} == {"starting"}
    async with engine:
        report = engine.check_health()
        assert isinstance(report, omni_trio.HealthReport)  # a public name
        assert report.status == "ok" and report.healthy
        assert [(s.stage_id, s.live_replicas, s.total_replicas) for s in report.stages] == [
            ("a", 1, 1),
            ("b", 1, 1),
        ]
        async with engine.generate("x") as stream:
            await stream.receive()  # b's first output: the request is bound to b's replica
            during = engine.check_health()
            assert during.requests_in_flight == 1
            assert during.stage("b").requests_in_flight == 1
            assert during.stage("b").replicas[0].requests_in_flight == 1
        idle = engine.check_health()
        assert idle.requests_in_flight == 0
        assert idle.stage("b").replicas[0].requests_in_flight == 0
    after = engine.check_health()
    assert after.status == "closed" and after.closed and not after.healthy


async def test_a_crashed_replica_shows_dead_and_only_its_stage_is_named(autojump_clock):
    cfg = scripted_pipeline(
        ["thinker", "talker"], outputs=2, stage_options={"talker": {"crash_at_request": 1}}
    )
    async with omni_trio.open_engine(cfg) as engine:
        with pytest.raises(omni_trio.ReplicaDeadError):
            async with engine.generate("x") as stream:
                await stream.collect()
        report = engine.check_health()
        assert report.status == "unhealthy" and not report.healthy
        assert report.unhealthy_stages == ("talker",)
        assert report.message == (
            f"stage(s) talker have no ready replica: talker[0] dead ({CRASH.format(1)})"
        )
        talker = report.stage("talker")
        assert (talker.live_replicas, talker.total_replicas) == (0, 1)
        (dead,) = talker.replicas
        assert dead.state == "dead" and not dead.live
        assert (dead.failures, dead.restarts, dead.last_error) == (1, 0, CRASH.format(1))
        thinker = report.stage("thinker").replicas[0]
        assert (thinker.state, thinker.failures, thinker.last_error) == ("ready", 0, None)
        assert report.requests_in_flight == 0 and talker.requests_in_flight == 0


async def test_a_restarting_replica_is_reported_and_a_request_waits_for_it(autojump_clock):
    cfg = scripted_pipeline(
        ["a", "b"], outputs=2, stage_options={"b": {"crash_at_request": 2}}
    )  # every backend of b[0] crashes at its 2nd request: the replacement serves one
    overrides = {"b": {"restart": "on-failure", "restart_backoff_s": 5.0}}
    async with omni_trio.open_engine(cfg, stage_overrides=overrides) as engine:
        await engine.generate("x").collect()
        with pytest.raises(omni_trio.ReplicaDeadError):
            await engine.generate("x").collect()
        report = engine.check_health()
        assert report.status == "unhealthy" and report.unhealthy_stages == ("b",)
        assert report.message.endswith(f"b[0] restarting ({CRASH.format(2)})")
        (b0,) = report.stage("b").replicas
        assert (b0.state, b0.failures, b0.restarts) == ("restarting", 1, 0)
        async with trio.open_nursery() as nursery:
            done = trio.Event()

            async def third() -> None:
                outs = await engine.generate("z").collect()
                assert outs[-1].finished and not outs[-1].aborted
                done.set()

            nursery.start_soon(third)
            # checkpoints never advance the MockClock: the restart is still 5 s away
            for _ in range(1000):
                if engine.check_health().stage("b").requests_waiting:
                    break
                await trio.lowlevel.checkpoint()
            waiting = engine.check_health()
            assert waiting.stage("b").requests_waiting == 1
            assert waiting.stage("b").replicas[0].state == "restarting"
            assert waiting.requests_in_flight == 1
        assert done.is_set()
        back = engine.check_health()
        assert back.status == "ok" and back.healthy
        (b0,) = back.stage("b").replicas
        assert (b0.state, b0.failures, b0.restarts) == ("ready", 1, 1)
        assert b0.last_error == CRASH.format(2)  # the history stays after it recovered
        assert back.stage("b").requests_waiting == 0


async def test_a_draining_replica_is_not_live_and_a_removed_one_is_gone(autojump_clock):
    cfg = scripted_pipeline(
        ["a", "b"],
        outputs=1,
        replicas={"b": 2},
        stage_options={"b": {"outputs": 10, "latency_s": 1.0}},
    )
    async with omni_trio.open_engine(cfg) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.generate("x").collect)
            for _ in range(1000):
                if engine.check_health().stage("b").requests_in_flight:
                    break
                await trio.lowlevel.checkpoint()
            (busy,) = [
                r.replica for r in engine.check_health().stage("b").replicas if r.requests_in_flight
            ]
            nursery.start_soon(partial(engine.remove_replica, "b", busy, drain_timeout=100))
            for _ in range(1000):
                if replica_of(engine.check_health(), "b", busy).state == "draining":
                    break
                await trio.lowlevel.checkpoint()
            report = engine.check_health()
            b = report.stage("b")
            draining = replica_of(report, "b", busy)
            assert draining.state == "draining" and not draining.live
            assert draining.requests_in_flight == 1  # it still serves its request
            assert (b.live_replicas, b.total_replicas) == (1, 2)
            assert report.status == "degraded" and report.healthy
            assert f"b[{busy}] draining" in report.message
        # the request finished, the drain ended, the replica was stopped and dropped
        after = engine.check_health()
        assert [r.replica for r in after.stage("b").replicas] == [1 - busy]
        assert (after.stage("b").live_replicas, after.stage("b").total_replicas) == (1, 1)
        assert after.status == "ok"


async def test_an_added_replica_is_starting_then_live(autojump_clock):
    cfg = scripted_pipeline(["a"], start_delay_s=5.0)
    async with omni_trio.open_engine(cfg) as engine:
        async with trio.open_nursery() as nursery:
            added: list[int] = []

            async def add() -> None:
                added.append(await engine.add_replica("a"))

            nursery.start_soon(add)
            for _ in range(1000):
                if len(engine.check_health().stage("a").replicas) == 2:
                    break
                await trio.lowlevel.checkpoint()
            report = engine.check_health()
            assert [r.state for r in report.stage("a").replicas] == ["ready", "starting"]
            assert report.status == "degraded" and report.healthy
            assert "a[1] starting" in report.message
        assert added == [1]
        report = engine.check_health()
        assert [r.state for r in report.stage("a").replicas] == ["ready", "ready"]
        assert (report.stage("a").live_replicas, report.stage("a").total_replicas) == (2, 2)
        assert report.status == "ok"


async def test_one_dead_replica_of_three_degrades_the_stage_and_the_others_serve(
    autojump_clock,
):
    cfg = scripted_pipeline(
        ["a", "b"],
        replicas={"b": 3},
        stage_options={"b": {"crash_at_request": 1, "crash_replica": 0}},
        outputs=3,
    )
    async with omni_trio.open_engine(cfg) as engine:
        # the first request goes to b[0], the least loaded replica with the lowest index
        with pytest.raises(omni_trio.ReplicaDeadError):
            await engine.generate("x").collect()
        report = engine.check_health()
        assert report.status == "degraded" and report.healthy
        b = report.stage("b")
        assert (b.live_replicas, b.total_replicas) == (2, 3)
        assert [r.state for r in b.replicas] == ["dead", "ready", "ready"]
        assert report.message == "every stage has a ready replica; not ready: b[0] dead" + (
            f" ({b.replicas[0].last_error})" if b.replicas[0].last_error else ""
        )
        outs = await engine.generate("y").collect()
        assert outs[-1].finished and not outs[-1].aborted
        assert engine.check_health().status == "degraded"


async def test_a_request_waiting_for_a_replica_slot_is_counted_on_its_stage(autojump_clock):
    cfg = scripted_pipeline(["a"], outputs=3, latency_s=1.0)
    overrides = {"a": {"max_in_flight_per_replica": 1}}
    async with omni_trio.open_engine(cfg, stage_overrides=overrides) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.generate("x").collect)
            nursery.start_soon(engine.generate("y").collect)
            for _ in range(1000):
                if engine.check_health().stage("a").requests_waiting:
                    break
                await trio.lowlevel.checkpoint()
            report = engine.check_health()
            a = report.stage("a")
            assert (a.requests_waiting, a.requests_in_flight) == (1, 1)
            assert a.replicas[0].requests_in_flight == 1
            # a full replica is busy, not unhealthy
            assert report.status == "ok" and report.requests_in_flight == 2
        idle = engine.check_health()
        assert (idle.stage("a").requests_waiting, idle.requests_in_flight) == (0, 0)


async def test_a_paused_engine_is_healthy_and_counts_its_waiting_admissions(autojump_clock):
    async with omni_trio.open_engine(scripted_pipeline(["a"], outputs=2)) as engine:
        await engine.pause()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.generate("x").collect)
            for _ in range(1000):
                if engine.check_health().requests_waiting:
                    break
                await trio.lowlevel.checkpoint()
            report = engine.check_health()
            assert report.paused and report.requests_waiting == 1
            assert report.status == "ok" and report.healthy  # an operator's hold, not a fault
            assert report.stage("a").requests_in_flight == 0  # not admitted: bound nowhere
            engine.resume()
        resumed = engine.check_health()
        assert not resumed.paused and resumed.requests_waiting == 0
        assert engine.statistics().requests_finished == 1
