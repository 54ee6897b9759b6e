"""Replica indexes across their life: crashes, restarts, added and removed replicas (scripted
stages, MockClock), and a randomized soak of all of it at once."""

import random

import pytest
import trio
import trio.testing

from omni_trio import (
    InvalidRequestError,
    ReplicaDeadError,
    StageError,
    StageStartError,
    load_config,
    open_engine,
)
from omni_trio.backends.scripted import ScriptedBackend
from omni_trio.stages.pool import StagePool
from omni_trio.stages.replicas import restart_delay
from omni_trio.testing import (
    assert_nothing_in_flight,
    cancel_at_every_checkpoint,
    scripted_backends,
    wait_until_settled,
)

from .test_binding import pipeline, run, stage


def test_restart_delay_doubles_and_is_capped():
    assert [restart_delay(n, 0.5, 3.0) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert restart_delay(10_000, 1.0, 30.0) == 30.0
    assert restart_delay(3, 0.0, 30.0) == 0.0


async def start_requests(engine, nursery, rids, results):
    async def one(rid):
        try:
            await run(engine, rid)
        except StageError as exc:
            results[rid] = exc
        else:
            results[rid] = "ok"

    for rid in rids:
        nursery.start_soon(one, rid)
    await trio.testing.wait_all_tasks_blocked()


@pytest.mark.parametrize("restart", ["never", "on-failure"])
async def test_a_crash_fails_exactly_the_requests_bound_to_that_replica(autojump_clock, restart):
    cfg = pipeline(stage("a", 2, restart=restart, options={"latency_s": 1.0, "outputs": 4}))
    async with open_engine(cfg) as engine:
        pool = engine.pools["a"]
        results = {}
        async with trio.open_nursery() as nursery:
            await start_requests(engine, nursery, [f"r{i}" for i in range(6)], results)
            on_0 = {f"r{i}" for i in range(6) if pool.replica_of(f"r{i}").replica == 0}
            assert len(on_0) == 3
            await trio.sleep(1.5)
            pool.replica(0).kill(RuntimeError("injected crash"))
        failed = {rid for rid, r in results.items() if r != "ok"}
        assert failed == on_0
        assert all(isinstance(results[rid], ReplicaDeadError) for rid in failed)
        assert all(results[rid].replica == 0 for rid in failed)
        replica0 = pool.statistics().replicas[0]
        assert replica0.failures == 1
        assert replica0.last_error == "RuntimeError: injected crash"
        await trio.sleep(60)  # past any restart backoff
        later = [await run(engine, f"later{i}") for i in range(4)]
        assert all(outs[-1].finished for outs in later)
        backends = scripted_backends(engine, "a")
        if restart == "on-failure":
            assert pool.statistics().replicas[0].state == "ready"
            assert pool.statistics().replicas[0].restarts == 1
            # the replacement (a new backend at index 0) serves later requests
            assert len(backends[0].completed) == 2 and len(backends[1].completed) == 5
        else:
            assert pool.statistics().replicas[0].state == "dead"
            assert len(backends[1].completed) == 3 + 4
        assert_nothing_in_flight(engine)


async def test_add_replica_under_load_takes_new_requests(autojump_clock):
    cfg = pipeline(stage("a", 1, options={"latency_s": 1.0, "start_delay_s": 5.0}))
    async with open_engine(cfg) as engine:
        pool = engine.pools["a"]
        results = {}
        async with trio.open_nursery() as nursery:
            await start_requests(engine, nursery, ["old0", "old1"], results)
            t0 = trio.current_time()
            assert await engine.add_replica("a") == 1
            assert trio.current_time() - t0 == pytest.approx(5.0)
            assert pool.statistics().replicas[1].state == "ready"
            await start_requests(engine, nursery, ["new0", "new1"], results)
            assert pool.replica_of("new0").replica == 1 or pool.replica_of("new1").replica == 1
        assert set(results.values()) == {"ok"}
        assert pool.live_replicas == 2
        assert_nothing_in_flight(engine)


class FailsStartWhenAdded(ScriptedBackend):
    async def _start(self):
        if self.replica >= 1:
            raise OSError(f"no device for {self.name}")
        await super()._start()


def lone_pool(factory=ScriptedBackend, **keys):
    config = load_config({"stages": [{"id": "a", "final_output": True, **keys}]}).stages[0]
    return StagePool(config, stage_index=0, factory=factory)


async def test_add_replica_start_failure_leaves_the_pool_unchanged(autojump_clock):
    pool = lone_pool(FailsStartWhenAdded)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        with pytest.raises(StageStartError, match=r"a\[1\]: OSError: no device for a\[1\]"):
            await pool.add_replica()
        assert [r.replica for r in pool.statistics().replicas] == [0]
        assert pool.live_replicas == 1
        nursery.cancel_scope.cancel()


async def test_add_replica_cancelled_while_starting_leaves_the_pool_unchanged(autojump_clock):
    pool = lone_pool(options={"start_delay_s": 10.0})
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        with trio.move_on_after(3.0):
            await pool.add_replica()
        assert [r.replica for r in pool.statistics().replicas] == [0]
        # the next one gets a fresh index, and starts
        with trio.testing.assert_checkpoints():
            assert await pool.add_replica() == 2
        nursery.cancel_scope.cancel()


async def test_remove_replica_drains_its_requests_then_stops_it(autojump_clock):
    cfg = pipeline(stage("a", 2, options={"latency_s": 1.0, "outputs": 3}))
    async with open_engine(cfg) as engine:
        pool = engine.pools["a"]
        results = {}
        async with trio.open_nursery() as nursery:
            await start_requests(engine, nursery, ["r0", "r1"], results)
            removed = scripted_backends(engine, "a")[0]
            (on_0,) = [rid for rid in ("r0", "r1") if pool.replica_of(rid) is removed]
            nursery.start_soon(engine.remove_replica, "a", 0)
            await trio.testing.wait_all_tasks_blocked()
            assert pool.statistics().replicas[0].state == "draining"
            assert pool.live_replicas == 1
            # new requests go to the other replica while replica 0 drains
            await start_requests(engine, nursery, ["n0", "n1"], results)
            assert {pool.replica_of("n0").replica, pool.replica_of("n1").replica} == {1}
        assert set(results.values()) == {"ok"}
        assert removed.completed == [on_0] and removed.state == "stopped"
        assert [r.replica for r in pool.statistics().replicas] == [1]
        assert_nothing_in_flight(engine)


async def test_remove_replica_fails_what_did_not_finish_within_drain_timeout(autojump_clock):
    cfg = pipeline(stage("a", 2, options={"latency_s": 10.0, "outputs": 3}))
    async with open_engine(cfg) as engine:
        pool = engine.pools["a"]
        results = {}
        async with trio.open_nursery() as nursery:
            await start_requests(engine, nursery, ["r0", "r1"], results)
            (on_0,) = [rid for rid in ("r0", "r1") if pool.replica_of(rid).replica == 0]
            (on_1,) = {"r0", "r1"} - {on_0}
            t0 = trio.current_time()
            await engine.remove_replica("a", 0, drain_timeout=5.0)
            assert trio.current_time() - t0 == pytest.approx(5.0)
        assert results[on_1] == "ok"
        assert isinstance(results[on_0], ReplicaDeadError)
        assert "drain_timeout=5.0s ran out with 1 request(s) in flight" in str(results[on_0])
        assert [r.replica for r in pool.statistics().replicas] == [1]
        assert_nothing_in_flight(engine)


async def test_removing_the_last_replica_then_adding_one(autojump_clock):
    cfg = pipeline(stage("a", 1))
    async with open_engine(cfg) as engine:
        await engine.remove_replica("a", 0)
        with pytest.raises(StageError, match="stage 'a' has no live replica"):
            await run(engine, "nobody")
        assert await engine.add_replica(0) == 1
        assert (await run(engine, "served"))[-1].finished
        assert_nothing_in_flight(engine)


async def test_membership_bad_input_is_a_typed_error_naming_it(autojump_clock):
    cfg = pipeline(stage("a", 1))
    async with open_engine(cfg) as engine:
        with pytest.raises(
            InvalidRequestError,
            match=r"stage 'a' has no replica 3 to remove; its replicas are \[0\]",
        ):
            await engine.remove_replica("a", 3)
        with pytest.raises(InvalidRequestError, match="'zz' is not a stage"):
            await engine.add_replica("zz")
        with pytest.raises(InvalidRequestError, match="5 is not a stage index"):
            await engine.remove_replica(5, 0)
        # nothing else was affected
        assert engine.pools["a"].live_replicas == 1
        assert (await run(engine, "r"))[-1].finished


async def test_membership_calls_always_checkpoint(autojump_clock):
    cfg = pipeline(stage("a", 1))
    async with open_engine(cfg) as engine:
        with trio.testing.assert_checkpoints():
            index = await engine.add_replica("a")
        with trio.testing.assert_checkpoints():
            await engine.remove_replica("a", index)
        for bad in (engine.remove_replica("a", 9), engine.add_replica("nope")):
            with trio.testing.assert_checkpoints(), pytest.raises(InvalidRequestError):
                await bad
        pool = engine.pools["a"]
        with trio.testing.assert_checkpoints():
            await pool.bind("x")
        pool.release("x")


async def test_soak_of_aborts_crashes_restarts_and_membership_leaves_nothing(autojump_clock):
    rng = random.Random(1234)
    cfg = pipeline(
        stage(
            "a",
            3,
            restart="on-failure",
            max_restarts=1000,
            restart_backoff_s=0.5,
            options={"latency_s": 0.01, "outputs": 3, "record": 0},
        ),
        stage(
            "b",
            2,
            restart="on-failure",
            max_restarts=1000,
            restart_backoff_s=0.5,
            max_in_flight_per_replica=8,
            options={"latency_s": 0.01, "outputs": 2, "record": 0},
        ),
        max_requests_in_flight=64,
    )
    outcomes = {"ok": 0, "error": 0, "aborted": 0}
    async with open_engine(cfg) as engine:

        async def request(i):
            rid = f"r{i}"
            with trio.move_on_after(rng.choice([0.005, 0.02, 1.0, 1.0])) as scope:
                try:
                    outs = await run(engine, rid)
                except StageError:
                    outcomes["error"] += 1
                    return
            if scope.cancelled_caught:
                outcomes["aborted"] += 1
            else:
                assert outs[-1].finished
                outcomes["ok"] += 1

        async def chaos():
            for _ in range(40):
                await trio.sleep(rng.uniform(0.01, 0.2))
                sid = rng.choice(["a", "b"])
                pool = engine.pools[sid]
                members = [r.replica for r in pool.statistics().replicas if r.state == "ready"]
                action = rng.choice(["kill", "kill", "add", "remove"])
                if action == "kill" and members:
                    pool.replica(rng.choice(members)).kill(RuntimeError("chaos"))
                elif action == "add" and len(pool.replicas) < 5:
                    await engine.add_replica(sid)
                elif action == "remove" and len(members) > 1:
                    await engine.remove_replica(sid, rng.choice(members), drain_timeout=0.05)
                # the health report agrees with the pool at every step
                health = engine.check_health().stage(sid)
                states = [r.state for r in pool.statistics().replicas]
                assert health.live_replicas == states.count("ready") == pool.live_replicas
                assert [r.state for r in health.replicas] == states

        async with trio.open_nursery() as nursery:
            nursery.start_soon(chaos)
            for i in range(1000):
                nursery.start_soon(request, i)
                await trio.sleep(rng.uniform(0, 0.008))  # spread over the chaos
        assert sum(outcomes.values()) == 1000
        assert outcomes["ok"] > 500 and outcomes["error"] > 0 and outcomes["aborted"] > 0
        await trio.sleep(10)  # every pending restart is done
        stats = engine.statistics()
        assert stats.requests_in_flight == 0
        for st in stats.stages:
            assert st.requests_in_flight == 0 and st.requests_waiting == 0
            assert all(r.requests_in_flight == 0 for r in st.replicas)
            assert all(r.state == "ready" for r in st.replicas)
        assert sum(r.restarts for st in stats.stages for r in st.replicas) > 0
        report = engine.check_health()
        assert report.healthy and report.status == "ok" and report.unhealthy_stages == ()
        assert_nothing_in_flight(engine)
        # the engine still serves
        assert (await run(engine, "after"))[-1].finished


async def test_cancel_at_every_checkpoint_of_adding_and_removing_a_replica(autojump_clock):
    cfg = pipeline(stage("a", 1, options={"latency_s": 0.25, "start_delay_s": 1.0}))

    async def scenario(engine):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, engine, "busy")
            index = await engine.add_replica("a")
            await run(engine, "during")
            await engine.remove_replica("a", index, drain_timeout=0.1)

    def members_are_whole(engine):
        states = [r.state for r in engine.statistics().stage("a").replicas]
        # a cancelled add leaves no starting replica behind, a cancelled remove no draining
        # one (it still stopped what it removed); a completed add stays (the caller's)
        assert set(states) == {"ready"}, states

    async def tidy(engine):
        pool = engine.pools["a"]
        for r in pool.statistics().replicas[1:]:
            await engine.remove_replica("a", r.replica)

    async with open_engine(cfg) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario, invariant=members_are_whole)
        report.raise_if_failed()
        assert report.runs == report.checkpoints + 1 >= 6
        await tidy(engine)
        assert engine.pools["a"].live_replicas == 1
        assert_nothing_in_flight(engine)


async def test_wait_until_settled_returns_when_the_replacement_is_ready(autojump_clock):
    cfg = pipeline(
        stage("a", 2, restart="on-failure", restart_backoff_s=2.0, options={"start_delay_s": 3.0})
    )
    async with open_engine(cfg) as engine:
        pool = engine.pools["a"]
        with trio.testing.assert_checkpoints():
            await wait_until_settled(engine)  # nothing pending: returns at once
        t0 = trio.current_time()
        pool.replica(1).kill(RuntimeError("injected"))
        await wait_until_settled(engine)
        assert trio.current_time() - t0 == pytest.approx(5.0)
        assert [r.state for r in pool.statistics().replicas] == ["ready", "ready"]
        assert engine.check_health().status == "ok"
