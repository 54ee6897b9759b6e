"""omni_trio.testing.fake_engine on the mock clock: the engine alone (slots, the queue for
them, one token per step of step_s, final-only requests, the fast path, cancellation) and
as a stage (every token in order through a pipeline, step time, the finished output only
when nobody streams, aborts and cancellation freeing the engine, options checked at load)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

import omni_trio
from omni_trio import ConfigError, load_config
from omni_trio.outputs import StageInput, StageOutput
from omni_trio.testing import (
    FAKE_ENGINE_BACKEND,
    FakeEngine,
    FakeEngineBackend,
    FakeEngineStatistics,
    FakeRequest,
    assert_nothing_in_flight,
    cancel_at_every_checkpoint,
    fake_engine_backends,
    fake_engine_pipeline,
    scripted_backends,
    scripted_pipeline,
)

SHAPE = {"slots": 3, "step_s": 0.002, "tokens": 6}


@asynccontextmanager
async def serving(engine: FakeEngine) -> AsyncIterator[trio.Nursery]:
    """``engine`` running in a nursery of its own for the block (cancelled after it)."""
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.serve)
        yield nursery
        nursery.cancel_scope.cancel()


async def read_all(request: FakeRequest) -> tuple[list[tuple[int, ...]], float]:
    """Every delta of ``request`` until it finishes, and the trio time it finished at."""
    deltas = []
    while True:
        delta, done = await request.receive()
        deltas.append(delta)
        if done:
            return deltas, trio.current_time()


# -- the engine alone -----------------------------------------------------------------------


async def test_a_full_engine_runs_slots_requests_a_step_and_queues_the_rest(autojump_clock):
    engine = FakeEngine(slots=2, step_s=1.0, tokens=3)
    finished: dict[int, float] = {}
    async with serving(engine):
        requests = [engine.add([10 * i]) for i in range(5)]
        assert engine.statistics() == FakeEngineStatistics(slots=2, running=0, waiting=5, steps=0)
        t0 = trio.current_time()

        async def read(i: int) -> None:
            deltas, at = await read_all(requests[i])
            assert [t for d in deltas for t in d] == [10 * i + 1] * 3
            finished[i] = at - t0

        async with trio.open_nursery() as readers:
            for i in range(5):
                readers.start_soon(read, i)
            await trio.sleep(0.5)
            assert engine.statistics() == FakeEngineStatistics(
                slots=2, running=2, waiting=3, steps=0
            )
            assert "slots=2/2 waiting=3 steps=0" in repr(engine)
    # two at a time, first in first out, each taking 3 steps of 1 s
    assert finished == {0: 3.0, 1: 3.0, 2: 6.0, 3: 6.0, 4: 9.0}
    assert engine.statistics() == FakeEngineStatistics(slots=2, running=0, waiting=0, steps=9)


async def test_a_waiting_reader_gets_one_token_a_step_and_a_busy_one_gets_them_merged(
    autojump_clock,
):
    engine = FakeEngine(slots=1, step_s=1.0, tokens=4)
    async with serving(engine):
        t0 = trio.current_time()
        waiting = engine.add([5, 7])
        got = []
        for _ in range(2):
            got.append((await waiting.receive(), trio.current_time() - t0))
        assert got == [(((6,), False), 1.0), (((8,), False), 2.0)]
        await trio.sleep(2.5)  # busy for two steps and a half: both tokens wait
        assert await waiting.receive() == ((6, 8), True)
        with pytest.raises(trio.EndOfChannel):
            await waiting.receive()


async def test_a_final_only_request_wakes_its_reader_once_with_every_token(autojump_clock):
    engine = FakeEngine(slots=1, step_s=0.5, tokens=3)
    async with serving(engine):
        t0 = trio.current_time()
        request = engine.add([], final_only=True)  # an empty prompt counts as [0]
        assert await request.receive() == ((1, 1, 1), True)
        assert trio.current_time() - t0 == 1.5


async def test_the_fast_path_takes_the_tokens_a_waiting_reader_would_get_but_the_last(
    autojump_clock,
):
    taken: list[StageOutput] = []

    def accept(out: StageOutput) -> bool:
        taken.append(out)
        return True

    engine = FakeEngine(slots=2, step_s=1.0, tokens=3)
    async with serving(engine):
        fast = engine.add([1, 2], fast=accept)
        refused = engine.add([1, 2], fast=lambda out: False)
        # the reader sleeps through the steps: the first two tokens went the fast way
        assert await fast.receive() == ((2,), True)
        assert [out.token_ids for out in taken] == [(2,), (3,)]
        assert not any(out.finished for out in taken)
        # a refused output stays for the reader
        assert (await read_all(refused))[0] == [(2, 3, 2)]


async def test_a_cancelled_reader_leaves_the_request_running_without_its_fast_path(
    autojump_clock,
):
    taken: list[StageOutput] = []
    engine = FakeEngine(slots=1, step_s=1.0, tokens=3)
    async with serving(engine):
        request = engine.add([1], fast=lambda out: taken.append(out) is None)
        with trio.move_on_after(1.5):
            await request.receive()  # the first token goes the fast way, then cancelled
        assert len(taken) == 1
        await trio.sleep(1)  # the second token is pending, not taken
        assert await request.receive() == ((2,), False)
        assert len(taken) == 1 and engine.statistics().running == 1


async def test_cancel_frees_the_slot_when_the_step_under_way_ends(autojump_clock):
    engine = FakeEngine(slots=1, step_s=1.0, tokens=3)
    async with serving(engine) as nursery:
        t0 = trio.current_time()
        first, second, third = engine.add([1]), engine.add([2]), engine.add([3])
        third.cancel()  # waiting: never runs
        assert engine.statistics().waiting == 2
        assert await first.receive() == ((2,), False)

        async def cancel_later() -> None:
            await trio.sleep(0.5)
            first.cancel()

        nursery.start_soon(cancel_later)
        with pytest.raises(trio.ClosedResourceError):
            await first.receive()  # waiting when cancelled
        assert trio.current_time() - t0 == 1.5
        assert engine.statistics() == FakeEngineStatistics(slots=1, running=0, waiting=1, steps=1)
        assert "cancelled" in repr(first)
        deltas, at = await read_all(second)
        # the step under way ended at 2 s; then three steps for the second request
        assert deltas == [(3,), (3,), (3,)] and at - t0 == 5.0
        with pytest.raises(trio.ClosedResourceError):
            await third.receive()
        second.cancel()  # a finished request: nothing to do
        await trio.sleep(10)
        assert engine.steps == 5  # the third never ran


@pytest.mark.parametrize(
    "kwargs", [{"slots": 0}, {"tokens": 0}, {"step_s": -0.1}], ids=["slots", "tokens", "step"]
)
def test_an_engine_needs_a_slot_a_token_and_a_step_of_no_negative_time(kwargs):
    with pytest.raises(ValueError, match="a fake engine needs slots >= 1, tokens >= 1"):
        FakeEngine(**kwargs)


# -- as a stage -----------------------------------------------------------------------------


def expected(prompt: list[int], stages: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(stages):
        tokens = [tokens[i % len(tokens)] + 1 for i in range(SHAPE["tokens"])]
    return tokens


async def test_a_pipeline_of_fake_engines_streams_every_token_in_order(autojump_clock):
    prompts = [[1, 2, 3], [10, 20], [5], [7, 8, 9, 10], [4, 4]]
    got: dict[int, list[list[int]]] = {}
    async with omni_trio.open_engine(fake_engine_pipeline(2, **SHAPE)) as engine:

        async def one(i: int) -> None:
            async with engine.generate(prompts[i]) as stream:
                got[i] = [list(out.token_ids) async for out in stream]

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        assert_nothing_in_flight(engine)
        steps = [b.engine.steps for sid in ("s0", "s1") for b in fake_engine_backends(engine, sid)]
    for i, prompt in enumerate(prompts):
        # streamed one token per step (the first of them may be merged while the reader
        # was not waiting), in order, one added per stage
        assert [t for delta in got[i] for t in delta] == expected(prompt, 2)
        assert len(got[i]) >= 2
    # 5 requests in 3 slots: two waves of 6 steps per stage
    assert steps == [12, 12]


async def test_a_stage_takes_its_steps_time_on_the_trio_clock(autojump_clock):
    cfg = fake_engine_pipeline(1, slots=2, step_s=1.0, tokens=3)
    done_at: dict[int, float] = {}
    async with omni_trio.open_engine(cfg) as engine:
        t0 = trio.current_time()

        async def one(i: int) -> None:
            await engine.generate([i]).collect()
            done_at[i] = trio.current_time() - t0

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
    # two at a time (whichever came first), 3 steps of 1 s each: the orchestrator adds no
    # trio-clock time to the engine's steps
    assert sorted(done_at.values()) == [3.0, 3.0, 6.0, 6.0]


async def test_a_text_prompt_is_its_utf8_bytes(autojump_clock):
    async with omni_trio.open_engine(fake_engine_pipeline(1, tokens=3)) as engine:
        outs = await engine.generate("AB").collect()
    assert [t for out in outs for t in out.token_ids] == [ord("A") + 1, ord("B") + 1, ord("A") + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "length"


@pytest.mark.parametrize("streamed", [True, False])
async def test_a_stage_nobody_streams_emits_its_finished_output_only(autojump_clock, streamed):
    cfg = fake_engine_pipeline(1, slots=1, step_s=1.0, tokens=4)
    backend = FakeEngineBackend(cfg.stages[0], stage_index=0)
    outs: list[StageOutput] = []

    async def emit(out: StageOutput) -> None:
        outs.append(out)

    async with trio.open_nursery() as nursery:
        await nursery.start(backend.serve)
        send, receive = trio.open_memory_channel[StageInput](1)
        send.send_nowait(StageInput(token_ids=(1, 2)))
        send.close()
        await backend.run_request("r", receive, None, emit, streamed=streamed)
        nursery.cancel_scope.cancel()
    assert [t for out in outs for t in out.token_ids] == [2, 3, 2, 3]
    assert [out.finished for out in outs] == ([False] * 3 if streamed else []) + [True]


async def test_an_abort_takes_the_request_out_of_the_engine(autojump_clock):
    cfg = fake_engine_pipeline(1, slots=1, step_s=1.0, tokens=3)
    async with omni_trio.open_engine(cfg) as engine:
        (backend,) = fake_engine_backends(engine, "s0")
        t0 = trio.current_time()
        results: dict[str, float] = {}

        async def second() -> None:
            await engine.generate([2], request_id="second").collect()
            results["second"] = trio.current_time() - t0

        async with engine.generate([1], request_id="first"), trio.open_nursery() as nursery:
            nursery.start_soon(second)
            await trio.sleep(1.5)
            assert backend.engine.statistics().waiting == 1
            partial = await engine.abort("first")
            assert [out.token_ids for out in partial] == [(2,)]
            assert backend.engine.statistics().running == 0
        # the aborted request's slot freed when the step under way ended (2 s)
        assert results == {"second": 5.0}
        assert_nothing_in_flight(engine)


async def test_a_consumer_leaving_mid_stream_leaves_nothing_in_the_engine(autojump_clock):
    async with omni_trio.open_engine(fake_engine_pipeline(1, **SHAPE)) as engine:
        (backend,) = fake_engine_backends(engine, "s0")
        for leave_after in range(1, SHAPE["tokens"]):
            seen = 0
            async with engine.generate([1, 2]) as stream:
                async for _out in stream:
                    seen += 1
                    if seen == leave_after:
                        break
            assert_nothing_in_flight(engine)
            stats = backend.engine.statistics()
            assert stats.running == 0 and stats.waiting == 0


async def test_cancelling_a_consumer_at_every_checkpoint_leaves_the_engines_empty(autojump_clock):
    def engines_empty(engine: omni_trio.Engine) -> None:
        for sid in ("s0", "s1"):
            for b in fake_engine_backends(engine, sid):
                stats = b.engine.statistics()
                assert stats.running == 0 and stats.waiting == 0, (sid, stats)

    async def scenario(engine: omni_trio.Engine) -> None:
        async with engine.generate([3, 4]) as stream:
            async for _out in stream:
                pass

    cfg = fake_engine_pipeline(2, slots=2, step_s=0.01, tokens=3)
    async with omni_trio.open_engine(cfg) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario, invariant=engines_empty)
    report.raise_if_failed()
    assert report.checkpoints >= 3


def test_the_options_are_checked_when_the_config_is_loaded():
    with pytest.raises(ConfigError) as info:
        fake_engine_pipeline(1, stage_options={"s0": {"slotz": 2}})
    assert info.value.path == "$.stages[0].options.slotz"
    assert "known: slots, step_s, tokens" in str(info.value)
    for bad in ({"slots": 0}, {"step_s": -1.0}, {"tokens": "many"}):
        with pytest.raises(ConfigError, match=r"\$\.stages\[1\]\.options\."):
            fake_engine_pipeline(2, stage_options={"s1": bad})
    # one stage's shape overrides the pipeline's
    cfg = fake_engine_pipeline(2, slots=4, stage_options={"s1": {"slots": 2}})
    assert [s.options["slots"] for s in cfg.stages] == [4, 2]


async def test_a_config_names_the_backend_by_its_dotted_path(autojump_clock):
    stage = {"id": "llm", "backend": FAKE_ENGINE_BACKEND, "options": {"tokens": 2}}
    cfg = load_config({"name": "fake", "stages": [{**stage, "final_output": True}]})
    async with omni_trio.open_engine(cfg) as engine:
        outs = await engine.generate([40]).collect()
        with pytest.raises(TypeError, match="stage 'llm' is not a scripted stage"):
            scripted_backends(engine, "llm")
    assert [t for out in outs for t in out.token_ids] == [41, 41]


async def test_fake_engine_backends_refuses_a_stage_of_another_backend(autojump_clock):
    async with omni_trio.open_engine(scripted_pipeline(1)) as engine:
        with pytest.raises(TypeError, match="stage 's0' is not a fake engine stage"):
            fake_engine_backends(engine, "s0")
