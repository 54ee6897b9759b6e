import pytest
import trio
import trio.lowlevel
import trio.testing

from omni_trio import (
    CollectiveRPCTimeoutError,
    ConfigError,
    ReplicaDeadError,
    StageRPCError,
    StageStartError,
    load_config,
)
from omni_trio.backends.scripted import ScriptedBackend
from omni_trio.failures import describe_failures
from omni_trio.outputs import StageInput
from omni_trio.stages import StageAborted
from omni_trio.stages.factory import create_backend
from omni_trio.stages.pool import StagePool


def cfg(**stage):
    return load_config({"stages": [{"id": "a", "final_output": True, **stage}]})


def test_create_backend_by_name_and_dotted_path():
    c = cfg()
    assert isinstance(create_backend(c.stages[0], stage_index=0, replica=0), ScriptedBackend)
    c = cfg(backend="omni_trio.backends.scripted:ScriptedBackend")
    assert isinstance(create_backend(c.stages[0], stage_index=0, replica=1), ScriptedBackend)
    with pytest.raises(ConfigError, match="cannot import backend module 'nope_mod'"):
        create_backend(cfg(backend="nope_mod:X").stages[0], stage_index=0, replica=0)
    with pytest.raises(ConfigError, match="has no 'Nope'"):
        create_backend(
            cfg(backend="omni_trio.backends.scripted:Nope").stages[0], stage_index=0, replica=0
        )
    with pytest.raises(ConfigError, match="'builtins:dict' names the class builtins.dict"):
        create_backend(cfg(backend="builtins:dict").stages[0], stage_index=0, replica=0)
    with pytest.raises(ConfigError, match="unknown scripted option"):
        create_backend(cfg(options={"outptus": 3}).stages[0], stage_index=0, replica=0)


async def test_pool_starts_replicas_in_parallel_and_binds(autojump_clock):
    c = cfg(replicas=3, options={"start_delay_s": 4.0, "hang": True})
    pool = StagePool(c.stages[0], stage_index=0)
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        await nursery.start(pool.serve)
        assert trio.current_time() - t0 == pytest.approx(4.0)
        assert pool.live_replicas == 3

        async def run(rid):
            with pytest.raises(StageAborted):
                await run_on(pool, rid)
            aborted.append(rid)

        aborted = []
        for i in range(4):
            nursery.start_soon(run, f"r{i}")
        await trio.sleep(1)
        assert [r.requests_in_flight for r in pool.replicas] == [2, 1, 1]
        assert pool.requests_in_flight == 4
        assert pool.replica_of("r3") is pool.replicas[0]
        await pool.replica_of("r0").abort("r0")
        await trio.lowlevel.checkpoint()
        assert aborted == ["r0"]
        assert pool.requests_in_flight == 3
        for rid in ("r1", "r2", "r3"):
            await pool.replica_of(rid).abort(rid)
        assert pool.requests_in_flight == 0
        nursery.cancel_scope.cancel()
    assert pool.requests_in_flight == 0
    assert pool.live_replicas == 0


def test_describe_failures_pure():
    assert describe_failures([("a[0]", ValueError("x")), ("a[2]", OSError("y"))]) == (
        "a[0]: ValueError: x; a[2]: OSError: y"
    )
    # a replica's own start error: its reason, not "stage 'a' failed to start" again
    assert describe_failures([("a[0]", StageStartError("a", "no cluster"))]) == "a[0]: no cluster"


def with_replicas(cls, n, *, shutdown_timeout=30.0, **options):
    """A pool of ``n`` replicas of a test backend class (built like create_backend would)."""
    return StagePool(
        cfg(replicas=n, options=options).stages[0],
        stage_index=0,
        shutdown_timeout=shutdown_timeout,
        factory=cls,
    )


class SlowRpcOnReplica1(ScriptedBackend):
    async def _rpc(self, method, args, kwargs):
        if self.replica == 1:
            await trio.sleep_forever()
        return self.replica


def one_input():
    send, receive = trio.open_memory_channel(1)
    send.send_nowait(StageInput(token_ids=(1,)))
    return receive


async def ignore(out):
    pass


async def run_on(pool, rid, emit=ignore):
    """Run one request on the pool as the request core does: bound to a replica (waiting for
    one), run there, its binding released however it ends."""
    backend = await pool.bind(rid)
    try:
        await backend.run_request(rid, one_input(), None, emit)
    finally:
        pool.release(rid)


async def test_replica_death_fails_only_its_requests(autojump_clock):
    c = cfg(replicas=2, options={"crash_at_request": 1, "crash_replica": 0, "latency_s": 1.0})
    pool = StagePool(c.stages[0], stage_index=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        with pytest.raises(ReplicaDeadError, match=r"a\[0\] is dead") as info:
            await run_on(pool, "r0")
        assert info.value.replica == 0
        assert [r.state for r in pool.replicas] == ["dead", "ready"]
        await run_on(pool, "r1")  # served by the live replica
        assert pool.replica_of("r1") is None and pool.requests_in_flight == 0
        stats = pool.statistics()
        assert stats.live_replicas == 1
        assert [(r.requests_failed, r.requests_finished) for r in stats.replicas] == [
            (1, 0),
            (0, 1),
        ]
        assert [r.state for r in stats.replicas] == ["dead", "ready"]
        nursery.cancel_scope.cancel()


async def test_collective_rpc_results_in_replica_order(autojump_clock):
    pool = StagePool(cfg(replicas=3).stages[0], stage_index=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        results = await pool.collective_rpc("echo", None, None)
        assert [r["replica"] for r in results] == [0, 1, 2]
        assert all(r["args"] == [] for r in results)
        nursery.cancel_scope.cancel()


async def test_collective_rpc_errors_keep_every_cause(autojump_clock):
    pool = StagePool(cfg(replicas=3).stages[0], stage_index=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        with pytest.raises(StageRPCError, match=r"'fail'.*a\[0\].*a\[1\].*a\[2\]") as info:
            await pool.collective_rpc("fail")
        nursery.cancel_scope.cancel()
    assert [name for name, _ in info.value.failures] == ["a[0]", "a[1]", "a[2]"]
    group = info.value.__cause__
    assert isinstance(group, ExceptionGroup) and len(group.exceptions) == 3
    assert all(isinstance(e, StageRPCError) for e in group.exceptions)


async def test_collective_rpc_on_a_dead_replica_fails_naming_it(autojump_clock):
    c = cfg(replicas=2, options={"crash_at_request": 1, "crash_replica": 0})
    pool = StagePool(c.stages[0], stage_index=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        with pytest.raises(ReplicaDeadError):
            await run_on(pool, "r")
        with pytest.raises(StageRPCError, match=r"a\[0\]: ReplicaDeadError") as info:
            await pool.collective_rpc("echo")
        assert isinstance(info.value.__cause__, ReplicaDeadError)
        nursery.cancel_scope.cancel()


async def test_collective_rpc_timeout_names_silent_replicas(autojump_clock):
    pool = with_replicas(SlowRpcOnReplica1, 3)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        t0 = trio.current_time()
        with pytest.raises(CollectiveRPCTimeoutError, match=r"within 2.0s.*from: a\[1\]$") as info:
            await pool.collective_rpc("x", timeout=2.0)
        assert trio.current_time() - t0 == 2.0
        assert info.value.pending == ("a[1]",)
        nursery.cancel_scope.cancel()


async def test_init_phases_per_replica(autojump_clock):
    pool = StagePool(cfg(replicas=2).stages[0], stage_index=0)
    assert pool.init_phases() == [{}, {}]
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        phases = pool.init_phases()
        nursery.cancel_scope.cancel()
    assert len(phases) == 2
    assert all(p["start"] == 0.0 and p["ready"] >= 0.0 for p in phases)
