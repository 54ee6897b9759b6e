"""The ``talker`` backend in an engine: a scripted thinker (it records its prompt's ids on its
finished output, as a vllm stage does), the real tiny Qwen3-Omni talker and code2wav.

Aborts, failures at each step, an engine closing during a talker step, cancellation at every
checkpoint of a 3-stage request, and cleanup: nothing left in flight, no step left running."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

import omni_trio
from omni_trio import Engine
from omni_trio.errors import StageError
from omni_trio.testing import cancel_at_every_checkpoint, in_flight_problems

from .conftest import chat_prompt_ids, engine_on, scripted_thinker_pipeline, talker_state

pytestmark = pytest.mark.slow

STAGES = ("thinker", "talker", "code2wav")


@pytest.fixture(scope="module")
def qwen3_path() -> Path:
    from omni_trio.models.tiny import ensure_tiny_model

    return ensure_tiny_model("qwen3-omni", progress=False)


@pytest.fixture(scope="module")
def prompt_ids(qwen3_path: Path) -> list[int]:
    return chat_prompt_ids(qwen3_path)


def config(path: Path, *, thinker: dict[str, Any] | None = None, frames: int = 4) -> dict:
    code2wav = {
        "id": "code2wav",
        "backend": "torch",
        "stream_input": True,
        "options": {
            "factory": "omni_trio.models.qwen_omni.code2wav:build_code2wav",
            "model": str(path),
            "chunk_size": 32,
        },
    }
    return scripted_thinker_pipeline(path, code2wav, max_tokens=frames + 1, thinker=thinker)


async def test_frames_stream_into_audio_and_nothing_is_left(
    qwen3_path: Path, prompt_ids: list[int]
) -> None:
    async with engine_on(config(qwen3_path, frames=4)) as engine:
        with trio.fail_after(120):
            outs = await engine.generate(prompt_ids, output_stages=list(STAGES)).collect()
        frames = [o.token_ids for o in outs if o.stage_id == "talker" and o.token_ids]
        assert len(frames) == 4 and all(len(f) == 16 for f in frames)
        talker_last = [o for o in outs if o.stage_id == "talker"][-1]
        assert talker_last.finished and talker_last.finish_reason == "length"
        assert talker_last.metrics is not None and talker_last.metrics["frames"] == 4
        audio = [o for o in outs if o.stage_id == "code2wav"]
        # 2 frames a chunk, as they came; the finished output may close it empty
        assert [len(o.data) for o in audio if len(o.data)] == [1920 * 2 - 555, 1920 * 2]
        assert audio[-1].finished
        assert sum(len(o.data) for o in audio) == 1920 * 4 - 555
        assert in_flight_problems(engine) == []
        state = await talker_state(engine)
        assert state["decoding"] == 0 and state["frames"] == 4


async def test_abort_mid_talker_stops_within_one_step(
    qwen3_path: Path, prompt_ids: list[int]
) -> None:
    async with engine_on(config(qwen3_path, frames=500)) as engine:
        seen = 0
        with trio.fail_after(120):
            async with engine.generate(
                prompt_ids, request_id="long", output_stages=["talker"]
            ) as stream:
                async for out in stream:
                    seen += bool(out.token_ids)
                    if seen == 2:
                        await engine.abort("long")
                        break
        state = await talker_state(engine)
        # the abort waited for the running step: none runs now, and at most that one more
        # frame was decoded after the second
        assert state["decoding"] == 0 and 2 <= state["frames"] <= 3
        assert in_flight_problems(engine) == []
        # the replica goes on serving
        with trio.fail_after(120):
            outs = await engine.generate(prompt_ids, output_stages=["talker"]).collect()
        assert outs[-1].finished and outs[-1].finish_reason == "length"


async def test_a_bad_speaker_fails_that_request_only(
    qwen3_path: Path, prompt_ids: list[int]
) -> None:
    async with engine_on(config(qwen3_path, frames=2)) as engine:
        bad = {"talker": {"speaker": "nobody"}}
        with trio.fail_after(120), pytest.raises(StageError) as failed:
            await engine.generate(prompt_ids, sampling_params=bad).collect()
        assert "unknown speaker 'nobody'" in str(failed.value)
        assert "aiden" in str(failed.value) and failed.value.stage_id == "talker"
        with trio.fail_after(120):
            outs = await engine.generate(prompt_ids).collect()
        assert outs[-1].stage_id == "code2wav" and outs[-1].finished
        assert in_flight_problems(engine) == []


async def test_a_thinker_failure_never_reaches_the_talker(
    qwen3_path: Path, prompt_ids: list[int]
) -> None:
    async with engine_on(config(qwen3_path, thinker={"fail_at_output": 2})) as engine:
        with trio.fail_after(120), pytest.raises(StageError, match="fail at output 2"):
            await engine.generate(prompt_ids).collect()
        state = await talker_state(engine)
        assert state["frames"] == 0 and in_flight_problems(engine) == []


async def test_a_failing_step_fails_the_request_and_names_the_step(
    qwen3_path: Path, prompt_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_trio.models.qwen_omni.talker import Qwen3Talker

    real = Qwen3Talker.step

    def failing_at_step_2(self: Qwen3Talker, states: Any) -> Any:
        if states[0].step == 2:
            raise RuntimeError("injected")
        return real(self, states)

    monkeypatch.setattr(Qwen3Talker, "step", failing_at_step_2)
    async with engine_on(config(qwen3_path, frames=6)) as engine:
        with trio.fail_after(120), pytest.raises(StageError) as failed:
            await engine.generate(prompt_ids).collect()
        assert "the talker failed at step 2: RuntimeError: injected" in str(failed.value)
        assert isinstance(failed.value.__cause__, RuntimeError)
        state = await talker_state(engine)
        assert state["decoding"] == 0 and in_flight_problems(engine) == []


async def test_engine_close_during_a_talker_step(qwen3_path: Path, prompt_ids: list[int]) -> None:
    seen: list[bool] = []
    with trio.fail_after(180):
        async with omni_trio.open_engine(config(qwen3_path, frames=500)) as engine:
            async with engine.generate(prompt_ids, output_stages=["talker"]) as stream:
                async for out in stream:
                    seen.append(out.finished)
                    if len(seen) == 3:
                        break  # leaving both blocks closes the engine mid-decode
    # the close returned: no talker step outlived the engine (the thread finished its step)
    assert len(seen) == 3 and not any(seen)


async def test_cancel_at_every_checkpoint_of_a_three_stage_request(
    qwen3_path: Path, prompt_ids: list[int]
) -> None:
    async def scenario(engine: Engine) -> None:
        async with engine.generate(prompt_ids, output_stages=list(STAGES)) as stream:
            async for _ in stream:
                pass

    async with engine_on(config(qwen3_path, frames=2)) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario, run_timeout=120)
        report.raise_if_failed()
        assert report.checkpoints > 0
        state = await talker_state(engine)
        assert state["decoding"] == 0


async def test_concurrent_requests_share_decode_steps(
    qwen3_path: Path, prompt_ids: list[int]
) -> None:
    async with engine_on(config(qwen3_path, frames=6)) as engine:
        with trio.fail_after(120):
            alone = await engine.generate(prompt_ids, output_stages=["talker"]).collect()
        results: dict[int, list[Any]] = {}

        async def one(k: int) -> None:
            stream = engine.generate(prompt_ids, output_stages=["talker"])
            results[k] = await stream.collect()

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for k in range(3):
                    nursery.start_soon(one, k)
        frames = [[o.token_ids for o in outs if o.token_ids] for outs in results.values()]
        expected = [o.token_ids for o in alone if o.token_ids]
        assert frames == [expected] * 3  # greedy: each as if alone
        state = await talker_state(engine)
        assert state["largest_step"] > 1 and state["decoding"] == 0
        assert in_flight_problems(engine) == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, r"\$\.stages\[0\]\.options: Object missing required field `model`"),
        ({"model": "m", "speed": 2}, r"options\.speed: unknown talker option 'speed'; known: "),
        ({"model": "m", "max_batch_size": 0}, r"options\.max_batch_size: Expected `int` >= 1"),
        ({"model": "m", "dtype": "int8"}, r"options\.dtype"),
    ],
)
def test_bad_options_fail_at_config_load_naming_the_key(
    options: dict[str, Any], message: str
) -> None:
    from omni_trio.config import load_config
    from omni_trio.errors import ConfigError

    raw = {
        "name": "p",
        "stages": [{"id": "talker", "backend": "talker", "options": options, "final_output": True}],
    }
    with pytest.raises(ConfigError, match=message):
        load_config(raw)
