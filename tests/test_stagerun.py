"""How a request's stages run (stagerun.py): which stage runs when, in which task, and
whether observers change anything a caller sees. Scripted stages on the MockClock."""

import pytest
import trio

import omni_trio
from omni_trio.observer import EngineObserver
from omni_trio.testing import assert_nothing_in_flight, scripted_backends, scripted_pipeline

PROMPT = [10, 20, 30, 40]


@pytest.mark.parametrize("stream_input", [False, True])
async def test_observed_and_unobserved_requests_run_alike(autojump_clock, stream_input):
    # Without observers, leaf output stages are read by the consumer and unstreamed stages
    # are routed once their backend returned; with one, every stage has a routing task.
    # Each stage's outputs (in order), abort partials and counts are the same either way (the
    # interleaving of two stages' outputs is not: they run concurrently).
    cfg = scripted_pipeline(
        3, outputs=4, latency_s=0.1, stream_input=stream_input, final_outputs=["s1", "s2"]
    )
    results = []
    for observed in (False, True):
        async with omni_trio.open_engine(cfg) as engine:
            if observed:
                engine.add_observer(EngineObserver())
            outs = await engine.generate(PROMPT, request_id="r").collect()
            async with engine.generate(PROMPT, request_id="a") as stream:
                await stream.receive()
                partial = await engine.abort("a")
            results.append(
                (
                    {
                        s: [(o.token_ids, o.finished) for o in outs if o.stage_id == s]
                        for s in "s1 s2".split()
                    },
                    sorted((o.stage_id, o.token_ids) for o in partial),
                    [b.completed for b in scripted_backends(engine, "s2")],
                )
            )
            assert_nothing_in_flight(engine)
    assert results[0] == results[1]
    assert [len(v) for v in results[0][0].values()] == [4, 4] and results[0][1]


@pytest.mark.parametrize("observed", [False, True])
async def test_a_stage_taking_whole_input_starts_when_it_is_complete(autojump_clock, observed):
    # Without observers, a stage without stream_input holds nothing (no replica binding, no
    # channel, no task) until its upstream finished; observers see every stage start with
    # the request, as they always have.
    cfg = scripted_pipeline(2, outputs=4, latency_s=1.0)
    async with omni_trio.open_engine(cfg) as engine:
        if observed:
            engine.add_observer(EngineObserver())
        async with engine.generate(PROMPT, request_id="r") as stream:
            await trio.sleep(2.5)  # s0 is half way
            assert engine.pools["s0"].requests_in_flight == 1
            assert engine.pools["s1"].requests_in_flight == (1 if observed else 0)
            outs = [o async for o in stream]
        assert [o.token_ids[0] for o in outs] == [t + 2 for t in PROMPT]
        assert scripted_backends(engine, "s1")[0].completed == ["r"]
        assert_nothing_in_flight(engine)
