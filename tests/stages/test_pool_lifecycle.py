"""A pool's replicas across the session (``omni_trio.stages.pool``): the parallel start, and a
failed start cancelling and stopping the others with every cause kept; a pool outliving its
dead replicas; the parallel stop bounded by each replica's shutdown timeout, and stop failures
raised after every replica stopped."""

import pytest
import trio

from omni_trio import ReplicaDeadError, StageStartError, StageStopError
from omni_trio.backends.scripted import ScriptedBackend
from omni_trio.stages.pool import StagePool

from .test_pool import cfg, run_on, with_replicas


async def test_pool_start_failure_stops_started_replicas(autojump_clock):
    c = cfg(replicas=2, options={"fail_start": True})
    pool = StagePool(c.stages[0], stage_index=0)
    async with trio.open_nursery() as nursery:
        with pytest.raises(StageStartError, match=r"'a' failed to start: a\[\d\]: .*fail_start"):
            await nursery.start(pool.serve)
    assert all(r.state in ("dead", "stopped") for r in pool.replicas)
    assert any(r.state == "dead" for r in pool.replicas)


class FailsStartOnOdd(ScriptedBackend):
    async def _start(self):
        if self.replica % 2:
            raise OSError(f"no device for {self.name}")
        await super()._start()


class FailsStop(ScriptedBackend):
    async def _stop(self):
        raise OSError(f"cannot release {self.name}")


async def test_start_failure_cancels_sibling_starts_at_once(autojump_clock):
    pool = with_replicas(FailsStartOnOdd, 3, start_delay_s=1000.0)
    t0 = trio.current_time()
    with pytest.raises(StageStartError, match=r"'a' failed to start: a\[1\]: OSError") as info:
        await pool.serve()
    assert trio.current_time() == t0  # not when the slow siblings would have been ready
    assert isinstance(info.value.__cause__, OSError)
    assert [r.state for r in pool.replicas] == ["stopped", "dead", "stopped"]


async def test_several_start_failures_keep_every_cause(autojump_clock):
    pool = with_replicas(FailsStartOnOdd, 4)
    with pytest.raises(StageStartError, match=r"a\[1\]: OSError.*a\[3\]: OSError") as info:
        await pool.serve()
    group = info.value.__cause__
    assert isinstance(group, ExceptionGroup)
    assert sorted(str(e) for e in group.exceptions) == ["no device for a[1]", "no device for a[3]"]


async def test_pool_lives_until_shutdown_when_every_replica_died(autojump_clock):
    pool = StagePool(cfg(options={"crash_at_request": 1}).stages[0], stage_index=0)
    with trio.move_on_after(50) as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.serve)
            with pytest.raises(ReplicaDeadError):
                await run_on(pool, "r")
            with pytest.raises(ReplicaDeadError, match="no live replica"):
                await run_on(pool, "r2")
    assert scope.cancelled_caught  # serve() did not return when its last replica died


async def test_stop_bounded_by_shutdown_timeout(autojump_clock):
    pool = StagePool(
        cfg(replicas=2, options={"stop_delay_s": 1000.0}).stages[0],
        stage_index=0,
        shutdown_timeout=5.0,
    )
    t0 = trio.current_time()
    with pytest.raises(StageStopError, match=r"a\[0\]: TooSlowError.*a\[1\]: TooSlowError") as info:
        with trio.move_on_after(1):
            await pool.serve()
    assert trio.current_time() - t0 == 1.0 + 5.0  # both stopped in parallel, each bounded
    assert [name for name, _ in info.value.failures] == ["a[0]", "a[1]"]
    group = info.value.__cause__
    assert isinstance(group, ExceptionGroup)
    assert all(isinstance(e, trio.TooSlowError) for e in group.exceptions)


async def test_failing_stop_raises_stage_stop_error_after_stopping_all(autojump_clock):
    pool = with_replicas(FailsStop, 1)
    with pytest.raises(StageStopError, match=r"a\[0\]: OSError: cannot release a\[0\]") as info:
        with trio.move_on_after(1):
            await pool.serve()
    assert isinstance(info.value.__cause__, OSError)
    assert pool.replicas[0].state == "stopped"


async def test_clean_shutdown_is_plain_cancellation(autojump_clock):
    pool = StagePool(cfg(replicas=2).stages[0], stage_index=0)
    with trio.move_on_after(1) as scope:
        await pool.serve()
    assert scope.cancelled_caught
    assert [r.state for r in pool.replicas] == ["stopped", "stopped"]


async def test_stage_shutdown_timeout_overrides_the_pipelines(autojump_clock):
    stage = cfg(shutdown_timeout=2.0, options={"stop_delay_s": 1000.0}).stages[0]
    pool = StagePool(stage, stage_index=0, shutdown_timeout=50.0)
    t0 = trio.current_time()
    with pytest.raises(StageStopError, match=r"a\[0\]: TooSlowError.*shutdown_timeout=2.0"):
        with trio.move_on_after(1):
            await pool.serve()
    assert trio.current_time() - t0 == 1.0 + 2.0
