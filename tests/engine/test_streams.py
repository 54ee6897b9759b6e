"""streams.py: iterating a stream inside its ``async with`` block goes straight to the
request's handle (no async generator), and keeps every rule of the generator path."""

import inspect

import pytest
import trio
from trio.testing import assert_checkpoints

import omni_trio
from omni_trio import StageError
from omni_trio.testing import assert_nothing_in_flight, scripted_pipeline


async def test_inside_the_block_each_output_is_a_checkpoint_then_the_end(autojump_clock):
    cfg = scripted_pipeline(1, outputs=3)
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate("hi", request_id="r") as stream:
            outputs = aiter(stream)
            assert not inspect.isasyncgen(outputs)
            assert aiter(outputs) is outputs
            got = []
            for _ in range(3):
                with assert_checkpoints():
                    got.append(await anext(outputs))
            with assert_checkpoints(), pytest.raises(StopAsyncIteration):
                await anext(outputs)
        assert [o.finished for o in got] == [False, False, True]
        assert_nothing_in_flight(engine)


async def test_outside_the_block_it_is_the_finalized_generator(autojump_clock):
    # a plain `async for` needs the generator: breaking out of it aborts the request when
    # the generator is finalized
    cfg = scripted_pipeline(1, outputs=3)
    async with omni_trio.open_engine(cfg) as engine:
        stream = engine.generate("hi", request_id="r")
        outputs = aiter(stream)
        assert inspect.isasyncgen(outputs)
        await outputs.aclose()


async def test_a_failed_request_raises_its_error_from_the_loop(autojump_clock):
    cfg = scripted_pipeline(1, outputs=4, fail_at_output=2)
    async with omni_trio.open_engine(cfg) as engine:
        got = []
        with pytest.raises(StageError, match="fail at output 2"):
            async with engine.generate("hi", request_id="r") as stream:
                async for out in stream:
                    got.append(out)
        assert len(got) == 2
        assert stream.status == "failed"
        assert_nothing_in_flight(engine)


async def test_cancelled_inside_the_loop_aborts_the_request(autojump_clock):
    cfg = scripted_pipeline(1, outputs=100, latency_s=1.0)
    async with omni_trio.open_engine(cfg) as engine:
        with trio.move_on_after(2.5):
            async with engine.generate("hi", request_id="r") as stream:
                async for _ in stream:
                    pass
        assert stream.status == "aborted"
        assert_nothing_in_flight(engine)
