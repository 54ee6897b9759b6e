"""What the served model brings to a chat: its chat template (rendered as transformers does)
and its voices (OpenAI's ``audio.voice`` -> the talker stages' ``speaker``)."""

from __future__ import annotations

import pytest
import yaml

from omni_trio.cli.runner import resolve_config_arg
from omni_trio.config import load_config
from omni_trio.pipelines import pipeline_path
from omni_trio.server.chat_model import ChatModel, render_chat, talker_stages, voice_params
from omni_trio.server.protocol import RequestValidationError, parse_chat
from omni_trio.testing import scripted_backends

from .conftest import client_for, running_server, wait_until_idle

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VOICES = {"talker": ("aiden", "chelsie", "ethan")}


def test_talker_stages_are_the_stages_on_the_talker_backend():
    assert talker_stages(load_config(resolve_config_arg("qwen3-omni"))) == ("talker",)
    # tiny-omni's talker is a vllm LLM: it has no voices
    assert talker_stages(load_config(resolve_config_arg("tiny-omni"))) == ()


def test_a_voice_becomes_each_talker_stage_speaker():
    assert voice_params("chelsie", VOICES) == {"talker": {"speaker": "chelsie"}}
    # as the talker matches them: without regard to case
    assert voice_params("Ethan", VOICES) == {"talker": {"speaker": "Ethan"}}
    two = {**VOICES, "talker2": ("ethan",)}
    assert voice_params("ethan", two) == {
        "talker": {"speaker": "ethan"},
        "talker2": {"speaker": "ethan"},
    }


def test_no_voice_changes_nothing():
    assert voice_params(None, VOICES) == {}
    assert voice_params("alloy", {}) == {}  # no talker stage: nothing to choose


def test_an_unknown_voice_names_the_voices():
    with pytest.raises(RequestValidationError) as err:
        voice_params("alloy", VOICES)
    assert err.value.param == "audio.voice"
    assert str(err.value) == (
        "audio.voice 'alloy' is not a voice of this model (stage 'talker'); "
        "voices are ['aiden', 'chelsie', 'ethan']"
    )
    with pytest.raises(RequestValidationError, match="^voice 'x' is not") as err:
        voice_params("x", VOICES, param="voice")
    assert err.value.param == "voice"


def test_render_chat_ends_with_the_assistant_turn():
    prompt = render_chat(CHATML, [("system", "Be brief."), ("user", "Hi")])
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_template_that_refuses_the_messages_is_a_bad_request():
    template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{% endfor %}"
    )
    assert render_chat(template, [("user", "Hi")]) == ""
    with pytest.raises(RequestValidationError, match="System role not supported") as err:
        render_chat(template, [("system", "x")])
    assert err.value.param == "messages"


def test_a_sandboxed_template_cannot_reach_python_internals():
    with pytest.raises(Exception, match="unsafe"):
        render_chat("{{ messages.__class__.__mro__ }}", [("user", "x")])


def test_the_chat_request_carries_its_turns_and_voice():
    body = {
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "chelsie", "format": "wav"},
    }
    req = parse_chat(body, "m")
    assert req.messages == (("system", "s"), ("user", "u"))
    assert req.voice == "chelsie" and req.audio_format == "wav"
    # a voice without audio asked for is not used
    assert parse_chat({**body, "modalities": ["text"]}, "m").voice is None


def test_a_voice_that_is_not_a_string_is_400():
    body = {
        "messages": [{"role": "user", "content": "u"}],
        "modalities": ["audio"],
        "audio": {"voice": 3},
    }
    with pytest.raises(RequestValidationError, match="audio.voice must be a string, got int"):
        parse_chat(body, "m")


async def test_a_pipeline_without_a_vllm_text_stage_has_no_template_and_no_voices():
    async with running_server(resolve_config_arg("tiny-omni-scripted")) as (engine, _):
        model = ChatModel(engine, "thinker")
        assert await model.chat_template() is None
        assert await model.voices() == {}
        assert await model.prompt([("user", "Hi")], "fallback") == "fallback"
        assert await model.voice_params("anything") == {}
        assert "template=False" in repr(model)


def qwen3_omni_after_a_scripted_thinker() -> dict:
    """The shipped qwen3-omni pipeline with a scripted thinker: the real talker (its voices)
    and code2wav, no vLLM."""
    raw = yaml.safe_load(pipeline_path("qwen3-omni").read_text())
    thinker = raw["stages"][0]
    thinker.pop("engine_args")
    thinker.update(backend="scripted", options={"outputs": 4})
    return raw


@pytest.mark.slow  # loads the tiny Qwen3-Omni talker and code2wav (torch)
async def test_an_unknown_voice_is_400_naming_the_voices_before_anything_runs():
    body = {
        "model": "qwen3-omni",
        "messages": [{"role": "user", "content": "Hi"}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"},
    }
    async with running_server(qwen3_omni_after_a_scripted_thinker()) as (engine, base):
        async with client_for(base) as http:
            for stream, fmt in ((False, "wav"), (True, "pcm16")):
                audio = {"voice": "alloy", "format": fmt}
                r = await http.post(
                    "/v1/chat/completions", json={**body, "stream": stream, "audio": audio}
                )
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["param"] == "audio.voice"
                assert "voices are ['aiden', 'chelsie', 'ethan']" in error["message"]
            speech = {"model": "qwen3-omni", "input": "Hi", "voice": "alloy"}
            r = await http.post("/v1/audio/speech", json=speech)
            assert r.status_code == 400 and r.json()["error"]["param"] == "voice"
            assert "voices are ['aiden', 'chelsie', 'ethan']" in r.json()["error"]["message"]
            # the server still serves: a text-only chat runs the scripted thinker
            text_only = {**body, "modalities": ["text"]}
            r = await http.post("/v1/chat/completions", json=text_only)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        await wait_until_idle(engine)
        # nothing of the refused requests ran: only the text-only chat reached the thinker
        assert len(scripted_backends(engine, "thinker")[0].completed) == 1
        stats = engine.statistics()
        assert stats.requests_total == 1 and stats.requests_in_flight == 0
