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


# -- the emit fast path (stages/_emit.py) through the orchestrator ------------------------
STEPPED = """
import trio
from omni_trio import StageBackend, StageOutput
from omni_trio.stages import collect_input
from omni_trio.stages.emit import Emitter, nowait_of
from omni_trio.backends.vllm.outputs import RequestInbox
from omni_trio.backends.vllm.protocol import Flow

STEPS = 12


class Stepped(StageBackend):
    # Model-free, shaped like a vllm replica: one replica task makes, every 10 ms step, the
    # next output of every running request and hands it to the request's RequestInbox (as
    # the vllm demultiplexer does: straight through emit.nowait while the request's task
    # waits). Output k of a request carries token first_input_token + k.
    async def _start(self):
        self.inboxes = {}
        self.fast = 0  # outputs the fast path delivered

    async def _serve_forever(self):
        while True:
            await trio.sleep(0.01)
            for rid, state in list(self.inboxes.items()):
                inbox, base, k = state
                if not inbox.flow.reserve():
                    continue  # out of credit: the request waits for its consumer
                state[2] = k + 1
                last = k + 1 == STEPS
                if last:
                    del self.inboxes[rid]
                inbox.put(StageOutput(token_ids=(base + k,), finished=last))

    async def _run(self, request_id, inputs, sampling_params, emit):
        chunk = await collect_input(inputs)
        fast = nowait_of(emit)

        def counted(out):
            delivered = fast(out)
            self.fast += delivered
            return delivered

        inbox = RequestInbox(Flow(2), lambda: None, counted)
        self.inboxes[request_id] = [inbox, chunk.token_ids[-1], 0]
        try:
            last = await inbox.deliver(emit)
            assert last is None
        finally:
            self.inboxes.pop(request_id, None)
"""


def stepped_pipeline(module: str, outputs: list[str], **engine: object) -> object:
    stages = [
        {"id": "a", "backend": f"{module}:Stepped", "final_output": "a" in outputs},
        {"id": "b", "backend": f"{module}:Stepped", "inputs": ["a"], "final_output": True},
    ]
    return omni_trio.load_config({"stages": stages, **engine})


@pytest.mark.parametrize("outputs", [["b"], ["a", "b"]])
async def test_fast_path_outputs_arrive_whole_and_in_order(autojump_clock, user_module, outputs):
    # "a" alone is collected (nobody streams it), with "a" an output stage too it is routed;
    # "b" is read by the consumer. A fast consumer and one slower than the engine (its window
    # of 2 fills, the rest go through the request's task) get the same outputs, in order.
    cfg = stepped_pipeline(user_module(STEPPED), outputs, output_buffer=2)
    async with omni_trio.open_engine(cfg) as engine:
        for slow in (False, True):
            got: dict[str, list[tuple[int, ...]]] = {}
            # the slow consumer reads every 100 ms (10 steps) what came meanwhile: a burst
            # is what it reads before the clock moves
            bursts: list[list[str]] = [[]]
            async with engine.generate([5], request_id=f"r{slow}") as stream:
                t0 = trio.current_time()
                async for out in stream:
                    got.setdefault(out.stage_id, []).append(out.token_ids)
                    if not slow:
                        continue
                    if trio.current_time() == t0:
                        bursts[-1].append(out.stage_id)
                    else:  # it waited for this one: it lags from now on
                        await trio.sleep(0.1)
                        t0 = trio.current_time()
                        bursts.append([])
            # the window holds: lagging 10 steps, the consumer finds b's window (2) full, the
            # output b's task waits to deliver and what b made on its own credit (Flow(2)),
            # never more
            assert not slow or max(burst.count("b") for burst in bursts) == 2 + 1 + 2
            assert got["b"] == [(5 + 11 + k,) for k in range(12)]  # b's input: a's last token
            if "a" in outputs:
                assert got["a"] == [(5 + k,) for k in range(12)]
        fast = [engine.pools[s].replica(0).fast for s in "ab"]  # type: ignore[attr-defined]
        assert fast[1] > 0  # the consumer's stage used the fast path
        assert_nothing_in_flight(engine)


async def test_fast_path_abort_mid_stream_returns_what_was_delivered(autojump_clock, user_module):
    cfg = stepped_pipeline(user_module(STEPPED), ["b"])
    async with omni_trio.open_engine(cfg) as engine:
        async with engine.generate([1], request_id="r") as stream:
            seen = [await stream.receive() for _ in range(2)]
            partial = await engine.abort("r")
            rest = [out async for out in stream]
        b = engine.pools["b"].replica(0)
        assert b.fast >= 2  # type: ignore[attr-defined]
        # the consumer got what the stage delivered, then one abort terminal, nothing after
        delivered = [o for o in partial if o.stage_id == "b"]
        assert [o.token_ids for o in seen] == [o.token_ids for o in delivered[:2]]
        assert [o.token_ids for o in seen + rest[:-1]] == [o.token_ids for o in delivered]
        assert rest[-1].aborted and rest[-1].finished
        await trio.sleep(0.1)  # steps after the abort deliver nothing
        assert b.statistics().requests_aborted == 1 and not b.inboxes  # type: ignore[attr-defined]
        assert_nothing_in_flight(engine)


TEXT_READ = """
from omni_trio.backends.scripted import ScriptedBackend


class TextRead(ScriptedBackend):
    # scripted, noting what each request told it: is the text of its outputs read?
    seen = {}

    async def _run(self, request_id, inputs, sampling_params, emit):
        type(self).seen[(self.stage_id, request_id)] = self.outputs_text_read(request_id)
        await super()._run(request_id, inputs, sampling_params, emit)
"""


async def test_a_stage_is_told_whether_its_text_is_read(autojump_clock, user_module):
    # Only a stage nobody streams, whose downstream processors take token ids only, may leave
    # its outputs' text out: an output stage, a stage whose downstream processor takes its
    # text, and every stage while observers watch are told their text is read.
    module = user_module(TEXT_READ)

    def chain(c_processor: str | None = None) -> object:
        def stage(sid: str, up: str | None, **kw: object) -> dict[str, object]:
            inputs = [] if up is None else [up]
            return {"id": sid, "backend": f"{module}:TextRead", "inputs": inputs, **kw}

        return omni_trio.load_config(
            {
                "stages": [
                    stage("a", None),
                    stage("b", "a"),
                    stage("c", "b", final_output=True, input_processor=c_processor),
                ]
            }
        )

    async with omni_trio.open_engine(chain()) as engine:
        await engine.generate(PROMPT, request_id="plain").collect()
        await engine.generate(PROMPT, request_id="b-out", output_stages=["b", "c"]).collect()
        engine.add_observer(EngineObserver())
        await engine.generate(PROMPT, request_id="observed").collect()
        assert_nothing_in_flight(engine)
    async with omni_trio.open_engine(chain("omni_trio.stages.processors:passthrough")) as engine:
        await engine.generate(PROMPT, request_id="c-takes-text").collect()
        assert_nothing_in_flight(engine)
    seen = engine.pools["a"].replica(0).seen  # type: ignore[attr-defined]
    assert {rid: [seen[(s, rid)] for s in "abc"] for _, rid in seen} == {
        "plain": [False, False, True],
        "b-out": [False, True, True],
        "observed": [True, True, True],
        "c-takes-text": [False, True, True],
    }


# -- pipelines of thousands of stages: planned in linear time, run without nesting ----------

CHAIN = 2_000


async def test_a_2000_stage_chain_runs_a_request_through_every_stage(autojump_clock):
    # The request task runs the chain's stages one after the other in a loop; with every
    # stage an output stage (each one routed, its backend in a task of its own) the tasks
    # are siblings in one nursery: neither way nests a frame or a nursery per stage, which
    # would overflow the interpreter's recursion limit long before 2,000 stages.
    cfg = scripted_pipeline(CHAIN, outputs=2)
    ids = cfg.stage_ids
    async with omni_trio.open_engine(cfg) as engine:
        outs = await engine.generate(PROMPT, request_id="r").collect()
        assert [(o.stage_id, o.token_ids, o.finished) for o in outs] == [
            (ids[-1], (10 + CHAIN,), False),  # one token offset per stage
            (ids[-1], (20 + CHAIN,), True),
        ]
        assert all(scripted_backends(engine, sid)[0].completed == ["r"] for sid in ids)
        every = await engine.generate(PROMPT, request_id="all", output_stages=ids).collect()
        assert [o.stage_id for o in every if o.finished] == ids
        assert [o.token_ids for o in every if o.stage_id == ids[-1]] == [
            (10 + CHAIN,),
            (20 + CHAIN,),
        ]
        assert_nothing_in_flight(engine)
        assert engine.statistics().requests_finished == 2


async def test_a_long_streaming_chain_and_many_entry_stages(autojump_clock):
    # every stage of a streaming chain starts with the request (two tasks each); independent
    # entry stages run side by side, each an output stage
    n = 1_000
    streaming = scripted_pipeline(n, outputs=2, stream_input=True)
    async with omni_trio.open_engine(streaming) as engine:
        outs = await engine.generate(PROMPT, request_id="r").collect()
        assert [o.token_ids for o in outs] == [(10 + n,), (20 + n,)]
        assert_nothing_in_flight(engine)
    stages = [{"id": f"e{i}", "options": {"outputs": 1}, "final_output": True} for i in range(n)]
    async with omni_trio.open_engine({"stages": stages}) as engine:
        outs = await engine.generate(PROMPT, request_id="r").collect()
        assert sorted(o.stage_id for o in outs) == sorted(s["id"] for s in stages)
        assert {o.token_ids for o in outs} == {(11,)}
        assert_nothing_in_flight(engine)


async def test_a_long_routed_chain_cancelled_at_every_checkpoint(autojump_clock):
    # a chain long enough that its routed stages start tasks from tasks of the same
    # nursery: wherever it is cancelled, nothing of the request is left
    from omni_trio.testing import cancel_at_every_checkpoint

    n = 12
    cfg = scripted_pipeline(n, outputs=2, latency_s=0.25, final_outputs=[f"s{i}" for i in range(n)])

    async def scenario(engine: omni_trio.Engine) -> None:
        async with engine.generate(PROMPT) as stream:
            async for _ in stream:
                pass

    async with omni_trio.open_engine(cfg) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario)
        report.raise_if_failed()
        assert report.runs == report.checkpoints + 1 > 2 * n
        assert_nothing_in_flight(engine)
