"""CFG companions: extra requests beside a request on its entry stage (scripted stages,
MockClock)."""

import random

import pytest
import trio
import trio.testing

import omni_trio
from omni_trio import InvalidRequestError, StageError, open_engine
from omni_trio.backends.scripted import ScriptedBackend
from omni_trio.request.companions import Companion
from omni_trio.stages.processors import token_handoff
from omni_trio.testing import (
    assert_nothing_in_flight,
    cancel_at_every_checkpoint,
    scripted_backends,
)

SEEN: list[dict] = []


def expand(prompt, sampling_params):
    """One negative companion, with more outputs than the parent (so it ends later)."""
    return [Companion("negative", "not " + prompt, {"max_tokens": 6})]


def expand_two(prompt, sampling_params):
    return [Companion("neg", [7]), Companion("uncond", [8], {"max_tokens": 1})]


def expand_raises(prompt, sampling_params):
    raise RuntimeError("no negative prompt today")


def expand_bad_role(prompt, sampling_params):
    return [Companion("a", "x"), Companion("a", "y")]


def expand_bad_prompt(prompt, sampling_params):
    return [Companion("neg", "")]


def expand_for_failure(prompt, sampling_params):
    return [Companion("bad", "x")]


def recording_processor(upstream, *, final, options):
    """What b's input processor sees: how many tokens each source's outputs carry (they
    come whole or as deltas); hands the parent's on."""
    SEEN.append({key: sum(len(o.token_ids) for o in outs) for key, outs in upstream.items()})
    return token_handoff({k: v for k, v in upstream.items() if ":" not in k}, final=final)


class FailsBadCompanion(ScriptedBackend):
    async def _run(self, request_id, inputs, sampling_params, emit):
        if request_id.endswith(":bad"):
            await trio.sleep(0.15)
            raise RuntimeError("the companion broke")
        await super()._run(request_id, inputs, sampling_params, emit)


def pipeline(hook="expand", backend="scripted", replicas=1, a_latency=0.1):
    return {
        "stages": [
            {
                "id": "a",
                "backend": backend,
                "replicas": replicas,
                "prompt_expand": f"tests.request.test_companions:{hook}",
                "options": {"outputs": 8, "latency_s": a_latency},
                "default_sampling_params": {"max_tokens": 3},
            },
            {
                "id": "b",
                "inputs": ["a"],
                "final_output": True,
                "input_processor": "tests.request.test_companions:recording_processor",
                "options": {"outputs": 2, "latency_s": 0.1},
            },
        ]
    }


async def test_companions_run_on_the_parents_replica_and_feed_the_processor(autojump_clock):
    SEEN.clear()
    async with open_engine(pipeline(replicas=3)) as engine:
        pool = engine.pools["a"]
        async with engine.generate("hi", request_id="r") as stream:
            await trio.sleep(0.15)
            # bound to the parent's replica; stage in-flight counts include the companion
            assert pool.replica_of("r:negative") is pool.replica_of("r")
            assert pool.requests_in_flight == 2
            assert engine.statistics().requests_in_flight == 1  # parents only
            outs = await stream.collect()
        assert {o.stage_id for o in outs} == {"b"}  # companion outputs never reach the caller
        assert outs[-1].finished
        assert SEEN == [{"a": 3, "a:negative": 6}]
        backend = pool.replica_of("r") or next(
            b for b in scripted_backends(engine, "a") if "r" in b.completed
        )
        assert sorted(backend.completed) == ["r", "r:negative"]
        assert backend.received["r:negative"][0].prompt == "not hi"
        assert_nothing_in_flight(engine)


async def test_the_downstream_stage_starts_only_after_every_companion(autojump_clock):
    SEEN.clear()
    async with open_engine(pipeline()) as engine:
        t0 = trio.current_time()
        async with engine.generate("hi", request_id="r") as stream:
            await stream.receive()
            # the parent's 3 outputs take 0.3 s, the companion's 6 take 0.6 s: b waited for
            # the companion, then took 0.1 s for its first output
            assert trio.current_time() - t0 == pytest.approx(0.7)
            await stream.collect()
    assert SEEN == [{"a": 3, "a:negative": 6}]


async def test_several_companions_each_under_their_role(autojump_clock):
    SEEN.clear()
    async with open_engine(pipeline("expand_two")) as engine:
        await engine.generate("hi", request_id="r").collect()
        assert_nothing_in_flight(engine)
    assert SEEN == [{"a": 3, "a:neg": 3, "a:uncond": 1}]


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        ("expand_raises", "prompt_expand hook .*expand_raises.* RuntimeError: no negative"),
        ("expand_bad_role", "role 'a': a role is a non-empty string without ':', unique"),
        ("expand_bad_prompt", "companion 'neg' of request 'r': prompt is an empty string"),
    ],
)
async def test_a_failing_expansion_raises_from_generate_and_nothing_runs(
    autojump_clock, hook, message
):
    async with open_engine(pipeline(hook)) as engine:
        with pytest.raises(InvalidRequestError, match=message):
            engine.generate("hi", request_id="r")
        assert engine.statistics().requests_total == 0
        assert scripted_backends(engine, "a")[0].requests_seen == 0


async def test_aborting_the_parent_aborts_its_companions(autojump_clock):
    async with open_engine(pipeline()) as engine:
        async with engine.generate("hi", request_id="r") as stream:
            await trio.sleep(0.15)
            await stream.abort()
        backend = scripted_backends(engine, "a")[0]
        assert sorted(backend.aborted) == ["r", "r:negative"]
        assert_nothing_in_flight(engine)


async def test_a_failing_companion_fails_the_parent_naming_its_role(autojump_clock):
    cfg = pipeline("expand_for_failure", backend="tests.request.test_companions:FailsBadCompanion")
    async with open_engine(cfg) as engine:
        with pytest.raises(StageError, match="companion 'bad' of request 'r' failed on stage 'a'"):
            await engine.generate("hi", request_id="r").collect()
        assert engine.statistics().requests_failed == 1
        assert scripted_backends(engine, "a")[0].aborted == ["r"]  # the parent was cancelled
        assert_nothing_in_flight(engine)


async def test_a_dead_replica_fails_the_parent_of_its_companion(autojump_clock):
    async with open_engine(pipeline(replicas=2)) as engine:
        async with engine.generate("hi", request_id="r") as stream:
            await trio.sleep(0.15)
            engine.pools["a"].replica_of("r").kill(RuntimeError("crash"))
            with pytest.raises(StageError):
                await stream.collect()
        assert_nothing_in_flight(engine)


async def test_nothing_of_any_group_remains_after_mixed_requests(autojump_clock):
    rng = random.Random(7)
    cfg = pipeline("expand_for_failure", backend="tests.request.test_companions:FailsBadCompanion")
    cfg["stages"][0]["prompt_expand"] = "tests.request.test_companions:expand_mixed"
    outcomes = {"ok": 0, "failed": 0, "aborted": 0}
    async with open_engine(cfg) as engine:

        async def one(i):
            with trio.move_on_after(rng.choice([0.05, 0.2, 10.0])) as scope:
                try:
                    await engine.generate(f"p{i}", request_id=f"r{i}").collect()
                except StageError:
                    outcomes["failed"] += 1
                    return
            outcomes["aborted" if scope.cancelled_caught else "ok"] += 1

        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(one, i)
        assert sum(outcomes.values()) == 1000
        assert min(outcomes.values()) > 0
        assert engine.pools["a"].requests_in_flight == 0
        assert_nothing_in_flight(engine)


def expand_mixed(prompt, sampling_params):
    """Two companions; every fifth request's second one fails."""
    n = int(prompt[1:])
    return [Companion("neg", prompt), Companion("bad" if n % 5 == 0 else "uncond", prompt)]


@pytest.mark.parametrize("stream_input", [False, True])
async def test_cancel_at_every_checkpoint_of_a_request_with_companions(
    autojump_clock, stream_input
):
    SEEN.clear()
    cfg = pipeline()
    cfg["stages"][1]["stream_input"] = stream_input  # b waits for the companions either way

    async def scenario(engine):
        async with engine.generate("hi") as stream:
            async for _ in stream:
                pass

    async with open_engine(cfg) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario)
        report.raise_if_failed()
        assert report.runs == report.checkpoints + 1 >= 3
        assert engine.pools["a"].requests_in_flight == 0
        assert_nothing_in_flight(engine)
    # whenever b ran, its processor saw both the parent's and the companion's whole output
    assert SEEN and all(seen == {"a": 3, "a:negative": 6} for seen in SEEN)


async def test_the_default_processor_hands_on_the_parents_output_only(autojump_clock):
    cfg = pipeline()
    del cfg["stages"][1]["input_processor"]  # token_handoff
    async with open_engine(cfg) as engine:
        await engine.generate("\x05", request_id="r").collect()
        (chunk,) = scripted_backends(engine, "b")[0].received["r"]
        # a's 3 outputs for the parent (byte 5, + 1 each), not the companion's 6
        assert chunk.token_ids == (6, 6, 6) and chunk.source == "a"


def test_companion_is_exported():
    assert omni_trio.Companion is Companion
