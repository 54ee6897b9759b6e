import pytest
import trio
import trio.lowlevel

from omni_trio import ConfigError, StageStartError, load_config
from omni_trio.outputs import ReplicaStatistics, StageInput
from omni_trio.stages._abc import StageAborted
from omni_trio.stages.pool import StagePool, choose_replica, create_backend
from omni_trio.stages.scripted import ScriptedBackend


def rs(i, alive=True, n=0):
    return ReplicaStatistics(i, alive, n, 0, 0, 0)


def test_choose_replica_least_loaded_live_first():
    assert choose_replica([]) is None
    assert choose_replica([rs(0, alive=False)]) is None
    assert choose_replica([rs(0, n=3), rs(1, n=1), rs(2, n=1)]) == 1
    assert choose_replica([rs(0, alive=False, n=0), rs(1, n=5)]) == 1
    assert choose_replica([rs(0, n=2), rs(1, n=2)]) == 0


def cfg(**stage):
    return load_config({"stages": [{"id": "a", "final_output": True, **stage}]})


def test_create_backend_by_name_and_dotted_path():
    c = cfg()
    assert isinstance(create_backend(c.stages[0], stage_index=0, replica=0), ScriptedBackend)
    c = cfg(backend="omni_trio.stages.scripted:ScriptedBackend")
    assert isinstance(create_backend(c.stages[0], stage_index=0, replica=1), ScriptedBackend)
    with pytest.raises(ConfigError, match="cannot import backend module 'nope_mod'"):
        create_backend(cfg(backend="nope_mod:X").stages[0], stage_index=0, replica=0)
    with pytest.raises(ConfigError, match="has no 'Nope'"):
        create_backend(
            cfg(backend="omni_trio.stages.scripted:Nope").stages[0], stage_index=0, replica=0
        )
    with pytest.raises(ConfigError, match="backend factory 'builtins:dict' failed"):
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
            send, receive = trio.open_memory_channel(1)
            send.send_nowait(StageInput(token_ids=(1,)))

            async def emit(out):
                pass

            with pytest.raises(StageAborted):
                await pool.run_request(rid, receive, None, emit)
            aborted.append(rid)

        aborted = []
        for i in range(4):
            nursery.start_soon(run, f"r{i}")
        await trio.sleep(1)
        assert [r.requests_in_flight for r in pool.replicas] == [2, 1, 1]
        assert pool.requests_in_flight == 4
        assert pool.replica_of("r3") is pool.replicas[0]
        partial = await pool.abort("r0")
        assert partial == []
        await trio.lowlevel.checkpoint()
        assert aborted == ["r0"]
        assert pool.requests_in_flight == 3
        for rid in ("r1", "r2", "r3"):
            await pool.abort(rid)
        assert pool.requests_in_flight == 0
        nursery.cancel_scope.cancel()
    assert pool.requests_in_flight == 0
    assert pool.live_replicas == 0


async def test_pool_start_failure_stops_started_replicas(autojump_clock):
    c = cfg(replicas=2, options={"fail_start": True})
    pool = StagePool(c.stages[0], stage_index=0)
    async with trio.open_nursery() as nursery:
        with pytest.raises(StageStartError, match=r"'a' failed to start: replica \d: .*fail_start"):
            await nursery.start(pool.serve)
    assert all(r._stopped for r in pool.replicas)
