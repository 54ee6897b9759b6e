"""The replica contract of ``StageBackend``: state, death, the emit contract, RPCs, stop."""

import logging

import pytest
import trio
import trio.lowlevel
import trio.testing

from omni_trio import ReplicaDeadError, StageError, StageRPCError, StageStopError, load_config
from omni_trio.backends.scripted import ScriptedBackend
from omni_trio.outputs import StageInput, StageOutput
from omni_trio.stages import StageAborted
from omni_trio.stages._running import request_outcome
from omni_trio.stages.backend import StageBackend
from omni_trio.stages.replica import death_reason


def stage(**options):
    c = load_config({"stages": [{"id": "a", "final_output": True, "options": options}]})
    return c.stages[0]


def backend(cls=ScriptedBackend, **options):
    return cls(stage(**options), stage_index=0)


def one_chunk():
    send, receive = trio.open_memory_channel(1)
    send.send_nowait(StageInput(token_ids=(7,)))
    send.close()
    return receive


async def run(b, rid, outs=None):
    """Run one request; its outputs (also appended to ``outs`` as they come)."""
    outs = [] if outs is None else outs

    async def emit(o):
        outs.append(o)

    await b.run_request(rid, one_chunk(), None, emit)
    return outs


class ServeEndsOnEvent(ScriptedBackend):
    """``_serve_forever`` (a backend's reader) raises or returns when ``end`` is set."""

    how = "raise"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.end = trio.Event()

    async def _serve_forever(self):
        await self.end.wait()
        if self.how == "raise":
            raise OSError("reader lost its connection")


class ServeReturns(ServeEndsOnEvent):
    how = "return"


class ServeRaisesInNursery(ServeEndsOnEvent):
    """The reader runs beside a helper task in a nursery, as the ray, vllm and torch
    backends' do: what it raises reaches ``serve`` wrapped in a group of one."""

    async def _serve_forever(self):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            await super()._serve_forever()


class EmitsTwice(ScriptedBackend):
    async def _run(self, request_id, inputs, sampling_params, emit):
        await emit(StageOutput(token_ids=(1,), finished=True, finish_reason="stop"))
        await emit(StageOutput(token_ids=(2,)))


class FinishesThenLingers(ScriptedBackend):
    async def _run(self, request_id, inputs, sampling_params, emit):
        await emit(StageOutput(token_ids=(1,), finished=True, finish_reason="stop"))
        await trio.sleep_forever()  # cleanup that an abort or a death interrupts


class StopFails(ScriptedBackend):
    async def _stop(self):
        raise OSError(f"cannot release {self.name}")


class RecordsRpcCancel(ScriptedBackend):
    rpc_cancelled = False

    async def _rpc(self, method, args, kwargs):
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self.rpc_cancelled = True
            raise


def test_request_outcome_pure():
    kw = dict(violated=False, failed=False, cancelled=False, finished=True, dead=False)
    assert request_outcome(**kw) == "finished"
    assert request_outcome(**{**kw, "violated": True}) == "violation"
    assert request_outcome(**{**kw, "failed": True}) == "error"
    assert request_outcome(**{**kw, "failed": True, "dead": True}) == "dead"
    assert request_outcome(**{**kw, "cancelled": True, "finished": False}) == "aborted"
    assert request_outcome(**{**kw, "cancelled": True, "finished": False, "dead": True}) == "dead"
    # a cancellation after the finished output was delivered does not undo it
    assert request_outcome(**{**kw, "cancelled": True, "dead": True}) == "finished"


async def test_state_starting_ready_stopped(autojump_clock):
    b = backend(start_delay_s=5.0)
    assert b.state == "starting" and not b.alive
    async with trio.open_nursery() as nursery:
        nursery.start_soon(b.serve)
        await trio.sleep(1)
        assert b.state == "starting" and b.statistics().state == "starting"
        await trio.sleep(5)
        assert b.state == "ready" and b.alive and b.statistics().state == "ready"
        nursery.cancel_scope.cancel()
    assert b.state == "stopped" and not b.alive
    assert b.statistics().state == "stopped" and not b.statistics().alive
    assert set(b.init_phases()) == {"start", "ready"} and b.init_phases()["start"] == 0.0


async def test_failed_start_is_dead_and_raises(autojump_clock):
    b = backend(fail_start=True)
    with pytest.raises(StageError, match="fail_start"):
        await b.serve()
    assert b.state == "dead" and b.stop_failure is None


@pytest.mark.parametrize("cls", [ServeEndsOnEvent, ServeReturns, ServeRaisesInNursery])
async def test_death_after_readiness_fails_bound_requests(autojump_clock, caplog, cls):
    b = backend(cls, hang=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        errors = []

        async def request(rid):
            with pytest.raises(ReplicaDeadError) as info:
                await run(b, rid)
            errors.append(info.value)

        nursery.start_soon(request, "r1")
        nursery.start_soon(request, "r2")
        await trio.sleep(1)
        assert b.requests_in_flight == 2
        with caplog.at_level(logging.WARNING, logger="omni_trio.stages.backend"):
            b.end.set()
            await trio.sleep(1)
    # serve() returned by itself: the death is recorded, not raised
    assert b.state == "dead"
    assert sorted(e.request_id for e in errors) == ["r1", "r2"]
    assert all(e.replica == 0 and e.stage_id == "a" and "a[0]" in str(e) for e in errors)
    if cls is not ServeReturns:
        # the reader's own error, not the nursery's group around it
        assert "is dead: OSError: reader lost its connection" in str(errors[0])
        assert isinstance(b.death, OSError)
    stats = b.statistics()
    assert (stats.requests_failed, stats.requests_aborted, stats.requests_in_flight) == (2, 0, 0)
    died = [r for r in caplog.records if "died" in r.getMessage()]
    assert len(died) == 1 and "a[0]" in died[0].getMessage()


async def test_death_via_die_fails_request_and_stops_replica(autojump_clock):
    b = backend(crash_at_request=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        assert len(await run(b, "ok")) == 8
        with pytest.raises(ReplicaDeadError, match=r"replica a\[0\] is dead.*scripted crash"):
            await run(b, "crash")
        await trio.sleep(1)
        # a dead replica is stopped at once (serve returned): the nursery can exit
    assert b.state == "dead"
    stats = b.statistics()
    assert (stats.requests_finished, stats.requests_failed, stats.requests_aborted) == (1, 1, 0)
    with pytest.raises(ReplicaDeadError, match="is dead"):
        await run(b, "after")


async def test_emit_after_finished_fails_request_naming_replica(autojump_clock):
    b = backend(EmitsTwice)
    outs = []

    async def emit(o):
        outs.append(o)

    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        with pytest.raises(StageError, match=r"a\[0\].*stage 'a'.*after its finished") as info:
            await b.run_request("r", one_chunk(), None, emit)
        nursery.cancel_scope.cancel()
    assert info.value.stage_id == "a" and info.value.request_id == "r"
    assert [o.token_ids for o in outs] == [(1,)]  # the extra output went nowhere
    stats = b.statistics()
    assert (stats.requests_failed, stats.requests_finished) == (1, 0)


async def test_abort_after_finished_output_counts_finished(autojump_clock):
    b = backend(FinishesThenLingers)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        done = []
        emitted = []

        async def request():
            done.append(await run(b, "r", emitted))

        nursery.start_soon(request)
        await trio.sleep(1)
        await b.abort("r")
        assert [o.finished for o in emitted] == [True]
        await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    assert len(done) == 1  # run_request returned normally: no StageAborted after finishing
    assert (b.statistics().requests_finished, b.statistics().requests_aborted) == (1, 0)


async def test_abort_unfinished_raises_stage_aborted(autojump_clock):
    b = backend(hang=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)

        async def request():
            with pytest.raises(StageAborted):
                await run(b, "r")

        nursery.start_soon(request)
        await trio.sleep(1)
        await b.abort("r")
        assert b.requests_in_flight == 0  # dropped before abort() returned
        with trio.testing.assert_checkpoints():
            await b.abort("unknown")  # a no-op
        nursery.cancel_scope.cancel()
    assert b.statistics().requests_aborted == 1


async def test_rpc_pending_across_death_fails_at_once(autojump_clock):
    b = backend(crash_at_request=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        got = []

        async def rpc():
            # (a guard: without the fix the call would hang; on the mock clock this is instant)
            with (
                trio.fail_after(100),
                pytest.raises(ReplicaDeadError, match=r"a\[0\] is dead") as info,
            ):
                await b.collective_rpc("hang")
            got.append((info.value, trio.current_time()))

        nursery.start_soon(rpc)
        await trio.sleep(1)
        with pytest.raises(ReplicaDeadError):
            await run(b, "crash")
        await trio.lowlevel.checkpoint()
    assert len(got) == 1
    assert got[0][1] == 1.0  # failed when the replica died, not at some timeout
    assert got[0][0].replica == 0 and got[0][0].stage_id == "a"


async def test_rpc_on_dead_or_stopped_replica_never_answers(autojump_clock):
    dead = backend(crash_at_request=1)
    stopped = backend()
    async with trio.open_nursery() as nursery:
        await nursery.start(dead.serve)
        await nursery.start(stopped.serve)
        with pytest.raises(ReplicaDeadError):
            await run(dead, "crash")
        nursery.cancel_scope.cancel()
    with pytest.raises(ReplicaDeadError, match=r"a\[0\] is dead"):
        await dead.collective_rpc("echo")
    with pytest.raises(ReplicaDeadError, match=r"a\[0\] is stopped"):
        await stopped.collective_rpc("echo")


async def test_rpc_pending_at_stop_fails(autojump_clock):
    b = backend()
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)

        async def rpc():
            with trio.fail_after(100), pytest.raises(ReplicaDeadError, match="is stopped"):
                await b.collective_rpc("hang")

        async with trio.open_nursery() as callers:
            callers.start_soon(rpc)
            await trio.sleep(1)
            nursery.cancel_scope.cancel()


async def test_rpc_none_args_and_errors(autojump_clock):
    b = backend()
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        echo = await b.collective_rpc("echo", None, None)
        assert echo == {"stage": "a", "replica": 0, "args": []}
        assert (await b.collective_rpc("echo", [1], {"k": 2}))["k"] == 2
        with pytest.raises(StageRPCError, match=r"'fail'.*a\[0\]") as info:
            await b.collective_rpc("fail")
        assert isinstance(info.value.__cause__, StageError)
        with pytest.raises(StageRPCError, match="no rpc method 'nope'"):
            await b.collective_rpc("nope")
        nursery.cancel_scope.cancel()


async def test_cancelling_rpc_caller_cancels_the_call(autojump_clock):
    b = backend(RecordsRpcCancel)
    async with trio.open_nursery() as nursery:
        await nursery.start(b.serve)
        with trio.move_on_after(3) as scope:
            await b.collective_rpc("anything")
        assert scope.cancelled_caught and b.rpc_cancelled
        assert b.alive  # the caller's cancellation is not the replica's death
        nursery.cancel_scope.cancel()


async def test_stop_overrun_raises_stage_stop_error(autojump_clock):
    b = backend(stop_delay_s=100.0)
    b.shutdown_timeout = 5.0
    t0 = trio.current_time()
    with pytest.raises(StageStopError, match=r"a\[0\].*shutdown_timeout=5.0") as info:
        with trio.move_on_after(1):  # the shutdown signal
            await b.serve()
    assert trio.current_time() - t0 == 1.0 + 5.0
    ((name, cause),) = info.value.failures
    assert name == "a[0]" and isinstance(cause, trio.TooSlowError)
    assert b.stop_failure is cause and b.state == "stopped"


async def test_failing_stop_raises_stage_stop_error(autojump_clock):
    b = backend(StopFails)
    with pytest.raises(StageStopError, match=r"a\[0\]: OSError: cannot release") as info:
        with trio.move_on_after(1):
            await b.serve()
    assert isinstance(info.value.__cause__, OSError)


async def test_early_errors_still_checkpoint(autojump_clock):
    b = backend()  # never started
    assert b.state == "starting"
    with trio.testing.assert_checkpoints():
        with pytest.raises(ReplicaDeadError, match=r"a\[0\] is starting, not ready"):
            await b.collective_rpc("echo")
    with trio.testing.assert_checkpoints():
        with pytest.raises(ReplicaDeadError, match="not ready"):
            await run(b, "r")
    with trio.testing.assert_checkpoints():
        await b.abort("r")


class NoInteractions(ScriptedBackend):
    _interact = StageBackend._interact


def test_takes_interactions_says_whether_the_backend_implements_interact():
    # a Ray actor tells its caller this at start: only then does each request announce itself
    assert backend().takes_interactions
    assert not backend(NoInteractions).takes_interactions


def test_death_reason_is_the_one_error_inside_a_group_of_one():
    boom = OSError("boom")
    assert death_reason(boom) is boom
    assert death_reason(ExceptionGroup("nursery", [ExceptionGroup("inner", [boom])])) is boom
    several = ExceptionGroup("nursery", [boom, ValueError("bad")])
    assert death_reason(several) is several
