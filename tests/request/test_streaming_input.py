"""Streaming input: a request whose entry stage gets its input in segments (scripted stages,
MockClock)."""

import pytest
import trio
import trio.testing

from omni_trio import InvalidRequestError, open_engine
from omni_trio.testing import (
    assert_nothing_in_flight,
    cancel_at_every_checkpoint,
    scripted_backends,
    scripted_pipeline,
)


def tokens_of(chunks):
    return [t for c in chunks for t in c.token_ids]


async def test_segments_reach_the_entry_stage_in_order_and_output_starts_early(autojump_clock):
    # the entry stage makes output k once input token k is here: it starts on the prompt
    cfg = scripted_pipeline(["a", "b"], outputs=6, latency_s=0.1, stream_input=True)
    async with open_engine(cfg) as engine:
        async with engine.generate([1, 2], request_id="r", streaming_input=True) as stream:
            first = await stream.receive()
            assert first.stage_id == "b"  # before any more input was sent
            await stream.send_input([3, 4])
            await stream.send_input([5])
            await stream.send_input({"prompt_token_ids": [6]})  # a prompt dict segment
            await stream.end_input()
            rest = [out async for out in stream]
        received = scripted_backends(engine, "a")[0].received["r"]
        assert tokens_of(received) == [1, 2, 3, 4, 5]
        assert received[-1].data == {"prompt_token_ids": [6]}
        # the stage had its 6 tokens' worth of input before the end: it never read it
        assert [c.final for c in received] == [False] * 4
        assert rest[-1].finished
        assert_nothing_in_flight(engine)


async def test_send_input_waits_when_the_stage_does_not_keep_up(autojump_clock):
    cfg = scripted_pipeline(["a"], outputs=1000, latency_s=1.0, engine_options={"output_buffer": 2})
    async with open_engine(cfg) as engine:
        async with engine.generate([1], request_id="r", streaming_input=True) as stream:
            sent = 0
            with trio.move_on_after(0.5):
                while True:
                    await stream.send_input([sent + 2])
                    sent += 1
            # the channel holds output_buffer segments; the stage took a few: bounded
            assert 1 <= sent <= 2 + 2
            await stream.abort()
        assert_nothing_in_flight(engine)


async def test_input_errors_are_typed_and_refuse_nothing_else(autojump_clock):
    cfg = scripted_pipeline(["a"], outputs=2)
    async with open_engine(cfg) as engine:
        plain = engine.generate("x", request_id="plain")
        with pytest.raises(InvalidRequestError, match="not admitted yet"):
            await plain.send_input("y")
        async with plain:
            with pytest.raises(InvalidRequestError, match="without streaming_input=True"):
                await plain.send_input("y")
            await plain.end_input()  # a no-op there
            assert (await plain.collect())[-1].finished
        async with engine.generate("x", request_id="s", streaming_input=True) as stream:
            with pytest.raises(InvalidRequestError, match="prompt is an empty string"):
                await stream.send_input("")
            await stream.end_input()
            await stream.end_input()  # repeated: a no-op
            with pytest.raises(InvalidRequestError, match=r"its input was ended \(end_input\)"):
                await stream.send_input("late")
            assert (await stream.collect())[-1].finished
        # a segment for a request that ended is refused and starts nothing
        with pytest.raises(InvalidRequestError, match="nothing was sent"):
            await stream.send_input("after")
        assert engine.statistics().requests_total == 2
        assert_nothing_in_flight(engine)


async def test_streaming_input_needs_one_entry_stage(autojump_clock):
    cfg = {
        "stages": [
            {"id": "a"},
            {"id": "b"},
            {"id": "c", "inputs": ["a", "b"], "final_output": True},
        ]
    }
    async with open_engine(cfg) as engine:
        with pytest.raises(InvalidRequestError, match=r"one entry stage; this one has 2"):
            engine.generate("x", streaming_input=True)
        stream = engine.generate("x", streaming_input=True, final_stage_id="a")
        async with stream:
            await stream.end_input()
            assert (await stream.collect())[-1].finished


async def test_leaving_the_stream_stops_its_input_side(autojump_clock):
    cfg = scripted_pipeline(["a"], outputs=100, latency_s=1.0)
    async with open_engine(cfg) as engine:
        async with engine.generate([1], request_id="r", streaming_input=True) as stream:
            await stream.receive()
        with pytest.raises(InvalidRequestError, match="has ended"):
            await stream.send_input([2])
        assert scripted_backends(engine, "a")[0].aborted == ["r"]
        assert_nothing_in_flight(engine)


async def test_input_calls_always_checkpoint(autojump_clock):
    cfg = scripted_pipeline(["a"], outputs=3)
    async with open_engine(cfg) as engine:
        async with engine.generate([1], streaming_input=True) as stream:
            with trio.testing.assert_checkpoints():
                await stream.send_input([2])
            with trio.testing.assert_checkpoints():
                await stream.end_input()
            with trio.testing.assert_checkpoints(), pytest.raises(InvalidRequestError):
                await stream.send_input([3])
            await stream.collect()


async def test_cancel_at_every_checkpoint_with_input_pending(autojump_clock):
    cfg = scripted_pipeline(["a", "b"], outputs=4, latency_s=0.25, stream_input=True)

    async def scenario(engine):
        async with engine.generate([1], streaming_input=True) as stream:
            await stream.send_input([2])
            await stream.receive()
            await stream.send_input([3, 4])
            await stream.end_input()
            async for _ in stream:
                pass

    async with open_engine(cfg) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario)
        report.raise_if_failed()
        assert report.runs == report.checkpoints + 1 >= 8
        assert_nothing_in_flight(engine)
