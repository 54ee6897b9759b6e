"""Interactions (issue 11 item 3): ``stream.interact`` / ``engine.interact`` deliver control
payloads, in order, to the request's entry-stage backend; the scripted backend stops on
``{"stop": True}`` and records the rest."""

import pytest
import trio
import trio.lowlevel
from trio.testing import assert_checkpoints

import omni_trio
from omni_trio import InvalidRequestError
from omni_trio.stages.watch import watched
from omni_trio.testing import assert_nothing_in_flight, scripted_backends, scripted_pipeline


def nothing_left(engine):
    assert_nothing_in_flight(engine)
    assert engine.orchestrator.interactions.pending == 0
    assert watched() == 0


async def test_in_order_to_the_entry_stage(autojump_clock):
    cfg = scripted_pipeline(["a", "b"], outputs=4, latency_s=1.0)
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("hi", request_id="r") as stream:
            for n in range(3):
                assert await stream.interact({"n": n}) is True
            assert await engine.interact("r", "four") is True
            outs = await stream.collect()
        assert [o.finish_reason for o in outs if o.finished] == ["length"]
        (a,) = scripted_backends(engine, "a")
        (b,) = scripted_backends(engine, "b")
        assert a.interactions["r"] == [{"n": 0}, {"n": 1}, {"n": 2}, "four"]
        assert "r" not in b.interactions  # only the entry stage gets them
        nothing_left(engine)


async def test_calls_from_several_tasks_arrive_in_call_order(autojump_clock):
    cfg = scripted_pipeline(["a"], outputs=4, latency_s=1.0)
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("hi", request_id="r"), trio.open_nursery() as nursery:
            results = []

            async def send(n, *, task_status):
                task_status.started()
                results.append((n, await engine.interact("r", n)))

            for n in range(5):
                # each task is queued on the request's lock before the next one starts
                await nursery.start(send, n)
        assert sorted(results) == [(n, True) for n in range(5)]
        assert scripted_backends(engine, "a")[0].interactions["r"] == [0, 1, 2, 3, 4]
        nothing_left(engine)


async def test_stop_finishes_the_request_now(autojump_clock):
    cfg = scripted_pipeline(["a"], outputs=100, latency_s=1.0)
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("hi", request_id="r") as stream:
            first = [await stream.receive() for _ in range(3)]
            t0 = trio.current_time()
            assert await stream.interact({"stop": True}) is True
            rest = await stream.collect()
            # it did not wait for the next output's latency: the stop cut that wait short
            assert trio.current_time() == t0
        assert not any(o.finished for o in first)
        assert len(rest) == 1
        (last,) = rest
        assert last.finished and last.finish_reason == "stop" and last.token_ids == ()
        assert last.metrics is not None and last.metrics["output_index"] == 3
        assert stream.status == "finished"
        (a,) = scripted_backends(engine, "a")
        assert a.completed == ["r"] and a.aborted == []
        assert a.interactions["r"] == [{"stop": True}]
        # a finished request takes no more interactions
        assert await stream.interact({"stop": True}) is False
        assert await engine.interact("r", {"stop": True}) is False
        nothing_left(engine)


async def test_stop_while_hanging_and_before_the_first_output(autojump_clock):
    cfg = scripted_pipeline(["a", "b"], stage_options={"a": {"hang": True}}, outputs=2)
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("hi", request_id="r") as stream:
            assert await stream.interact({"stop": True}) is True
            outs = await stream.collect()
        # a ended with its (empty) stop output, and b ran on what a produced
        assert [o.stage_id for o in outs] == ["b", "b"] and outs[-1].finish_reason == "length"
        nothing_left(engine)


async def test_unknown_finished_and_entry_done_ids_are_false(autojump_clock):
    cfg = scripted_pipeline(["a", "b"], stage_options={"b": {"latency_s": 10.0}}, outputs=2)
    async with omni_trio.open_engine(cfg) as engine:
        assert await engine.interact("nobody", {"stop": True}) is False
        async with engine.generate("hi", request_id="r") as stream:
            await stream.receive()  # b's first output: a has finished
            # the request is live, but its entry stage is done with it
            assert await stream.interact("late") is False
        assert await engine.interact("r", "later") is False
        assert "r" not in scripted_backends(engine, "a")[0].interactions
        with pytest.raises(InvalidRequestError, match="request_id must be a string"):
            await engine.interact(7, {})  # type: ignore[arg-type]
        nothing_left(engine)


async def test_a_stream_from_an_earlier_request_does_not_reach_a_later_one(autojump_clock):
    cfg = scripted_pipeline(["a"], outputs=3, latency_s=1.0)
    async with omni_trio.open_engine(cfg) as engine:
        old = engine.generate("hi", request_id="r")
        await old.collect()
        async with engine.generate("hi", request_id="r") as new:
            assert await old.interact("for the old one") is False
            assert await new.interact("for the new one") is True
        assert scripted_backends(engine, "a")[0].interactions["r"] == ["for the new one"]


async def test_a_backend_without_the_hook_refuses_naming_the_stage(autojump_clock, user_module):
    mod = user_module(
        """
        from omni_trio.stages.backend import StageBackend
        from omni_trio.backends.scripted import ScriptedBackend

        class NoInteractions(ScriptedBackend):
            backend_name = "no-interactions"
            _interact = StageBackend._interact
        """
    )
    cfg = omni_trio.load_config(
        {
            "stages": [
                {
                    "id": "plain",
                    "backend": f"{mod}:NoInteractions",
                    "final_output": True,
                    "options": {"outputs": 3, "latency_s": 1.0},
                }
            ]
        }
    )
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("hi", request_id="r") as stream:
            with pytest.raises(InvalidRequestError, match="stage 'plain'.*takes no interactions"):
                await stream.interact({"stop": True})
            with pytest.raises(InvalidRequestError, match="stage 'plain'"):
                await engine.interact("r", "x")
            # the request is unharmed
            outs = await stream.collect()
        assert outs[-1].finish_reason == "length"
        nothing_left(engine)


async def test_interact_before_the_stream_is_entered(autojump_clock):
    cfg = scripted_pipeline(["a"], outputs=2)
    async with omni_trio.open_engine(cfg) as engine:
        stream = engine.generate("hi", request_id="r")
        with pytest.raises(InvalidRequestError, match="not admitted yet: enter its stream"):
            await stream.interact({"stop": True})
        assert stream.status == "pending"
        assert engine.statistics().requests_in_flight == 0
        nothing_left(engine)


def one_slot():
    # one slot on a's only replica: a second request waits for it, and so do its interactions
    return omni_trio.load_config(
        {
            "stages": [
                {
                    "id": "a",
                    "backend": "scripted",
                    "final_output": True,
                    "max_in_flight_per_replica": 1,
                    "options": {"outputs": 3, "latency_s": 10.0},
                }
            ]
        }
    )


async def test_cancelled_while_waiting_for_the_entry_stage_delivers_nothing(autojump_clock):
    cfg = one_slot()
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("x", request_id="first") as first:
            await first.receive()
            async with engine.generate("y", request_id="second") as second:
                with trio.move_on_after(1.0) as scope:
                    await second.interact("never")
                assert scope.cancelled_caught
                assert engine.orchestrator.interactions.pending == 0 and watched() == 0
                # queued behind a waiting one and cancelled: also gone
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(second.interact, "delivered")
                    await trio.sleep(1.0)
                    with trio.move_on_after(1.0):
                        await second.interact("cancelled in line")
                    assert engine.orchestrator.interactions.pending == 1
                await second.collect()
        (a,) = scripted_backends(engine, "a")
        assert "first" not in a.interactions
        assert a.interactions["second"] == ["delivered"]
        nothing_left(engine)


async def test_cancelled_interact_delivers_nothing_and_abort_ends_waiters(autojump_clock):
    cfg = one_slot()
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("x", request_id="first") as first:
            await first.receive()
            waiting = engine.generate("y", request_id="second")
            async with waiting, trio.open_nursery() as nursery:
                results = []

                async def send():
                    results.append(await waiting.interact("x"))

                nursery.start_soon(send)
                await trio.sleep(1.0)
                # the request ends (aborted) before it ever ran on a: the waiter gets False
                await waiting.abort()
            assert results == [False]
        # cancelled before it starts: nothing delivered, no checkpoint skipped
        async with engine.generate("z", request_id="third") as third:
            await third.receive()
            with trio.CancelScope() as scope:
                scope.cancel()
                with pytest.raises(trio.Cancelled):
                    await third.interact({"stop": True})
            outs = await third.collect()
        assert outs[-1].finish_reason == "length"
        assert "third" not in scripted_backends(engine, "a")[0].interactions
        nothing_left(engine)


async def test_interact_always_checkpoints(autojump_clock):
    cfg = scripted_pipeline(["a"], outputs=50, latency_s=1.0)
    async with omni_trio.open_engine(cfg) as engine:
        with assert_checkpoints():
            assert await engine.interact("unknown", 1) is False
        stream = engine.generate("hi", request_id="r")
        with assert_checkpoints(), pytest.raises(InvalidRequestError):
            await stream.interact(1)
        async with stream:
            await stream.receive()
            (a,) = scripted_backends(engine, "a")
            with assert_checkpoints():
                assert await stream.interact("recorded") is True
            with assert_checkpoints():
                assert await a.interact("not-running", 1) is False
            with assert_checkpoints():
                assert await stream.interact({"stop": True}) is True
            await stream.collect()
        with assert_checkpoints():
            assert await stream.interact(1) is False
        nothing_left(engine)


async def test_stop_while_waiting_for_streamed_input(autojump_clock):
    # output k waits for input token k: the stop cuts that wait short, and the segment that
    # came before it was taken
    cfg = scripted_pipeline(["a"], outputs=8)
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("a", request_id="r", streaming_input=True) as stream:
            first = await stream.receive()
            assert first.token_ids == (ord("a") + 1,) and not first.finished
            await stream.send_input("b")
            second = await stream.receive()
            assert second.token_ids == (ord("b") + 1,)
            t0 = trio.current_time()
            assert await stream.interact({"stop": True}) is True
            rest = await stream.collect()
            assert trio.current_time() == t0
        (last,) = rest
        assert (last.finished, last.finish_reason, last.token_ids) == (True, "stop", ())
        assert last.metrics is not None and last.metrics["output_index"] == 2
        (a,) = scripted_backends(engine, "a")
        assert [c.prompt for c in a.received["r"]] == ["a", "b"]
        assert a.completed == ["r"] and a.aborted == []
        nothing_left(engine)


async def test_stop_of_a_zero_latency_request_ends_it_after_the_output_in_delivery(
    autojump_clock,
):
    # no latency: the request never waits, so a stop is taken right after the output being
    # delivered (the window holds the stage back: the consumer reads one output at a time)
    cfg = scripted_pipeline(["a"], outputs=1000, engine_options={"output_buffer": 1})
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("hi", request_id="r") as stream:
            first = [await stream.receive() for _ in range(3)]
            assert await stream.interact({"stop": True}) is True
            rest = await stream.collect()
        assert not any(o.finished for o in first)
        *between, last = rest
        assert len(between) <= 2 and not any(o.finished for o in between)
        assert (last.finished, last.finish_reason, last.token_ids) == (True, "stop", ())
        assert last.metrics is not None and last.metrics["output_index"] == 3 + len(between)
        assert scripted_backends(engine, "a")[0].completed == ["r"]
        nothing_left(engine)
