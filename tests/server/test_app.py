"""The HTTP server end to end: real Hypercorn on a free port, real clients (openai, httpx)."""

from __future__ import annotations

import io
import json
import re
import wave
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import omni_trio
from omni_trio.server import create_app, serve_http
from omni_trio.testing import scripted_backends, scripted_pipeline, scripted_tokens

from .conftest import client_for, running_server, wait_until_idle

MSG = [{"role": "user", "content": "hi"}]
PROMPT = "user: hi\nassistant:"  # the documented chat template


def expected_text(prompt: str, stages: list[str], n: int) -> str:
    """What a chain of scripted stages answers (each hop adds token_offset=1)."""
    tokens = list(prompt.encode())
    for _ in stages:
        tokens = scripted_tokens(tokens, n)
    return "".join(f"{stages[-1]}:{t} " for t in tokens)


def sse_events(body: str) -> list[str]:
    return [line.removeprefix("data: ") for line in body.split("\n\n") if line]


def two_stage(**kw):
    return scripted_pipeline(["thinker", "talker"], name="scripted", outputs=4, **kw)


async def test_chat_with_the_openai_client_non_streaming_and_streaming():
    async with running_server(two_stage()) as (engine, base):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        resp = await client.chat.completions.create(model="scripted", messages=MSG)
        assert resp.choices[0].message.content == expected_text(PROMPT, ["t", "talker"], 4)
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage is not None and resp.usage.completion_tokens == 4
        assert resp.id.startswith("chatcmpl-")

        stream = await client.chat.completions.create(
            model="scripted",
            messages=MSG,
            stream=True,
            max_tokens=2,
            stream_options={"include_usage": True},
        )
        deltas, finishes, usage = [], [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                deltas.append(choice.delta.content or "")
                finishes.append(choice.finish_reason)
        # max_tokens maps to the text stage's sampling params: 2 outputs, not 4
        assert "".join(deltas) == expected_text(PROMPT, ["t", "talker"], 4)[: len("".join(deltas))]
        assert "".join(deltas).count("talker:") == 2
        assert finishes[-1] == "length" and finishes[0] is None
        assert usage is not None and usage.completion_tokens == 2
        models = await client.models.list()
        assert [m.id for m in models.data] == ["scripted"]
        await client.close()
        assert engine.statistics().requests_finished == 2


async def test_completions_json_and_sse_with_httpx():
    async with running_server(two_stage()) as (engine, base), client_for(base) as http:
        r = await http.post("/v1/completions", json={"model": "scripted", "prompt": "abc"})
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == expected_text("abc", ["t", "talker"], 4)
        assert body["usage"]["completion_tokens"] == 4

        r = await http.post(
            "/v1/completions", json={"model": "scripted", "prompt": [10, 20], "stream": True}
        )
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        # token ids in, token ids +2 out after two hops
        assert text == "talker:12 talker:22 talker:12 talker:22 "
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_client_disconnect_mid_stream_aborts_the_request_in_every_stage():
    cfg = scripted_pipeline(
        ["thinker", "talker"], name="scripted", outputs=10_000, latency_s=0.02, stream_input=True
    )
    async with running_server(cfg) as (engine, base), client_for(base) as http:
        body = {"model": "scripted", "messages": MSG, "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break
            assert engine.statistics().requests_in_flight == 1
        # leaving the block closed the connection mid-stream
        await wait_until_idle(engine)
        stats = engine.statistics()
        assert stats.requests_aborted == 1 and stats.requests_finished == 0
        for sid in ("thinker", "talker"):
            (backend,) = scripted_backends(engine, sid)
            assert len(backend.aborted) == 1, sid
            assert not backend.completed


async def test_client_giving_up_on_a_non_streaming_request_aborts_it():
    cfg = scripted_pipeline(["thinker", "talker"], name="scripted", hang=True)
    async with running_server(cfg) as (engine, base):
        async with httpx.AsyncClient(base_url=base, timeout=0.5) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/completions", json={"model": "scripted", "prompt": "x"})
        await wait_until_idle(engine)
        assert engine.statistics().requests_aborted == 1
        for sid in ("thinker", "talker"):
            assert len(scripted_backends(engine, sid)[0].aborted) == 1


async def test_bad_requests_get_400_with_an_openai_error_body():
    async with running_server(two_stage()) as (engine, base), client_for(base) as http:
        cases = [
            (b"{not json", None, "not valid JSON"),
            ({"model": "gpt-4", "messages": MSG}, "model", "'gpt-4' does not exist"),
            ({"model": "scripted", "messages": MSG, "max_tokens": -1}, "max_tokens", ">= 1"),
            ({"model": "scripted", "messages": MSG, "temperature": "hot"}, "temperature", "number"),
            ({"model": "scripted", "messages": MSG, "top_p": 1.5}, "top_p", "(0, 1]"),
            ({"model": "scripted", "messages": []}, "messages", "non-empty"),
            ({"model": "scripted", "messages": [{"role": "bot"}]}, "messages[0].role", "role"),
            ({"model": "scripted", "messages": MSG, "stream": "yes"}, "stream", "boolean"),
            ({"model": "scripted", "messages": MSG, "n": 2}, "n", "n=1"),
        ]
        for body, param, words in cases:
            if isinstance(body, bytes):
                r = await http.post("/v1/chat/completions", content=body)
            else:
                r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, body
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error"
            assert err["param"] == param
            assert words in err["message"], (words, err["message"])
        r = await http.post("/v1/completions", json={"model": "scripted", "prompt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = await http.post("/v1/audio/speech", json={"model": "scripted", "input": "x"})
        assert r.status_code == 400 and "no audio output stage" in r.json()["error"]["message"]
        # none of it reached the engine, and the server still serves
        assert engine.statistics().requests_total == 0
        r = await http.post("/v1/completions", json={"model": "scripted", "prompt": "ok"})
        assert r.status_code == 200


async def test_a_speech_request_the_engine_fails_is_a_json_error_not_a_cut_connection():
    # the speech answer is raw WAV bytes; an error is still an OpenAI JSON error body
    cfg = {
        "name": "speak",
        "stages": [
            {
                "id": "voice",
                "backend": "scripted",
                "options": {"outputs": 4, "fail_at_output": 2},
                "final_output": True,
                "output_type": "audio",
            }
        ],
    }
    async with running_server(cfg) as (engine, base), client_for(base) as http:
        r = await http.post("/v1/audio/speech", json={"model": "speak", "input": "hello"})
        assert r.status_code == 500, r.text
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert "voice" in err["message"]
        assert engine.statistics().requests_failed == 1
        # the server still answers
        r = await http.get("/health")
        assert r.status_code == 200


def hanging_and_full(**limits: object) -> omni_trio.PipelineConfig:
    """One hanging scripted stage under ``limits``, refusing what does not fit."""
    return scripted_pipeline(
        ["thinker"], name="scripted", hang=True, engine_options={**limits, "admission": "reject"}
    )


@asynccontextmanager
async def one_admitted_stream(http: httpx.AsyncClient, body: dict) -> AsyncIterator[None]:
    """A streamed chat request, admitted (its role chunk read), open until the block ends."""
    async with http.stream("POST", "/v1/chat/completions", json=body) as first:
        assert first.status_code == 200
        # keep the line iterator referenced: a dropped one is finalized, which closes the
        # response, which the server rightly takes as a disconnect (an abort)
        lines = first.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):  # the role chunk: admitted
                break
        yield
        del lines


async def test_overload_is_429_and_the_openai_client_sees_a_rate_limit_error():
    cfg = hanging_and_full(max_requests_in_flight=1)
    async with running_server(cfg) as (engine, base), client_for(base) as http:
        body = {"model": "scripted", "messages": MSG, "stream": True}
        async with one_admitted_stream(http, body):
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 429
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert "max_requests_in_flight" in r.json()["error"]["message"]
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(model="scripted", messages=MSG)
            await client.close()
            assert engine.statistics().requests_in_flight == 1
        await wait_until_idle(engine)
        assert engine.statistics().requests_aborted == 1


async def test_a_full_graph_under_reject_is_429_naming_max_requests_in_graph():
    cfg = hanging_and_full(max_requests_in_graph=1)
    async with running_server(cfg) as (engine, base), client_for(base) as http:
        body = {"model": "scripted", "messages": MSG, "stream": True}
        async with one_admitted_stream(http, body):
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 429
            assert "max_requests_in_graph" in r.json()["error"]["message"]
            assert engine.statistics().requests_in_graph == 1
        await wait_until_idle(engine)
        assert engine.statistics().requests_in_graph == 0  # the disconnect gave it back


async def test_stage_failure_is_500_and_affects_only_that_request():
    fail = scripted_pipeline(
        ["thinker", "talker"],
        name="scripted",
        outputs=4,
        stage_options={"talker": {"fail_at_output": 2}},
    )
    async with running_server(fail) as (engine, base), client_for(base) as http:
        r = await http.post("/v1/chat/completions", json={"model": "scripted", "messages": MSG})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "talker" in err["message"]
        assert "fail at output 2" in err["message"]
        # streaming: the failure arrives as an error event after the outputs, then [DONE]
        body = {"model": "scripted", "messages": MSG, "stream": True}
        r = await http.post("/v1/chat/completions", json=body)
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert "fail at output 2" in json.loads(events[-2])["error"]["message"]
        assert engine.statistics().requests_failed == 2
        r = await http.get("/health")
        assert r.status_code == 200  # a request-scoped error leaves the stages healthy


PICKY_PROCESSOR = """
from omni_trio import InvalidRequestError


def picky(upstream, *, final, options):
    raise InvalidRequestError("the prompt asks for a voice this talker does not have")
"""


async def test_a_processor_rejecting_the_request_is_400_naming_its_stage(user_module):
    picky = f"{user_module(PICKY_PROCESSOR)}:picky"
    cfg = omni_trio.load_config(
        {
            "name": "scripted",
            "stages": [
                {"id": "thinker", "options": {"outputs": 4}},
                {
                    "id": "talker",
                    "inputs": ["thinker"],
                    "input_processor": picky,
                    "final_output": True,
                },
            ],
        }
    )
    rejected = (
        r"^the input processor of stage 'talker' rejected request 'chatcmpl-\w+': "
        r"the prompt asks for a voice this talker does not have$"
    )
    async with running_server(cfg) as (engine, base), client_for(base) as http:
        body = {"model": "scripted", "messages": MSG}
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and re.match(rejected, err["message"])
        # streaming: the stream has begun (its role delta), so the error is its last event
        r = await http.post("/v1/chat/completions", json={**body, "stream": True})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "invalid_request_error" and re.match(rejected, err["message"])
        assert engine.statistics().requests_failed == 2
        await wait_until_idle(engine)
        r = await http.get("/health")
        assert r.status_code == 200  # a rejected request leaves the stages healthy


async def test_metrics_endpoint_parses_and_counts_requests():
    async with running_server(two_stage()) as (engine, base), client_for(base) as http:
        for _ in range(3):
            r = await http.post("/v1/completions", json={"model": "scripted", "prompt": "ab"})
            assert r.status_code == 200
        r = await http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(r.text)}
        value = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
        assert value["omni_trio_requests_finished_total"] == 3
        assert value["omni_trio_requests_total"] == 3
        assert value["omni_trio_requests_running"] == 0
        latency = families["omni_trio_request_latency_seconds"]
        counts = {s.labels["status"]: s.value for s in latency.samples if s.name.endswith("_count")}
        assert counts == {"finished": 3}
        transfers = [s for s in families["omni_trio_transfers"].samples if s.name.endswith("total")]
        assert {(s.labels["source"], s.labels["target"]) for s in transfers} == {
            ("thinker", "talker")
        }
        assert all(s.value >= 3 for s in transfers)


async def test_engine_closed_is_503():
    async with omni_trio.open_engine(two_stage()) as engine:
        pass
    async with trio.open_nursery() as nursery:
        app = create_app(engine)
        port = await nursery.start(partial(serve_http, engine, host="127.0.0.1", port=0, app=app))
        async with client_for(f"http://127.0.0.1:{port}") as http:
            r = await http.post("/v1/completions", json={"model": "scripted", "prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_closed"
            r = await http.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "closed"
        nursery.cancel_scope.cancel()
    assert app.state.engine is engine


@pytest.mark.slow
async def test_speech_returns_a_wav_from_the_torch_vocoder_stage():
    cfg = {
        "name": "speak",
        "stages": [
            {
                "id": "thinker",
                "backend": "scripted",
                "options": {"outputs": 6},
                "final_output": True,
            },
            {
                "id": "code2wav",
                "backend": "torch",
                "inputs": ["thinker"],
                "output_type": "audio",
                "final_output": True,
                "stream_input": True,
                "options": {"chunk_size": 2},
            },
        ],
    }
    async with running_server(cfg) as (engine, base), client_for(base) as http:
        r = await http.post("/v1/audio/speech", json={"model": "speak", "input": "hello"})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "audio/wav"
        with wave.open(io.BytesIO(r.content)) as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16_000)
            # 6 codes x hop 160: every streamed chunk was concatenated
            assert w.getnframes() == 6 * 160
            assert any(w.readframes(960))
        r = await http.post(
            "/v1/audio/speech", json={"model": "speak", "input": "hi", "response_format": "mp3"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
        assert engine.statistics().requests_finished == 1
