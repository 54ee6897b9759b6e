"""One regression test per seam issue 7 found: a request with two owners, routing inside
backends, errors that vanished, RPCs that outlived their replica or the engine, start and
stop failures, and unchecked arguments. Scripted stages (and small user backends) on the
MockClock."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import trio
import trio.testing

import omni_trio
from omni_trio import (
    EngineClosedError,
    InvalidRequestError,
    ReplicaDeadError,
    StageError,
    StageStartError,
    StageStopError,
    load_config,
)
from omni_trio.observer import EngineObserver
from omni_trio.testing import assert_nothing_in_flight, scripted_backends, scripted_pipeline

USER_BACKENDS = """
import trio
from omni_trio import StageBackend, StageError, StageOutput


class FailOnAbort(StageBackend):
    # emits one output, then raises a request-scoped error when it is aborted
    async def _start(self):
        pass

    async def _run(self, request_id, inputs, sampling_params, emit):
        await emit(StageOutput(token_ids=(1,), text="first"))
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            raise StageError("cleanup failed while aborting", stage_id=self.stage_id)


class Mortal(StageBackend):
    # dies after readiness when told to (rpc "die" with "raise", "return" or "die")
    async def _start(self):
        self.kill = trio.Event()
        self.how = None

    async def _serve_forever(self):
        await self.kill.wait()
        if self.how == "raise":
            raise RuntimeError("the engine process vanished")
        if self.how == "die":
            self._die(RuntimeError("the reader failed"))
            await trio.sleep_forever()
        # "return": _serve_forever returning is a death too

    async def _run(self, request_id, inputs, sampling_params, emit):
        await emit(StageOutput(token_ids=(1,), text="first"))
        await trio.sleep_forever()

    async def _rpc(self, method, args, kwargs):
        if method == "die":
            self.how = args[0]
            self.kill.set()
            return None
        if method == "hang":
            await trio.sleep_forever()
        if method == "echo":
            return list(args)
        return await super()._rpc(method, args, kwargs)


class BadStop(StageBackend):
    async def _start(self):
        pass

    async def _stop(self):
        raise OSError(f"could not release replica {self.replica}")

    async def _run(self, request_id, inputs, sampling_params, emit):
        await emit(StageOutput(token_ids=(1,), finished=True, finish_reason="stop"))


class FailStartReplica1(StageBackend):
    async def _start(self):
        if self.replica == 1:
            raise RuntimeError("replica 1 cannot start")
        await trio.sleep(100)

    async def _run(self, request_id, inputs, sampling_params, emit):
        await emit(StageOutput(finished=True, finish_reason="stop"))


def broken_processor(upstream, *, final, options):
    raise KeyError("the talker prompt template has no slot for this")


def picky_processor(upstream, *, final, options):
    from omni_trio import InvalidRequestError

    raise InvalidRequestError("the prompt asks for a voice this talker does not have")
"""


@pytest.fixture
def backends(user_module):
    return user_module(USER_BACKENDS)


def one_stage(backend: str, **extra):
    return load_config({"stages": [{"id": "a", "backend": backend, "final_output": True, **extra}]})


# -- bullet 1: a consumer cancelled while entering leaks nothing --
async def test_consumer_cancelled_before_entering_admits_nothing(autojump_clock):
    async with omni_trio.open_engine(scripted_pipeline(2, outputs=4)) as engine:
        with trio.CancelScope() as scope:
            scope.cancel()
            async with engine.generate("x"):
                pytest.fail("the body of a cancelled consumer ran")
        assert engine.statistics().requests_total == 0
        with trio.move_on_after(0):
            async with engine.generate("y") as stream:
                await stream.receive()
        assert_nothing_in_flight(engine)


# -- bullet 2: exactly one terminal per output stage --
@pytest.mark.parametrize("how", ["abort", "close"])
async def test_abort_or_close_right_after_a_stages_last_output(autojump_clock, how):
    cfg = scripted_pipeline(
        2, outputs=2, final_outputs=["s0", "s1"], stage_options={"s1": {"latency_s": 5.0}}
    )
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate([1, 2], request_id="r") as stream:
            seen = []
            while not (seen and seen[-1].stage_id == "s0" and seen[-1].finished):
                seen.append(await stream.receive())
            if how == "abort":
                await engine.abort("r")
            else:
                await engine.aclose()
            seen.extend([out async for out in stream])
    terminals = Counter(o.stage_id for o in seen if o.finished)
    assert terminals == {"s0": 1, "s1": 1}
    assert [o.finish_reason for o in seen if o.finished] == ["length", "abort"]
    assert engine.statistics().requests_aborted == 1


# -- bullet 3: an error during an abort does not vanish --
async def test_stage_error_during_abort_reaches_everyone(autojump_clock, backends, caplog):
    caplog.set_level(logging.WARNING, logger="omni_trio")
    async with omni_trio.open_engine(one_stage(f"{backends}:FailOnAbort")) as engine:
        consumer_error: list[BaseException] = []

        async def consume(task_status=trio.TASK_STATUS_IGNORED):
            async with engine.generate("x", request_id="r") as stream:
                await stream.receive()
                task_status.started()
                try:
                    async for _ in stream:
                        pass
                except StageError as exc:
                    consumer_error.append(exc)

        async with trio.open_nursery() as nursery:
            await nursery.start(consume)
            with pytest.raises(StageError, match="cleanup failed") as info:
                await engine.abort("r")
        assert [o.text for o in info.value.partial_outputs] == ["first"]
        assert info.value.stage_id == "a" and info.value.request_id == "r"
        assert consumer_error and consumer_error[0] is info.value
        stats = engine.statistics()
        assert (stats.requests_failed, stats.requests_aborted) == (1, 0)
        assert stats.stage("a").replicas[0].requests_failed == 1
        assert stats.stage("a").replicas[0].requests_aborted == 0
        assert "'r' failed in stage 'a' while being aborted" in caplog.text
        assert_nothing_in_flight(engine)


# -- bullet 4: a replica dying after readiness fails its requests with ReplicaDeadError --
@pytest.mark.parametrize("how", ["raise", "return", "die"])
async def test_replica_death_is_replica_dead_error(autojump_clock, backends, how):
    cfg = one_stage(f"{backends}:Mortal", replicas=2)
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("x", request_id="r") as stream:
            await stream.receive()
            replica = engine.pools["a"].replica_of("r")
            assert replica is not None
            await replica.collective_rpc("die", [how])
            with pytest.raises(ReplicaDeadError) as info:
                await stream.receive()
        assert info.value.stage_id == "a" and info.value.replica == replica.replica
        assert replica.state == "stopped" or replica.state == "dead"
        stats = engine.statistics()
        assert (stats.requests_failed, stats.requests_aborted) == (1, 0)
        assert stats.stage("a").replicas[replica.replica].requests_failed == 1
        # the other replica keeps serving
        async with engine.generate("y") as stream:
            assert (await stream.receive()).text == "first"
        assert_nothing_in_flight(engine)


# -- bullet 5: RPCs live no longer than their replica and the engine --
async def test_pending_rpc_fails_when_its_replica_dies(autojump_clock, backends):
    async with omni_trio.open_engine(one_stage(f"{backends}:Mortal")) as engine:
        (replica,) = engine.pools["a"].replicas
        async with trio.open_nursery() as nursery:

            async def die_later() -> None:
                await trio.testing.wait_all_tasks_blocked()
                await replica.collective_rpc("die", ["die"])

            nursery.start_soon(die_later)
            t0 = trio.current_time()
            with pytest.raises(ReplicaDeadError, match=r"a\[0\]"):
                await engine.collective_rpc("hang")
            assert trio.current_time() == t0  # at once, not at a timeout
        # a dead replica never answers
        with pytest.raises(ReplicaDeadError):
            await engine.collective_rpc("echo", args=[1])


async def test_pending_rpc_fails_when_the_engine_closes(autojump_clock):
    outcome: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        async with omni_trio.open_engine(scripted_pipeline(2)) as engine:

            async def call() -> None:
                try:
                    await engine.collective_rpc("hang")
                except EngineClosedError as exc:
                    outcome.append(exc)

            nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
        # close returned: the RPC is no longer pending, it failed
        assert len(outcome) == 1 and "closed while collective_rpc('hang')" in str(outcome[0])


async def test_collective_rpc_none_means_no_arguments(autojump_clock):
    async with omni_trio.open_engine(scripted_pipeline(2)) as engine:
        results = await engine.collective_rpc("echo", args=None, kwargs=None, stage_ids=[1])
        assert results == [{"stage": "s1", "replica": 0, "args": []}]


# -- bullet 6: routing runs outside backends --
async def test_input_processor_bug_is_the_downstream_stages_error(autojump_clock, backends):
    cfg = load_config(
        {
            "stages": [
                {"id": "a", "options": {"outputs": 2}},
                {
                    "id": "b",
                    "inputs": ["a"],
                    "input_processor": f"{backends}:broken_processor",
                    "final_output": True,
                },
            ]
        }
    )
    async with omni_trio.open_engine(cfg) as engine:
        with pytest.raises(StageError, match="input processor of stage 'b'") as info:
            await engine.generate("x", request_id="r").collect()
        assert info.value.stage_id == "b" and info.value.request_id == "r"
        assert isinstance(info.value.__cause__, KeyError)
        a_replica = engine.statistics().stage("a").replicas[0]
        assert a_replica.requests_failed == 0  # nothing counted against stage a
        assert engine.statistics().requests_failed == 1
        assert_nothing_in_flight(engine)


@pytest.mark.parametrize(
    ("a_output", "stream_input"),
    [(False, False), (False, True), (True, False)],
    ids=["collected", "streamed", "routed"],
)
async def test_input_processor_rejecting_the_request_reaches_the_consumer_typed(
    autojump_clock, backends, a_output, stream_input
):
    cfg = load_config(
        {
            "stages": [
                {"id": "a", "options": {"outputs": 2}, "final_output": a_output},
                {
                    "id": "b",
                    "inputs": ["a"],
                    "input_processor": f"{backends}:picky_processor",
                    "stream_input": stream_input,
                    "final_output": True,
                },
            ]
        }
    )
    async with omni_trio.open_engine(cfg) as engine:
        with pytest.raises(InvalidRequestError) as info:
            await engine.generate("x", request_id="r").collect()
        assert not isinstance(info.value, StageError)
        assert str(info.value) == (
            "the input processor of stage 'b' rejected request 'r': the prompt asks for a "
            "voice this talker does not have"
        )
        assert isinstance(info.value.__cause__, InvalidRequestError)
        stats = engine.statistics()
        assert stats.stage("a").replicas[0].requests_failed == 0  # not stage a's failure
        assert stats.requests_failed == 1
        assert len(await engine.generate("x", output_stages=["a"]).collect()) == 2  # serving
        assert_nothing_in_flight(engine)


CHATTY = """
from omni_trio import StageBackend, StageOutput

class Chatty(StageBackend):
    async def _start(self):
        pass

    async def _run(self, request_id, inputs, sampling_params, emit):
        await emit(StageOutput(text="done", token_ids=(1,), finished=True, finish_reason="stop"))
        await emit(StageOutput(text="one more", token_ids=(2,)))
"""


@pytest.mark.parametrize("path", ["pulled", "routed", "collected", "observed"])
async def test_backend_emitting_after_finished_breaks_the_contract(
    autojump_clock, user_module, path
):
    # Checked once, by the replica, whichever way the stage's outputs go: straight to the
    # consumer (pulled), through a routing task (an output stage feeding another, or any
    # stage while observers watch), or kept until the backend returned (collected).
    chatty = f"{user_module(CHATTY)}:Chatty"
    if path == "pulled":
        cfg = one_stage(chatty)
    else:
        stages = [
            {"id": "a", "backend": chatty, "final_output": path != "collected"},
            {"id": "b", "inputs": ["a"], "final_output": True},
        ]
        cfg = load_config({"stages": stages})
    async with omni_trio.open_engine(cfg) as engine:
        if path == "observed":
            engine.add_observer(EngineObserver())
        seen = []
        with pytest.raises(StageError, match=r"a\[0\].*after its finished output") as info:
            async with engine.generate("x") as stream:
                async for out in stream:
                    seen.append((out.stage_id, out.text))
        assert info.value.stage_id == "a"
        # the finished output may reach the consumer before the error; nothing after it does
        assert seen in ([], [("a", "done")])
        stats = engine.statistics()
        assert stats.requests_failed == 1 and stats.stage("a").replicas[0].requests_failed == 1
        assert_nothing_in_flight(engine)


# -- bullet 7: start and stop --
async def test_pipeline_shutdown_timeout_bounds_each_stop(autojump_clock):
    cfg = scripted_pipeline(2, stop_delay_s=100.0, engine_options={"shutdown_timeout": 2.0})
    t0 = trio.current_time()
    with pytest.raises(StageStopError) as info:
        async with omni_trio.open_engine(cfg):
            t0 = trio.current_time()
    assert trio.current_time() - t0 == pytest.approx(2.0)  # both stages, in parallel
    assert sorted(name for name, _ in info.value.failures) == ["s0[0]", "s1[0]"]
    assert all(isinstance(cause, trio.TooSlowError) for _, cause in info.value.failures)
    assert isinstance(info.value.__cause__, ExceptionGroup)


async def test_a_stages_own_shutdown_timeout_overrides_the_pipelines(autojump_clock):
    cfg = scripted_pipeline(2, stop_delay_s=100.0, engine_options={"shutdown_timeout": 2.0})
    cfg = load_config(cfg, stage_overrides={"s1": {"shutdown_timeout": 5.0}})
    with pytest.raises(StageStopError) as info:
        async with omni_trio.open_engine(cfg):
            t0 = trio.current_time()
    assert trio.current_time() - t0 == pytest.approx(5.0)  # s0 gave up at 2 s, s1 at 5 s
    timeouts = {name: str(cause) for name, cause in info.value.failures}
    assert "shutdown_timeout=2.0s" in timeouts["s0[0]"]
    assert "shutdown_timeout=5.0s" in timeouts["s1[0]"]


async def test_failed_stop_surfaces_from_aclose_once(autojump_clock, backends):
    engine = omni_trio.open_engine(one_stage(f"{backends}:BadStop", replicas=2))
    async with engine:
        await engine.generate("x").collect()
        with pytest.raises(StageStopError, match="could not release replica") as info:
            await engine.aclose()
        assert [name for name, _ in info.value.failures] == ["a[0]", "a[1]"]
        assert all(isinstance(cause, OSError) for _, cause in info.value.failures)
    # raised once: leaving the block after aclose() does not raise it again
    assert engine.closed


async def test_body_exception_wins_over_a_stop_failure(autojump_clock, backends, caplog):
    with pytest.raises(KeyError, match="from the body"):
        async with omni_trio.open_engine(one_stage(f"{backends}:BadStop")):
            raise KeyError("from the body")
    assert "could not release replica 0" in caplog.text


async def test_one_replica_failing_to_start_cancels_its_siblings_at_once(autojump_clock, backends):
    t0 = trio.current_time()
    with pytest.raises(StageStartError, match="replica 1 cannot start"):
        async with omni_trio.open_engine(one_stage(f"{backends}:FailStartReplica1", replicas=3)):
            pytest.fail("started")
    assert trio.current_time() - t0 < 100  # the siblings' 100 s starts were cancelled


# -- bullet 8: arguments checked before admission --
async def test_misspelt_stage_in_sampling_params_is_named(autojump_clock):
    async with omni_trio.open_engine(scripted_pipeline(["thinker", "talker"])) as engine:
        with pytest.raises(InvalidRequestError, match="'talkr' is neither a stage id"):
            engine.generate("x", sampling_params={"thinker": {"max_tokens": 2}, "talkr": {}})
        with pytest.raises(InvalidRequestError, match="7 is not a stage index"):
            engine.generate("x", sampling_params={7: {"max_tokens": 2}})
        # one params dict for every stage still works
        outs = await engine.generate("x", sampling_params={"max_tokens": 2}).collect()
        assert len(outs) == 2
        assert engine.statistics().requests_total == 1


async def test_abort_and_abort_nowait_are_noops_during_and_after_close(autojump_clock):
    cfg = scripted_pipeline(1, hang=True)
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("x", request_id="r"):
            await trio.testing.wait_all_tasks_blocked()  # the stage holds the request
            await engine.aclose()
            assert await engine.abort("r") == []
            assert await engine.abort(["r"]) == {}
            assert engine.abort_nowait("r") is None
            with pytest.raises(EngineClosedError):
                engine.generate("y")
            with pytest.raises(EngineClosedError):
                await engine.collective_rpc("echo")
    assert scripted_backends(engine, "s0")[0].aborted == ["r"]


@pytest.mark.parametrize("stages", [1, 2])
async def test_a_finished_output_blocked_by_a_full_window_still_reaches_the_consumer(
    autojump_clock: trio.testing.MockClock, stages: int
) -> None:
    # A consumer that reads nothing: the stage's last output meets a full window. Once the
    # lifecycle counts the stage finished, that output must reach the consumer even if the
    # request is aborted now (else the stage would end with no finished output at all).
    cfg = scripted_pipeline(
        stages, outputs=3, final_outputs=["s0"], engine_options={"output_buffer": 2}
    )
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("x", request_id="full") as stream:
            await trio.testing.wait_all_tasks_blocked()
            engine.abort_nowait("full")
            outs = [out async for out in stream]
        assert [o.finished for o in outs if o.stage_id == "s0"][-1] is True
        assert sum(o.finished for o in outs if o.stage_id == "s0") == 1
        assert_nothing_in_flight(engine)
