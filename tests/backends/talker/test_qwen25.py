"""The ``talker`` backend on Qwen2.5-Omni in an engine: a scripted thinker (it records its
prompt's ids on its finished output, as a vllm stage does), the real tiny Qwen2.5-Omni talker
(the thinker's hidden states recomputed in the talker stage) and token2wav on the torch
backend (the whole utterance).

One code per output, audio only once the talker finished, an abort mid-decode, a bad voice,
a reply with nothing to say, a failing step, cancellation at every checkpoint, and cleanup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from omni_trio import Engine
from omni_trio.errors import StageError
from omni_trio.testing import cancel_at_every_checkpoint, in_flight_problems

from .conftest import chat_prompt_ids, engine_on, scripted_thinker_pipeline, talker_state

pytestmark = pytest.mark.slow

STAGES = ("thinker", "talker", "token2wav")


@pytest.fixture(scope="module")
def qwen25_path() -> Path:
    from omni_trio.models.tiny import ensure_tiny_model

    return ensure_tiny_model("qwen2.5-omni", progress=False)


@pytest.fixture(scope="module")
def prompt_ids(qwen25_path: Path) -> list[int]:
    return chat_prompt_ids(qwen25_path)


def config(path: Path, *, thinker: dict[str, Any] | None = None, codes: int = 6) -> dict:
    token2wav = {
        "id": "token2wav",
        "backend": "torch",
        "options": {
            "factory": "omni_trio.models.qwen_omni.token2wav:build_token2wav",
            "model": str(path),
            "num_steps": 4,
        },
    }
    return scripted_thinker_pipeline(
        path, token2wav, max_tokens=codes, talker={"speaker": "chelsie"}, thinker=thinker
    )


async def test_codes_then_one_utterance_and_nothing_is_left(
    qwen25_path: Path, prompt_ids: list[int]
) -> None:
    async with engine_on(config(qwen25_path, codes=6)) as engine:
        with trio.fail_after(120):
            outs = await engine.generate(prompt_ids, output_stages=list(STAGES)).collect()
        codes = [o.token_ids for o in outs if o.stage_id == "talker" and o.token_ids]
        assert len(codes) == 6 and all(len(c) == 1 for c in codes)
        talker_last = [o for o in outs if o.stage_id == "talker"][-1]
        assert talker_last.finished and talker_last.finish_reason == "length"
        (audio,) = [o for o in outs if o.stage_id == "token2wav"]
        # the whole utterance at once: 480 samples a code
        assert audio.finished and audio.data.shape == (480 * 6,)
        assert audio.metrics is not None and audio.metrics["sample_rate"] == 24000
        assert in_flight_problems(engine) == []
        state = await talker_state(engine)
        assert state["family"] == "qwen2.5-omni" and state["codes_per_frame"] == 1
        assert state["decoding"] == 0 and state["frames"] == 6


async def test_abort_mid_talker_stops_within_one_step(
    qwen25_path: Path, prompt_ids: list[int]
) -> None:
    async with engine_on(config(qwen25_path, codes=2000)) as engine:
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
        assert state["decoding"] == 0 and 2 <= state["frames"] <= 3
        assert in_flight_problems(engine) == []


async def test_a_bad_speaker_fails_that_request_only(
    qwen25_path: Path, prompt_ids: list[int]
) -> None:
    async with engine_on(config(qwen25_path, codes=2)) as engine:
        bad = {"talker": {"speaker": "aiden"}}  # a Qwen3-Omni voice, not this model's
        with trio.fail_after(120), pytest.raises(StageError) as failed:
            await engine.generate(prompt_ids, sampling_params=bad).collect()
        assert "unknown speaker 'aiden'; speakers are ['chelsie', 'ethan']" in str(failed.value)
        assert failed.value.stage_id == "talker"
        with trio.fail_after(120):
            outs = await engine.generate(prompt_ids).collect()
        assert outs[-1].stage_id == "token2wav" and outs[-1].finished
        assert in_flight_problems(engine) == []


async def test_a_one_token_reply_has_nothing_to_say(
    qwen25_path: Path, prompt_ids: list[int]
) -> None:
    async with engine_on(config(qwen25_path, thinker={"outputs": 1})) as engine:
        with trio.fail_after(120):
            outs = await engine.generate(prompt_ids, output_stages=list(STAGES)).collect()
        talker = [o for o in outs if o.stage_id == "talker"]
        assert [o.token_ids for o in talker] == [()] and talker[0].finished
        (audio,) = [o for o in outs if o.stage_id == "token2wav"]
        assert audio.finished and len(audio.data) == 0
        assert in_flight_problems(engine) == []


async def test_a_failing_step_fails_the_request_and_names_the_step(
    qwen25_path: Path, prompt_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_trio.models.qwen_omni.qwen25_talker import Qwen25Talker

    real = Qwen25Talker.step
    steps = 0

    def failing_at_step_2(self: Qwen25Talker, states: Any) -> Any:
        nonlocal steps
        steps += 1
        if steps == 3:
            raise RuntimeError("injected")
        return real(self, states)

    monkeypatch.setattr(Qwen25Talker, "step", failing_at_step_2)
    async with engine_on(config(qwen25_path, codes=6)) as engine:
        with trio.fail_after(120), pytest.raises(StageError) as failed:
            await engine.generate(prompt_ids).collect()
        assert "the talker failed at step 2: RuntimeError: injected" in str(failed.value)
        state = await talker_state(engine)
        assert state["decoding"] == 0 and in_flight_problems(engine) == []


async def test_cancel_at_every_checkpoint_of_a_three_stage_request(
    qwen25_path: Path, prompt_ids: list[int]
) -> None:
    async def scenario(engine: Engine) -> None:
        async with engine.generate(prompt_ids, output_stages=list(STAGES)) as stream:
            async for _ in stream:
                pass

    async with engine_on(config(qwen25_path, codes=2)) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario, run_timeout=120)
        report.raise_if_failed()
        assert report.checkpoints > 0
        state = await talker_state(engine)
        assert state["decoding"] == 0
