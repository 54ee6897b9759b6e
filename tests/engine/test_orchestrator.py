"""Request routing through the stage graph, with scripted stages on the MockClock."""

import random

import pytest
import trio

import omni_trio
from omni_trio import InvalidRequestError, ReplicaDeadError, StageError, load_config
from omni_trio.testing import (
    assert_nothing_in_flight,
    scripted_backends,
    scripted_pipeline,
    scripted_tokens,
)

PROMPT = [10, 20, 30, 40]


@pytest.mark.parametrize("n_stages", [1, 2, 3])
async def test_chain_streams_in_order_with_derived_content(autojump_clock, n_stages):
    cfg = scripted_pipeline(n_stages, outputs=4, latency_s=0.5)
    async with omni_trio.open_engine(cfg) as engine:
        outs = await engine.generate(PROMPT, request_id="r").collect()
        last = f"s{n_stages - 1}"
        assert [o.stage_id for o in outs] == [last] * 4
        # each hop adds the scripted token_offset (1) to what it received
        assert [o.token_ids[0] for o in outs] == [t + n_stages for t in PROMPT]
        assert [o.finished for o in outs] == [False, False, False, True]
        assert outs[-1].finish_reason == "length"
        assert all(o.request_id == "r" and o.stage_index == n_stages - 1 for o in outs)
        # what each stage received is what its upstream produced
        for i in range(1, n_stages):
            (rec,) = scripted_backends(engine, f"s{i}")[0].received["r"]
            assert rec.token_ids == tuple(t + i for t in PROMPT)
        assert_nothing_in_flight(engine)


async def test_outputs_stream_as_they_are_produced(autojump_clock):
    cfg = scripted_pipeline(1, outputs=3, latency_s=2.0)
    async with omni_trio.open_engine(cfg) as engine:
        t0 = trio.current_time()
        arrivals = []
        async with engine.generate("abc") as stream:
            async for _ in stream:
                arrivals.append(trio.current_time() - t0)
        assert arrivals == pytest.approx([2.0, 4.0, 6.0])


async def test_text_prompt_flows_as_bytes(autojump_clock):
    cfg = scripted_pipeline(1, outputs=2)
    async with omni_trio.open_engine(cfg) as engine:
        outs = await engine.generate("AB").collect()
        assert [o.token_ids for o in outs] == [(ord("A") + 1,), (ord("B") + 1,)]
        assert outs[0].text == f"s0:{ord('A') + 1} "


async def test_fan_in_waits_for_every_input(autojump_clock):
    cfg = load_config(
        {
            "stages": [
                {"id": "a", "options": {"outputs": 2}},
                {"id": "b", "inputs": ["a"], "options": {"outputs": 2, "latency_s": 5}},
                {"id": "c", "inputs": ["a"], "options": {"outputs": 3, "token_offset": 100}},
                {"id": "d", "inputs": ["b", "c"], "options": {"outputs": 5}, "final_output": True},
            ]
        }
    )
    async with omni_trio.open_engine(cfg) as engine:
        outs = await engine.generate([1, 2], request_id="r").collect()
        (rec,) = scripted_backends(engine, "d")[0].received["r"]
        # b produced 3,4 (a gave 2,3); c produced 102,103,102: concatenated in `inputs` order
        assert rec.token_ids == (3, 4, 102, 103, 102)
        assert [o.token_ids[0] for o in outs] == [4, 5, 103, 104, 103]


async def test_stream_input_starts_downstream_before_upstream_finishes(autojump_clock):
    cfg = scripted_pipeline(
        ["up", "down"], outputs=4, latency_s=1.0, stream_input=True, final_outputs=["up", "down"]
    )
    async with omni_trio.open_engine(cfg) as engine:
        t0 = trio.current_time()
        seen = []
        async with engine.generate(PROMPT) as stream:
            async for out in stream:
                seen.append((out.stage_id, out.token_ids[0], trio.current_time() - t0))
        first_down = next(t for sid, _, t in seen if sid == "down")
        last_up = max(t for sid, _, t in seen if sid == "up")
        assert first_down < last_up  # down started on partial input
        assert [tok for sid, tok, _ in seen if sid == "down"] == [t + 2 for t in PROMPT]
        chunks = scripted_backends(engine, "down")[0].received
        (rid,) = chunks
        # one chunk per upstream delta; it had its 4 outputs before the final marker came
        assert [c.token_ids for c in chunks[rid]] == [(t + 1,) for t in PROMPT]


async def test_final_stage_id_skips_later_stages(autojump_clock):
    cfg = scripted_pipeline(
        ["thinker", "talker", "vocoder"], outputs=3, final_outputs=["thinker", "vocoder"]
    )
    async with omni_trio.open_engine(cfg) as engine:
        outs = await engine.generate("hi", request_id="r", final_stage_id="thinker").collect()
        assert {o.stage_id for o in outs} == {"thinker"}
        assert "r" not in scripted_backends(engine, "talker")[0].received
        assert "r" not in scripted_backends(engine, "vocoder")[0].received
        outs = await engine.generate("hi", request_id="r2", final_stage_id=1).collect()
        # the final stage is delivered even though it is not a final_output stage
        assert [o.stage_id for o in outs if o.finished] == ["thinker", "talker"]
        assert "r2" not in scripted_backends(engine, "vocoder")[0].received


async def test_output_stages_selects_what_the_caller_gets(autojump_clock):
    cfg = scripted_pipeline(3, outputs=2)
    async with omni_trio.open_engine(cfg) as engine:
        outs = await engine.generate("x", output_stages=["s0", "s2"]).collect()
        assert sorted({o.stage_id for o in outs}) == ["s0", "s2"]
        outs = await engine.generate("x", output_stages=["s1"]).collect()
        assert {o.stage_id for o in outs} == {"s1"}
        with pytest.raises(InvalidRequestError, match="does not run when final_stage_id"):
            engine.generate("x", final_stage_id="s0", output_stages=["s2"])
        with pytest.raises(InvalidRequestError, match="output_stages is empty"):
            engine.generate("x", output_stages=[])


async def test_consumer_leaving_early_aborts_in_every_stage_before_exit(autojump_clock):
    cfg = scripted_pipeline(
        3, outputs=100, latency_s=1.0, stream_input=True, final_outputs=["s0", "s2"]
    )
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate(list(range(1, 200)), request_id="r") as stream:
            async for out in stream:
                if out.stage_id == "s2":
                    break
            assert engine.statistics().stage_requests_in_flight == 3
        # __aexit__ returned: every stage has dropped it already
        assert_nothing_in_flight(engine)
        for sid in ("s0", "s1", "s2"):
            assert scripted_backends(engine, sid)[0].aborted == ["r"]
        assert engine.statistics().requests_aborted == 1
        assert stream.status == "aborted"


async def test_consumer_cancelled_from_outside_aborts_everywhere(autojump_clock):
    cfg = scripted_pipeline(2, outputs=100, latency_s=1.0, stream_input=True)
    async with omni_trio.open_engine(cfg) as engine:
        got = []
        with trio.move_on_after(10.5):
            async with engine.generate(list(range(1, 200)), request_id="r") as stream:
                async for out in stream:
                    got.append(out)
        assert 5 <= len(got) <= 10
        assert_nothing_in_flight(engine)
        assert scripted_backends(engine, "s0")[0].aborted == ["r"]
        assert scripted_backends(engine, "s1")[0].aborted == ["r"]


async def test_plain_async_for_break_aborts(autojump_clock):
    cfg = scripted_pipeline(1, outputs=100, latency_s=1.0)
    async with omni_trio.open_engine(cfg) as engine:
        async for _ in engine.generate("x", request_id="r"):
            break
        # the generator finalizer runs in trio's system nursery, then the abort completes
        await trio.testing.wait_all_tasks_blocked()
        assert_nothing_in_flight(engine)
        assert scripted_backends(engine, "s0")[0].aborted == ["r"]
        # and a full plain iteration works
        assert len([o async for o in engine.generate("y")]) == 100


async def test_500_concurrent_requests_with_random_early_exits(autojump_clock):
    cfg = scripted_pipeline(3, outputs=16, latency_s=0.01, stream_input=["s2"])
    rng = random.Random(1234)
    counts = {"full": 0, "early": 0}

    async def one(i, engine):
        stop_after = rng.choice([None, 0, 1, 5, 15])
        n = 0
        async with engine.generate([i % 250 + 1, 7], request_id=f"r{i}") as stream:
            async for _ in stream:
                n += 1
                if stop_after is not None and n > stop_after:
                    counts["early"] += 1
                    return
        assert n == 16
        counts["full"] += 1

    async with omni_trio.open_engine(cfg) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(500):
                nursery.start_soon(one, i, engine)
        assert counts["full"] + counts["early"] == 500
        assert counts["early"] > 100
        assert_nothing_in_flight(engine)
        stats = engine.statistics()
        assert stats.requests_total == 500
        assert stats.requests_finished + stats.requests_aborted == 500


async def test_acknowledged_abort_returns_partials(autojump_clock):
    cfg = scripted_pipeline(2, outputs=10, latency_s=1.0, stream_input=True, final_outputs=["s1"])
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate(list(range(1, 20)), request_id="r") as stream:
            first = await stream.receive()
            assert first.stage_id == "s1"
            await trio.sleep(2.5)
            partial = await engine.abort("r")
            # returned after every stage dropped it
            assert_nothing_in_flight(engine)
            assert {o.stage_id for o in partial} == {"s0", "s1"}
            assert [o.token_ids[0] for o in partial if o.stage_id == "s0"] == [2, 3, 4, 5]
            rest = [o async for o in stream]
            assert rest[-1].finished and rest[-1].finish_reason == "abort"
        assert stream.status == "aborted"
        # finished and unknown ids: no-op
        done = await engine.generate("x", request_id="done").collect()
        assert done[-1].finished
        assert await engine.abort("done") == []
        assert await engine.abort("never") == []
        engine.abort_nowait("never")
        assert engine.statistics().requests_aborted == 1


async def test_stage_failure_fails_only_its_request(autojump_clock):
    cfg = scripted_pipeline(
        2, outputs=4, latency_s=1.0, stage_options={"s1": {"fail_at_output": 2}}
    )
    cfg = load_config(cfg, stage_overrides={"s1": {"replicas": 1}})
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("x", request_id="bad") as stream:
            got = []
            with pytest.raises(StageError) as info:
                async for out in stream:
                    got.append(out)
        assert len(got) == 2
        assert info.value.stage_id == "s1"
        assert info.value.request_id == "bad"
        assert "fail at output 2" in str(info.value)
        assert stream.status == "failed"
        assert_nothing_in_flight(engine)
        # the replica is fine; a request with fewer outputs passes
        outs = await engine.generate("y", sampling_params={"s1": {"max_tokens": 2}}).collect()
        assert len(outs) == 2
        stats = engine.statistics()
        assert (stats.requests_failed, stats.requests_finished) == (1, 1)


async def test_failure_mid_pipeline_cancels_the_other_stages(autojump_clock):
    cfg = scripted_pipeline(
        3, outputs=50, latency_s=1.0, stream_input=True, stage_options={"s1": {"fail_at_output": 3}}
    )
    async with omni_trio.open_engine(cfg) as engine:
        with pytest.raises(StageError, match="fail at output 3"):
            await engine.generate(list(range(1, 60)), request_id="r").collect()
        assert scripted_backends(engine, "s0")[0].aborted == ["r"]
        assert scripted_backends(engine, "s2")[0].aborted == ["r"]
        assert_nothing_in_flight(engine)


async def test_replica_crash_fails_only_its_requests(autojump_clock):
    cfg = scripted_pipeline(
        ["a"],
        outputs=10,
        latency_s=1.0,
        replicas=2,
        stage_options={"a": {"crash_at_request": 2, "crash_replica": 0}},
    )
    async with omni_trio.open_engine(cfg) as engine:
        results: dict[str, object] = {}

        async def run(rid):
            try:
                results[rid] = len(await engine.generate("x", request_id=rid).collect())
            except ReplicaDeadError as exc:
                results[rid] = exc

        async with trio.open_nursery() as nursery:
            # least loaded first: r0 -> replica 0, r1 -> replica 1, r2 -> replica 0 (its 2nd: dies)
            for rid in ("r0", "r1", "r2"):
                nursery.start_soon(run, rid)
                await trio.sleep(0.1)
        assert isinstance(results["r0"], ReplicaDeadError)
        assert isinstance(results["r2"], ReplicaDeadError)
        assert results["r1"] == 10
        exc = results["r0"]
        assert exc.stage_id == "a" and exc.replica == 0 and exc.request_id == "r0"
        assert "a[0] is dead" in str(exc)
        stats = engine.statistics().stage("a")
        assert stats.live_replicas == 1
        assert [r.alive for r in stats.replicas] == [False, True]
        # the engine keeps serving on the live replica
        assert len(await engine.generate("y").collect()) == 10
        assert_nothing_in_flight(engine)
        assert engine.statistics().requests_failed == 2


async def test_all_replicas_dead_is_a_typed_error(autojump_clock):
    cfg = scripted_pipeline(1, crash_at_request=1)
    async with omni_trio.open_engine(cfg) as engine:
        with pytest.raises(ReplicaDeadError):
            await engine.generate("x").collect()
        with pytest.raises(omni_trio.NoLiveReplicaError, match="no live replica"):
            await engine.generate("x").collect()
        assert_nothing_in_flight(engine)


async def test_slow_consumer_exerts_backpressure(autojump_clock):
    cfg = scripted_pipeline(1, outputs=1000, engine_options={"output_buffer": 4})
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("x", request_id="r") as stream:
            await stream.receive()
            await trio.sleep(10)
            # the stage is blocked on full channels, not running ahead without bound: at most
            # the consumer's window and the stage's outbox (output_buffer each) are in flight
            assert scripted_backends(engine, "s0")[0].statistics().requests_in_flight == 1
            produced = await engine.abort("r")
            assert len(produced) <= 4 + 1 + 2
            queued = [out async for out in stream]  # what waited in its window, then the end
            assert len(queued) == 4 + 1 and queued[-1].finish_reason == "abort"


async def test_hung_stage_is_abortable(autojump_clock):
    cfg = scripted_pipeline(2, stage_options={"s1": {"hang": True}})
    async with omni_trio.open_engine(cfg) as engine:
        with trio.move_on_after(30):
            await engine.generate("x", request_id="r").collect()
        assert scripted_backends(engine, "s1")[0].aborted == ["r"]
        assert_nothing_in_flight(engine)


async def test_repr_shows_live_state(autojump_clock):
    cfg = scripted_pipeline(1, hang=True)
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("x", request_id="r") as stream:
            await trio.sleep(1)
            assert "in_flight=1" in repr(engine)
            assert "'r' running" in repr(stream)
            assert "in_flight=1" in repr(engine.pools["s0"])
            assert "in_flight=1" in repr(engine.pools["s0"].replicas[0])
        assert "in_flight=0" in repr(engine)
    _ = scripted_tokens
