"""Binding requests to replicas through an engine: policies, stickiness, per-replica slots,
waiting for a replica (scripted stages, MockClock)."""

import functools

import pytest
import trio
import trio.testing

from omni_trio import NoLiveReplicaError, load_config, open_engine
from omni_trio.testing import (
    assert_nothing_in_flight,
    cancel_at_every_checkpoint,
    scripted_backends,
)


def pipeline(*stages, **top):
    stages = [dict(s) for s in stages]
    for prev, st in zip(stages, stages[1:], strict=False):
        st.setdefault("inputs", [prev["id"]])
    stages[-1]["final_output"] = True
    return load_config({"stages": stages, **top})


def stage(sid, replicas=1, **keys):
    options = keys.pop("options", {})
    return {"id": sid, "replicas": replicas, "options": {"outputs": 2, **options}, **keys}


async def run(engine, rid, results=None):
    outs = await engine.generate("hi", request_id=rid).collect()
    if results is not None:
        results.append(rid)
    return outs


def completed_per_replica(engine, sid):
    return [len(b.completed) for b in scripted_backends(engine, sid)]


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin"])
async def test_sequential_requests_cycle_over_replicas(autojump_clock, policy):
    cfg = pipeline(stage("a", 4, lb_policy=policy, options={"latency_s": 1.0}))
    async with open_engine(cfg) as engine:
        order = []
        for i in range(8):
            async with engine.generate("hi", request_id=f"r{i}") as stream:
                await stream.receive()
                order.append(engine.pools["a"].replica_of(f"r{i}").replica)
                await stream.collect()
        # least_loaded ties go round-robin, not always to replica 0
        assert order == [0, 1, 2, 3, 0, 1, 2, 3]
        assert completed_per_replica(engine, "a") == [2, 2, 2, 2]


async def random_choices(seed, n=24, *, at_pipeline=False):
    slow = {"latency_s": 1.0}
    if at_pipeline:
        cfg = pipeline(stage("a", 3, options=slow), lb_policy="random", lb_seed=seed)
    else:
        cfg = pipeline(stage("a", 3, lb_policy="random", options=slow), lb_seed=seed)
    async with open_engine(cfg) as engine:
        chosen = []
        for i in range(n):
            async with engine.generate("hi", request_id=f"r{i}") as stream:
                await stream.receive()
                chosen.append(engine.pools["a"].replica_of(f"r{i}").replica)
                await stream.collect()
        assert_nothing_in_flight(engine)
    return chosen


async def test_random_policy_is_reproducible_with_lb_seed(autojump_clock):
    first = await random_choices(1)
    assert first == await random_choices(1)
    # the pipeline's lb_policy is every stage's default
    assert first == await random_choices(1, at_pipeline=True)
    assert first != await random_choices(2)
    assert set(first) == {0, 1, 2}


async def test_bindings_are_sticky_for_the_request_on_every_stage(autojump_clock):
    cfg = pipeline(
        stage("a", 3, options={"latency_s": 1.0, "outputs": 3}),
        stage("b", 3, options={"latency_s": 1.0, "outputs": 3}, stream_input=True),
    )
    async with open_engine(cfg) as engine:
        seen = {"a": set(), "b": set()}
        async with engine.generate("hi", request_id="r") as stream:
            async for _ in stream:
                for sid in seen:
                    backend = engine.pools[sid].replica_of("r")
                    if backend is not None:
                        seen[sid].add(backend.replica)
        assert all(len(replicas) == 1 for replicas in seen.values())
        # each stage ran it on exactly one replica, start to end
        for sid in seen:
            assert sum(len(b.completed) for b in scripted_backends(engine, sid)) == 1
        assert_nothing_in_flight(engine)


async def test_per_replica_slots_make_requests_wait_first_in_first_out(autojump_clock):
    cfg = pipeline(stage("a", 2, max_in_flight_per_replica=1, options={"latency_s": 1.0}))
    async with open_engine(cfg) as engine:
        done = []
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(run, engine, f"r{i}", done)
                await trio.testing.wait_all_tasks_blocked()
            stats = engine.statistics().stage("a")
            assert stats.requests_in_flight == 2
            assert stats.requests_waiting == 4
            assert [r.requests_in_flight for r in stats.replicas] == [1, 1]
        # two at a time, in admission order (within a pair, both end at the same instant)
        assert [set(done[i : i + 2]) for i in (0, 2, 4)] == [
            {"r0", "r1"},
            {"r2", "r3"},
            {"r4", "r5"},
        ]
        assert engine.statistics().stage("a").requests_waiting == 0
        assert_nothing_in_flight(engine)


async def test_a_cancelled_waiter_leaves_no_trace(autojump_clock):
    cfg = pipeline(stage("a", 1, max_in_flight_per_replica=1, options={"latency_s": 1.0}))
    async with open_engine(cfg) as engine:
        done = []
        cancelled = trio.CancelScope()

        async def second():
            with cancelled:
                await run(engine, "second", done)

        async with trio.open_nursery() as nursery:
            for task in (functools.partial(run, engine, "first", done), second):
                nursery.start_soon(task)
                await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(run, engine, "third", done)
            await trio.testing.wait_all_tasks_blocked()
            assert engine.statistics().stage("a").requests_waiting == 2
            cancelled.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert engine.statistics().stage("a").requests_waiting == 1
        assert done == ["first", "third"]
        assert scripted_backends(engine, "a")[0].completed == ["first", "third"]
        assert_nothing_in_flight(engine)


async def test_no_live_replica_and_no_restart_fails_at_once(autojump_clock):
    cfg = pipeline(stage("a", 1))
    async with open_engine(cfg) as engine:
        engine.pools["a"].replica(0).kill(RuntimeError("injected"))
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        with pytest.raises(NoLiveReplicaError, match="stage 'a' has no live replica"):
            await run(engine, "r")
        assert trio.current_time() == t0
        assert_nothing_in_flight(engine)


async def test_a_request_waits_for_a_restarting_replica(autojump_clock):
    cfg = pipeline(
        stage(
            "a",
            1,
            restart="on-failure",
            restart_backoff_s=3.0,
            options={"start_delay_s": 2.0},
        )
    )
    async with open_engine(cfg) as engine:
        pool = engine.pools["a"]
        pool.replica(0).kill(RuntimeError("injected"))
        await trio.testing.wait_all_tasks_blocked()
        assert pool.statistics().replicas[0].state == "restarting"
        health = engine.check_health()
        assert not health.healthy and health.unhealthy_stages == ("a",)
        t0 = trio.current_time()
        outs = await run(engine, "r")
        assert outs[-1].finished
        # backoff 3 s, then the replacement's 2 s start; the request waited, event-driven
        assert trio.current_time() - t0 == pytest.approx(5.0)
        stats = pool.statistics().replicas[0]
        assert (stats.state, stats.restarts, stats.failures) == ("ready", 1, 1)
        assert stats.last_error == "RuntimeError: injected"
        assert engine.check_health().healthy
        assert_nothing_in_flight(engine)


async def test_waiting_for_a_restarting_replica_times_out(autojump_clock):
    cfg = pipeline(
        stage(
            "a",
            1,
            restart="on-failure",
            restart_backoff_s=30.0,
            restart_backoff_max_s=30.0,
            replica_wait_timeout_s=4.0,
        )
    )
    async with open_engine(cfg) as engine:
        engine.pools["a"].replica(0).kill(RuntimeError("injected"))
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        with pytest.raises(NoLiveReplicaError, match=r"replica_wait_timeout_s=4\.0"):
            await run(engine, "r")
        assert trio.current_time() - t0 == pytest.approx(4.0)
        assert engine.statistics().stage("a").requests_waiting == 0
        assert_nothing_in_flight(engine)


async def test_waiters_fail_at_once_when_no_replica_is_on_its_way_any_more(autojump_clock):
    cfg = pipeline(stage("a", 1, restart="on-failure", restart_backoff_s=10.0))
    async with open_engine(cfg) as engine:
        pool = engine.pools["a"]
        pool.replica(0).kill(RuntimeError("injected"))
        await trio.testing.wait_all_tasks_blocked()
        failed_at = []

        async def waiting():
            with pytest.raises(NoLiveReplicaError, match="stage 'a' has no live replica"):
                await run(engine, "w")
            failed_at.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiting)
            await trio.sleep(1.0)
            assert pool.statistics().requests_waiting == 1
            # the restarting replica is removed: nothing left to wait for
            await engine.remove_replica("a", 0)
            t_removed = trio.current_time()
        assert failed_at == [t_removed]
        assert pool.statistics().replicas == ()
        assert_nothing_in_flight(engine)


async def test_restarts_stop_at_max_restarts(autojump_clock):
    cfg = pipeline(stage("a", 1, restart="on-failure", max_restarts=1, restart_backoff_s=1.0))
    async with open_engine(cfg) as engine:
        pool = engine.pools["a"]
        pool.replica(0).kill(RuntimeError("first"))
        assert (await run(engine, "served"))[-1].finished  # by the replacement
        pool.replica(0).kill(RuntimeError("second"))
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(NoLiveReplicaError):
            await run(engine, "late")
        stats = pool.statistics().replicas[0]
        assert (stats.state, stats.restarts, stats.failures, stats.last_error) == (
            "dead",
            1,
            2,
            "RuntimeError: second",
        )
        assert_nothing_in_flight(engine)


async def test_cancel_at_every_checkpoint_while_waiting_for_a_replica_slot(autojump_clock):
    cfg = pipeline(
        stage("a", 1, max_in_flight_per_replica=1, options={"latency_s": 0.25, "outputs": 3}),
        stage("b", 2, max_in_flight_per_replica=1, options={"latency_s": 0.25, "outputs": 2}),
    )

    async def scenario(engine):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, engine, "holder")
            await run(engine, "waiter")

    def nothing_waits(engine):
        for st in engine.statistics().stages:
            assert st.requests_waiting == 0, f"{st.stage_id}: {st.requests_waiting} waiting"
            assert [r.state for r in st.replicas] == ["ready"] * len(st.replicas)

    async with open_engine(cfg) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario, invariant=nothing_waits)
        report.raise_if_failed()
        assert report.runs == report.checkpoints + 1 >= 6
        assert_nothing_in_flight(engine)


async def test_a_slow_consumer_slows_only_itself(autojump_clock):
    # 2 stages x 2 replicas, a small window: one consumer stops reading after its first
    # output while 8 others share the same replicas
    cfg = pipeline(
        stage("a", 2, options={"latency_s": 0.1, "outputs": 20}),
        stage("b", 2, options={"latency_s": 0.1, "outputs": 20}),
        output_buffer=2,
    )

    async def timed(engine, rid, took):
        t0 = trio.current_time()
        await run(engine, rid)
        took[rid] = trio.current_time() - t0

    async with open_engine(cfg) as engine:
        alone = {}
        await timed(engine, "alone", alone)
        took = {}
        async with engine.generate("hi", request_id="slow") as slow:
            await slow.receive()
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(timed, engine, f"r{i}", took)
            # every other request took what it takes alone (the replicas are not batching
            # engines: a request's time is its own latency), while "slow" is held back
            assert len(took) == 8
            assert all(t == pytest.approx(alone["alone"]) for t in took.values())
            assert slow.status == "running"
            # bounded by its window, not running ahead: what it reads before the clock moves
            # (a stage makes each further output 0.1 s later) is its window of 2 and the one
            # output its stage waits to deliver
            t0 = trio.current_time()
            rest = [(out, trio.current_time() == t0) async for out in slow]
            assert [at_once for _, at_once in rest[:4]] == [True, True, True, False]
        assert rest[-1][0].finished and len(rest) + 1 == 20
        assert_nothing_in_flight(engine)
