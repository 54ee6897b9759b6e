"""Every public async method of the engine, the stream and the testing helpers always
checkpoints (trio.testing.assert_checkpoints), on its normal path and on its no-op and error
paths alike; and a call cancelled before it commits its side effect commits nothing."""

from __future__ import annotations

import pytest
import trio
from trio.testing import assert_checkpoints

import omni_trio
from omni_trio import EngineClosedError, InvalidRequestError
from omni_trio.testing import assert_nothing_in_flight, scripted_pipeline, wait_until_idle


async def test_engine_methods_always_checkpoint(autojump_clock):
    engine = omni_trio.open_engine(scripted_pipeline(2, outputs=2, latency_s=1.0))
    with assert_checkpoints():
        await engine.__aenter__()
    try:
        with assert_checkpoints():
            assert await engine.abort("unknown") == []
        with assert_checkpoints():
            assert await engine.abort([]) == {}
        with assert_checkpoints():
            assert len(await engine.collective_rpc("echo")) == 2
        with assert_checkpoints(), pytest.raises(InvalidRequestError):
            await engine.collective_rpc("echo", stage_ids=["nope"])
        async with engine.generate("x", request_id="r") as stream:
            with assert_checkpoints():
                await stream.receive()
            with assert_checkpoints():
                assert len(await engine.abort("r")) >= 1
            with assert_checkpoints():
                assert await engine.abort("r") == []  # ended: a no-op
        with assert_checkpoints():
            await wait_until_idle(engine)
    finally:
        with assert_checkpoints():
            await engine.__aexit__(None, None, None)
    with assert_checkpoints():
        await engine.aclose()  # idempotent
    with assert_checkpoints():
        assert await engine.abort("r") == []
    with assert_checkpoints(), pytest.raises(EngineClosedError):
        await engine.collective_rpc("echo")


async def test_stream_methods_always_checkpoint(autojump_clock):
    async with omni_trio.open_engine(scripted_pipeline(1, outputs=3)) as engine:
        stream = engine.generate("x")
        with assert_checkpoints():
            assert await stream.abort() == []  # not admitted yet: nothing to abort
        with assert_checkpoints():
            await stream.__aenter__()
        with assert_checkpoints():
            await stream.receive()
        with assert_checkpoints():
            await stream.collect()
        with assert_checkpoints(), pytest.raises(trio.EndOfChannel):
            await stream.receive()
        with assert_checkpoints():
            await stream.__aexit__(None, None, None)
        with assert_checkpoints():
            await engine.generate("y").collect()
        never_entered = engine.generate("z")
        with assert_checkpoints():
            await never_entered.__aexit__(None, None, None)
        assert_nothing_in_flight(engine)


async def test_leaving_an_ended_request_checkpoints_and_is_not_cancellable(autojump_clock):
    # __aexit__ on an ended request: a checkpoint, and a cancelled caller still leaves cleanly
    async with omni_trio.open_engine(scripted_pipeline(1, outputs=2)) as engine:
        for cancelled in (False, True):
            stream = engine.generate("x")
            await stream.__aenter__()
            await stream.collect()
            with trio.CancelScope() as scope:
                if cancelled:
                    scope.cancel()
                with assert_checkpoints():
                    await stream.__aexit__(None, None, None)
            assert not scope.cancelled_caught
            assert stream.status == "finished"
        assert_nothing_in_flight(engine)


async def test_refused_admission_checkpoints_and_leaves_nothing(autojump_clock):
    cfg = scripted_pipeline(
        1, hang=True, engine_options={"max_requests_in_flight": 1, "admission": "reject"}
    )
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("x", request_id="r"):
            with assert_checkpoints(), pytest.raises(omni_trio.DuplicateRequestError):
                await engine.generate("x", request_id="r").__aenter__()
            with assert_checkpoints(), pytest.raises(omni_trio.EngineOverloadedError):
                await engine.generate("y").receive()
        assert engine.statistics().requests_total == 1
        assert_nothing_in_flight(engine)


async def test_cancelled_calls_commit_nothing(autojump_clock):
    async with omni_trio.open_engine(scripted_pipeline(1, hang=True)) as engine:
        async with engine.generate("x", request_id="r"):
            await trio.testing.wait_all_tasks_blocked()
            with trio.CancelScope() as scope:
                scope.cancel()
                await engine.abort("r")  # cancelled before committing: no abort
            assert scope.cancelled_caught
            assert engine.statistics().requests_in_flight == 1
            with trio.CancelScope() as scope:
                scope.cancel()
                await engine.generate("y").receive()  # cancelled before admission
            assert engine.statistics().requests_total == 1
            with trio.CancelScope() as scope:
                scope.cancel()
                await engine.collective_rpc("echo")
            assert scope.cancelled_caught
        assert_nothing_in_flight(engine)
        assert engine.statistics().requests_aborted == 1


async def test_abort_once_committed_completes_when_its_callers_wait_is_cancelled(autojump_clock):
    cfg = scripted_pipeline(1, hang=True, abort_delay_s=10.0)
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("x", request_id="r"):
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.001) as scope:
                await engine.abort("r")
            # the deadline ended the caller's wait, not the abort: the stage still cleans up
            assert scope.cancelled_caught
            assert engine.statistics().requests_in_flight == 1
        # leaving the stream waited until the abort completed in every stage
        assert engine.statistics().requests_aborted == 1
        assert_nothing_in_flight(engine)
