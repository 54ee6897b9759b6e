"""The chat ``modalities`` field and ``/v1/models`` stage metadata, end to end: a real
Hypercorn serving the shipped tiny-omni-scripted pipeline (scripted thinker and talker, the
real torch vocoder), real clients (openai, httpx)."""

from __future__ import annotations

import base64
import io
import wave

import openai
import pytest

from omni_trio.cli.runner import resolve_config_arg
from omni_trio.testing import scripted_backends, scripted_pipeline

from .conftest import client_for, running_server, wait_until_idle
from .test_app import MSG, PROMPT, expected_text

MODEL = "tiny-omni-scripted"
THINKER_TEXT = expected_text(PROMPT, ["thinker"], 32)  # the thinker's 32 scripted outputs
FRAMES = 64 * 160  # the talker's 64 codes, 160 samples each from the vocoder


def omni_scripted() -> str:
    return resolve_config_arg(MODEL)


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


async def test_text_only_chat_never_runs_the_audio_stages():
    async with running_server(omni_scripted()) as (engine, base):
        oai = client(base)
        for modalities in (None, ["text"]):
            extra = {} if modalities is None else {"modalities": modalities}
            resp = await oai.chat.completions.create(model=MODEL, messages=MSG, **extra)
            assert resp.choices[0].message.content == THINKER_TEXT
            assert resp.choices[0].message.audio is None
        stream = await oai.chat.completions.create(
            model=MODEL, messages=MSG, modalities=["text"], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == THINKER_TEXT
        await oai.close()
        assert len(scripted_backends(engine, "thinker")[0].completed) == 3
        # the talker (and so the vocoder, its only consumer) never saw a request
        (talker,) = scripted_backends(engine, "talker")
        assert not talker.received and not talker.completed


async def test_audio_chat_answers_with_openai_audio_message_and_a_wav():
    async with running_server(omni_scripted()) as (engine, base):
        oai = client(base)
        resp = await oai.chat.completions.create(
            model=MODEL,
            messages=MSG,
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
        )
        message = resp.choices[0].message
        assert message.content is None
        assert message.audio is not None
        assert message.audio.transcript == THINKER_TEXT
        assert message.audio.id == f"audio_{resp.id}"
        assert message.audio.expires_at == resp.created
        with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16_000)
            assert w.getnframes() == FRAMES
            pcm = w.readframes(FRAMES)
        assert any(pcm)
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage is not None and resp.usage.completion_tokens == 32
        (talker,) = scripted_backends(engine, "talker")
        assert list(talker.completed) == [resp.id]

        # pcm16 (no `audio` object at all: the default format is wav, streams use pcm16)
        async with client_for(base) as http:
            r = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": MSG, "modalities": ["audio"]},
            )
            audio = r.json()["choices"][0]["message"]["audio"]
            with wave.open(io.BytesIO(base64.b64decode(audio["data"]))) as w:
                assert w.getnframes() == FRAMES
            r = await http.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": MSG,
                    "modalities": ["text", "audio"],
                    "audio": {"voice": "x", "format": "pcm16"},
                },
            )
            raw = base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"])
            assert raw == pcm  # the same samples, without the WAV header

        # streaming: transcript and PCM16 chunks as they come, then expires_at, then finish
        stream = await oai.chat.completions.create(
            model=MODEL,
            messages=MSG,
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "pcm16"},
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        await oai.close()
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert deltas[0].role == "assistant"
        audio = [d.audio for d in deltas if d.audio is not None]
        transcript = "".join(a.transcript or "" for a in audio)
        data = b"".join(base64.b64decode(a.data) for a in audio if a.data)
        assert transcript == THINKER_TEXT
        assert data == pcm
        assert len([a for a in audio if a.data]) > 1  # streamed in several chunks
        assert {a.id for a in audio[:-1]} == {f"audio_{chunks[0].id}"}
        assert audio[-1].model_dump(exclude_none=True) == {"expires_at": chunks[0].created}
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 32
        assert engine.statistics().requests_finished == 4


async def test_modalities_bad_input_is_400_naming_the_field():
    async with running_server(omni_scripted()) as (engine, base), client_for(base) as http:
        cases = [
            ({"modalities": ["video"]}, "modalities", "modalities[0] must be 'text' or 'audio'"),
            ({"modalities": "text"}, "modalities", "non-empty list"),
            ({"modalities": []}, "modalities", "non-empty list"),
            ({"modalities": ["audio"], "audio": "wav"}, "audio", "audio must be an object"),
            (
                {"modalities": ["audio"], "audio": {"voice": "x", "format": "mp3"}},
                "audio.format",
                "'mp3' is not supported",
            ),
            (
                {"modalities": ["audio"], "stream": True, "audio": {"format": "wav"}},
                "audio.format",
                "must be 'pcm16' when stream is true",
            ),
        ]
        earlier = {"role": "assistant", "content": None, "audio": {"id": "audio_x"}}
        turns = [*MSG, earlier, *MSG]
        cases.append(({"messages": turns}, "messages[1].content", "keeps no audio"))
        for extra, param, words in cases:
            r = await http.post(
                "/v1/chat/completions", json={"model": MODEL, "messages": MSG, **extra}
            )
            assert r.status_code == 400, extra
            err = r.json()["error"]
            assert (err["param"], err["type"]) == (param, "invalid_request_error")
            assert words in err["message"], (words, err["message"])
        assert engine.statistics().requests_total == 0


async def test_audio_on_a_pipeline_without_audio_is_400_naming_what_it_produces():
    cfg = scripted_pipeline(["thinker", "talker"], name="scripted", outputs=2)
    async with running_server(cfg) as (engine, base), client_for(base) as http:
        for stream in (False, True):
            body = {"model": "scripted", "messages": MSG, "modalities": ["text", "audio"]}
            r = await http.post("/v1/chat/completions", json={**body, "stream": stream})
            assert r.status_code == 400
            message = r.json()["error"]["message"]
            assert "'audio'" in message and "text (thinker, talker)" in message
        assert engine.statistics().requests_total == 0


async def test_client_disconnect_mid_audio_stream_aborts_the_request():
    cfg = {
        "name": "slow",
        "stages": [
            {"id": "thinker", "options": {"outputs": 4}, "final_output": True},
            {
                "id": "voice",
                "inputs": ["thinker"],
                "options": {"outputs": 10_000, "latency_s": 0.02},
                "output_type": "audio",
                "final_output": True,
            },
        ],
    }
    async with running_server(cfg) as (engine, base), client_for(base) as http:
        body = {"model": "slow", "messages": MSG, "modalities": ["audio"], "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
        await wait_until_idle(engine)
        assert engine.statistics().requests_aborted == 1
        (voice,) = scripted_backends(engine, "voice")
        assert len(voice.aborted) == 1 and not voice.completed


async def test_models_list_the_stages_and_supported_tasks():
    async with running_server(omni_scripted()) as (engine, base):
        async with client_for(base) as http:
            r = await http.get("/v1/models")
        (card,) = r.json()["data"]
        assert card["id"] == MODEL and card["object"] == "model"
        assert card["supported_tasks"] == ["generate", "speech"]
        assert card["stages"] == [
            {
                "id": "thinker",
                "index": 0,
                "backend": "scripted",
                "output_type": "text",
                "inputs": [],
                "final_output": True,
                "replicas": 1,
            },
            {
                "id": "talker",
                "index": 1,
                "backend": "scripted",
                "output_type": "tokens",
                "inputs": ["thinker"],
                "final_output": False,
                "replicas": 1,
            },
            {
                "id": "code2wav",
                "index": 2,
                "backend": "torch",
                "output_type": "audio",
                "inputs": ["talker"],
                "final_output": True,
                "replicas": 1,
            },
        ]
        await engine.add_replica("talker")
        oai = client(base)
        (model,) = (await oai.models.list()).data
        await oai.close()
        extra = model.model_extra or {}
        assert extra["supported_tasks"] == ["generate", "speech"]
        assert [s["replicas"] for s in extra["stages"]] == [1, 2, 1]


@pytest.mark.parametrize("stages", [["thinker"], ["thinker", "talker"]])
async def test_models_of_a_text_only_pipeline_support_generate_only(stages):
    async with running_server(scripted_pipeline(stages, name="s")) as (_, base):
        async with client_for(base) as http:
            card = (await http.get("/v1/models")).json()["data"][0]
        assert card["supported_tasks"] == ["generate"]
        assert [s["id"] for s in card["stages"]] == stages
