"""Engine session: lifecycle, start-up failures, close with requests in flight, abort, rpc."""

import math

import pytest
import trio
import trio.lowlevel
from trio.testing import assert_checkpoints

import omni_trio
from omni_trio import (
    CollectiveRPCTimeoutError,
    EngineClosedError,
    EngineOverloadedError,
    InvalidRequestError,
    StageRPCError,
    StageStartError,
)
from omni_trio.testing import assert_nothing_in_flight, scripted_backends, scripted_pipeline


async def test_lifecycle_and_repr(autojump_clock):
    cfg = scripted_pipeline(["a", "b"], outputs=2)
    async with omni_trio.open_engine(cfg) as engine:
        assert "open" in repr(engine)
        assert all(r.alive for p in engine.pools.values() for r in p.replicas)
        outs = await engine.generate("x").collect()
        assert [o.stage_id for o in outs] == ["b", "b"]
    assert engine.closed
    assert "closed" in repr(engine)
    assert not any(r.alive for p in engine.pools.values() for r in p.replicas)
    with pytest.raises(EngineClosedError):
        engine.generate("x")
    with pytest.raises(EngineClosedError):
        await engine.collective_rpc("echo")
    # cleanup is idempotent: aborts after close are no-ops
    assert await engine.abort("x") == []
    assert await engine.abort(["x", "y"]) == {}
    assert engine.abort_nowait("x") is None


async def test_stages_start_in_parallel(autojump_clock):
    cfg = scripted_pipeline(3, start_delay_s=10.0)
    t0 = trio.current_time()
    async with omni_trio.open_engine(cfg) as engine:
        assert trio.current_time() - t0 == pytest.approx(10.0)
        phases = engine.init_phases()
        assert set(phases) == {"s0", "s1", "s2"}
        assert all("ready" in rows[0] for rows in phases.values())


async def test_stage_start_failure_names_stage_and_stops_others(autojump_clock):
    cfg = scripted_pipeline(
        ["a", "b", "c"], stage_options={"b": {"fail_start": True, "start_delay_s": 1.0}}
    )
    engine = omni_trio.open_engine(cfg)
    with pytest.raises(StageStartError) as info:
        async with engine:
            pytest.fail("the body must not run")
    assert info.value.stage_id == "b"
    assert "'b' failed to start" in str(info.value)
    assert "fail_start" in str(info.value)
    # the stages that did start were stopped
    for sid in ("a", "c"):
        (replica,) = engine.pools[sid].replicas
        assert not replica.alive
        assert replica._stopped


async def test_stage_start_timeout(autojump_clock):
    cfg = scripted_pipeline(
        ["a", "b"],
        stage_options={"b": {"start_delay_s": 100.0}},
        engine_options={"stage_init_timeout": 5},
    )
    t0 = trio.current_time()
    engine = omni_trio.open_engine(cfg)
    with pytest.raises(
        StageStartError, match=r"'b' failed to start: did not start within stage_init_timeout=5"
    ):
        async with engine:
            pass
    assert trio.current_time() - t0 == pytest.approx(5.0)
    assert engine.pools["a"].replicas[0]._stopped


async def test_overall_init_timeout(autojump_clock):
    cfg = scripted_pipeline(
        ["a", "b"],
        stage_options={"a": {"start_delay_s": 3.0}, "b": {"start_delay_s": 30.0}},
        engine_options={"init_timeout": 10},
    )
    with pytest.raises(
        StageStartError,
        match=r"'b' failed to start: the pipeline did not start within init_timeout=10",
    ):
        async with omni_trio.open_engine(cfg):
            pass


async def test_cancelled_while_starting_stops_everything(autojump_clock):
    cfg = scripted_pipeline(["a", "b"], stage_options={"b": {"start_delay_s": 100.0}})
    engine = omni_trio.open_engine(cfg)
    with trio.move_on_after(1.0) as scope:
        async with engine:
            pytest.fail("the body must not run")
    assert scope.cancelled_caught
    assert engine.pools["a"].replicas[0]._stopped


async def test_close_with_requests_in_flight_gives_every_consumer_a_terminal(autojump_clock):
    cfg = scripted_pipeline(["a", "b"], outputs=50, latency_s=1.0, final_outputs=["a", "b"])
    seen: dict[int, list] = {}
    errors: dict[int, BaseException] = {}

    async def consume(i, engine, task_status=trio.TASK_STATUS_IGNORED):
        seen[i] = []
        try:
            async with engine.generate(f"p{i}") as stream:
                task_status.started()
                async for out in stream:
                    seen[i].append(out)
        except EngineClosedError as exc:
            errors[i] = exc

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        async with omni_trio.open_engine(cfg) as engine:
            for i in range(10):
                await nursery.start(consume, i, engine)
            await trio.sleep(5.5)
        closed_at = trio.current_time()
    assert closed_at - t0 < 7  # bounded: no waiting for the 50 s of outputs
    for i in range(10):
        if i in errors:
            continue
        finals = {o.stage_id: o for o in seen[i] if o.finished}
        assert set(finals) == {"a", "b"}, seen[i][-3:]
        assert finals["a"].finish_reason == "abort"
        assert finals["b"].finish_reason == "abort"
    stats = engine.statistics()
    assert stats.requests_aborted == 10
    assert stats.requests_in_flight == 0
    assert stats.closed


async def test_body_exception_propagates_unwrapped(autojump_clock):
    cfg = scripted_pipeline(1)
    with pytest.raises(KeyError):
        async with omni_trio.open_engine(cfg):
            raise KeyError("mine")


async def test_overload_is_a_clear_error(autojump_clock):
    cfg = scripted_pipeline(
        1, hang=True, engine_options={"max_requests_in_flight": 2, "admission": "reject"}
    )
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("a"), engine.generate("b"):
            with pytest.raises(EngineOverloadedError, match="max_requests_in_flight.*2"):
                async with engine.generate("c"):
                    pass
            assert engine.statistics().requests_in_flight == 2
        assert_nothing_in_flight(engine)
        # capacity is back
        async with engine.generate("d"):
            assert engine.statistics().requests_in_flight == 1


async def test_bad_input_is_named_and_affects_nothing(autojump_clock):
    cfg = scripted_pipeline(["a", "b"], outputs=3)
    async with omni_trio.open_engine(cfg) as engine:
        with pytest.raises(InvalidRequestError, match="prompt must be"):
            engine.generate(3.14)
        with pytest.raises(InvalidRequestError, match="empty"):
            engine.generate("")
        with pytest.raises(InvalidRequestError, match="non-negative integers"):
            engine.generate([1, -2])
        with pytest.raises(InvalidRequestError, match="'zz' is not a stage"):
            engine.generate("x", final_stage_id="zz")
        with pytest.raises(InvalidRequestError, match="one entry per stage"):
            engine.generate("x", sampling_params=[{}, {}, {}])
        async with engine.generate("x", request_id="dup"):
            with pytest.raises(omni_trio.DuplicateRequestError, match="'dup' is already in flight"):
                async with engine.generate("y", request_id="dup"):
                    pass
        outs = await engine.generate("fine").collect()
        assert len(outs) == 3
        assert engine.statistics().requests_failed == 0
        assert_nothing_in_flight(engine)


async def test_collective_rpc_fans_out_in_stage_order(autojump_clock):
    cfg = scripted_pipeline(["a", "b", "c"], replicas={"b": 2})
    async with omni_trio.open_engine(cfg) as engine:
        res = await engine.collective_rpc("echo", args=(7,), kwargs={"k": 1})
        assert [(r["stage"], r["replica"]) for r in res] == [("a", 0), ("b", 0), ("b", 1), ("c", 0)]
        assert all(r["args"] == [7] and r["k"] == 1 for r in res)
        res = await engine.collective_rpc("echo", stage_ids=["c", 0])
        assert [r["stage"] for r in res] == ["c", "a"]
        # concurrent: three 5 s sleeps take 5 s, not 15
        t0 = trio.current_time()
        assert await engine.collective_rpc("sleep", args=(5,), stage_ids=["a", "c"]) == [5.0, 5.0]
        assert trio.current_time() - t0 == pytest.approx(5.0)
        with pytest.raises(StageRPCError, match=r"failed on a\[0\]"):
            await engine.collective_rpc("fail", stage_ids=["a"])
        with pytest.raises(StageRPCError, match="no rpc method 'nope'"):
            await engine.collective_rpc("nope", stage_ids=["a"])
        with pytest.raises(InvalidRequestError, match="'x' is not a stage"):
            await engine.collective_rpc("echo", stage_ids=["x"])


async def test_collective_rpc_timeout_names_silent_stages(autojump_clock):
    cfg = scripted_pipeline(["a", "b"])
    async with omni_trio.open_engine(cfg) as engine:
        t0 = trio.current_time()
        with pytest.raises(CollectiveRPCTimeoutError) as info:
            await engine.collective_rpc("hang", stage_ids=["b"], timeout=2.0)
        assert trio.current_time() - t0 == pytest.approx(2.0)
        assert info.value.pending == ("b[0]",)
        assert isinstance(info.value, TimeoutError)
        assert "b[0]" in str(info.value) and "2.0s" in str(info.value)
        # and the engine still works
        assert len(await engine.generate("x").collect()) == 8


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), "5", True])
async def test_collective_rpc_refuses_a_bad_timeout_naming_it(autojump_clock, bad):
    cfg = scripted_pipeline(["a", "b"])
    async with omni_trio.open_engine(cfg) as engine:
        t0 = trio.current_time()
        message = r"collective_rpc: timeout must be None or a number of seconds >= 0, not "
        with assert_checkpoints(), pytest.raises(InvalidRequestError, match=message):
            await engine.collective_rpc("sleep", args=(5,), timeout=bad)
        with assert_checkpoints(), pytest.raises(InvalidRequestError, match=message):
            await engine.pools["a"].collective_rpc("sleep", (5,), timeout=bad)
        assert trio.current_time() == t0  # nothing was called: no replica slept
        # a zero or infinite bound is a bound, and the engine still answers
        with pytest.raises(CollectiveRPCTimeoutError):
            await engine.collective_rpc("sleep", args=(5,), timeout=0)
        assert len(await engine.collective_rpc("echo", timeout=math.inf)) == 2


async def test_abort_many_and_nowait(autojump_clock):
    cfg = scripted_pipeline(1, outputs=100, latency_s=1.0)
    async with omni_trio.open_engine(cfg) as engine:
        async with trio.open_nursery() as nursery:
            streams = [engine.generate("x", request_id=f"r{i}") for i in range(3)]
            for s in streams:
                await s.__aenter__()
            await trio.sleep(2.5)
            res = await engine.abort(["r0", "r1", "unknown"])
            assert set(res) == {"r0", "r1", "unknown"}
            assert len(res["r0"]) == 2 and res["unknown"] == []
            engine.abort_nowait("r2")
            engine.abort_nowait("never-existed")
            await trio.lowlevel.checkpoint()
            for s in streams:
                await s.__aexit__(None, None, None)
            nursery.cancel_scope.cancel()
        assert_nothing_in_flight(engine)
        assert engine.statistics().requests_aborted == 3


@pytest.mark.vllm
async def test_vllm_engine_args_are_checked_off_the_event_loop_before_any_start():
    cfg = {
        "stages": [
            {
                "id": "t",
                "backend": "vllm",
                "engine_args": {"model": "tiny:thinker", "max_modle_len": 64},
                "final_output": True,
            }
        ]
    }
    engine = omni_trio.open_engine(cfg)  # synchronous and fast: vllm is not imported here
    with pytest.raises(omni_trio.ConfigError, match="'max_modle_len'.*did you mean"):
        async with engine:
            pytest.fail("started with a misspelt engine arg")
    assert engine.statistics().stages[0].live_replicas == 0


async def test_cancelled_from_outside_while_open_closes_in_order(autojump_clock):
    """A cancellation from outside (a second Ctrl-C, a deadline) ends the session like
    leaving the block: requests aborted first, then every stage stopped, in bounded time."""
    cfg = scripted_pipeline(2, hang=True, stop_delay_s=1.0)
    t0 = trio.current_time()
    with trio.move_on_after(5) as outside:
        async with omni_trio.open_engine(cfg) as engine:
            for i in range(3):
                await engine.generate("x", request_id=f"r{i}").__aenter__()  # never left
            await trio.sleep_forever()
    assert outside.cancelled_caught
    assert trio.current_time() - t0 == pytest.approx(5 + 1.0)  # the deadline, then one stop
    stats = engine.statistics()
    assert (stats.requests_aborted, stats.requests_failed) == (3, 0)
    assert sorted(scripted_backends(engine, "s0")[0].aborted) == ["r0", "r1", "r2"]
    assert all(r.state == "stopped" for p in engine.pools.values() for r in p.replicas)
    assert_nothing_in_flight(engine)
