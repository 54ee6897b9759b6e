"""The request guard and error bodies, over a real Hypercorn: 404/405 bodies, the body limit
(413 before the body is read whole), malformed JSON (deep nesting, lone surrogates), a
client that disconnects during its upload, and the access log."""

from __future__ import annotations

import json
import logging
import re

import pytest

from omni_trio.server.protocol import RequestValidationError, decode_json
from omni_trio.testing import scripted_pipeline

from .conftest import client_for, raw_connection, read_response, running_server, watch_logs

MSG = [{"role": "user", "content": "hi"}]
LIMIT = 4096


def one_stage(**kw):
    return scripted_pipeline(["thinker"], name="scripted", outputs=2, **kw)


def status_and_json(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body), head


def assert_openai_error(body: dict, *, words: str) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"], err["message"]
    return err


async def test_404_and_405_answer_with_the_openai_error_body():
    async with running_server(one_stage()) as (_, base), client_for(base) as http:
        r = await http.get("/v1/nothing-here")
        assert r.status_code == 404
        err = assert_openai_error(r.json(), words="/v1/nothing-here")
        assert err["code"] == "not_found" and err["type"] == "invalid_request_error"

        r = await http.get("/v1/chat/completions")
        assert r.status_code == 405
        assert r.headers["allow"] == "POST"
        err = assert_openai_error(r.json(), words="does not accept GET; allowed: POST")
        assert err["code"] == "method_not_allowed"
        r = await http.post("/health")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


async def test_a_body_over_the_limit_is_413_and_the_server_keeps_serving():
    options = {"max_body_bytes": LIMIT}
    async with running_server(one_stage(), serve_options=options) as (engine, base):
        async with client_for(base) as http:
            big = {"model": "scripted", "messages": [{"role": "user", "content": "x" * LIMIT}]}
            r = await http.post("/v1/chat/completions", json=big)
            assert r.status_code == 413
            err = assert_openai_error(r.json(), words=f"at most {LIMIT} bytes")
            assert err["code"] == "request_too_large"
        async with client_for(base) as http:
            r = await http.post("/v1/chat/completions", json={"model": "scripted", "messages": MSG})
            assert r.status_code == 200
        assert engine.statistics().requests_total == 1


async def test_an_upload_passing_the_limit_is_answered_before_it_ends():
    # chunked (no Content-Length): the server can only count; the upload never ends, so a
    # server that read it whole would never answer
    async with running_server(one_stage(), serve_options={"max_body_bytes": LIMIT}) as (_, base):
        port = int(base.rsplit(":", 1)[1])
        stream = await raw_connection(port)
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"a" * 1024
        await stream.send_all(head + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 5)
        status, body, headers = status_and_json(await read_response(stream))
        assert status == 413
        assert b"connection: close" in headers.lower()
        assert_openai_error(body, words=f"at most {LIMIT} bytes")
        await stream.aclose()


async def test_a_declared_content_length_over_the_limit_is_413_at_once():
    # the header claims more than the limit and no body follows (a lie, or a slow upload):
    # the answer must not wait for it
    async with running_server(one_stage(), serve_options={"max_body_bytes": LIMIT}) as (_, base):
        port = int(base.rsplit(":", 1)[1])
        with watch_logs() as logs:
            stream = await raw_connection(port)
            await stream.send_all(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n{"
            )
            status, body, _ = status_and_json(await read_response(stream))
            assert status == 413
            assert_openai_error(body, words="declares 999999999 bytes")
            line = await logs.wait_for(lambda m: m.startswith("POST /v1/completions 413"))
            assert "body not read" in line
            await stream.aclose()


async def test_deeply_nested_json_and_lone_surrogates_are_400():
    async with running_server(one_stage()) as (engine, base), client_for(base) as http:
        deep = b"[" * 100_000 + b"]" * 100_000
        r = await http.post("/v1/chat/completions", content=deep)
        assert r.status_code == 400
        assert_openai_error(r.json(), words="nests JSON arrays/objects too deeply")

        lone = b'{"model": "scripted", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
        r = await http.post("/v1/chat/completions", content=lone)
        assert r.status_code == 400
        assert_openai_error(r.json(), words="lone UTF-16 surrogate")
        assert "$.messages[0].content" in r.json()["error"]["message"]
        # the surrogate's bytes encoded raw are not UTF-8 at all
        raw = '{"model": "scripted", "prompt": "\ud800"}'.encode("utf-8", "surrogatepass")
        r = await http.post("/v1/completions", content=raw)
        assert r.status_code == 400
        assert_openai_error(r.json(), words="not valid UTF-8")
        assert engine.statistics().requests_total == 0
        # a surrogate pair is a valid character and passes
        pair = b'{"model": "scripted", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
        r = await http.post("/v1/chat/completions", content=pair)
        assert r.status_code == 200


def test_decode_json_names_what_is_wrong():
    assert decode_json(b'{"a": ["\\ud83d\\ude00"]}') == {"a": ["\U0001f600"]}
    with pytest.raises(RequestValidationError, match=r"at \$\.a\[1\]"):
        decode_json(b'{"a": ["ok", "\\udc00"]}')
    with pytest.raises(RequestValidationError, match="a key"):
        decode_json(b'{"\\ud800": 1}')
    with pytest.raises(RequestValidationError, match="not valid JSON"):
        decode_json(b"{")


async def test_a_disconnect_during_the_upload_is_one_info_line():
    async with running_server(one_stage()) as (engine, base):
        port = int(base.rsplit(":", 1)[1])
        with watch_logs("omni_trio") as logs, watch_logs("hypercorn") as hyper:
            stream = await raw_connection(port)
            await stream.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Length: 1000\r\n\r\n" + b'{"model": "scr'
            )
            await stream.aclose()
            line = await logs.wait_for(lambda m: "client disconnected during upload" in m)
        assert line.startswith("POST /v1/chat/completions 499 request_id=")
        assert [r.getMessage() for r in logs.records if r.levelno > logging.INFO] == []
        assert not hyper.records
        assert [r for r in logs.records if r.getMessage() == line][0].levelno == logging.INFO
        assert engine.statistics().requests_total == 0


async def test_one_access_line_per_request_with_its_request_id():
    async with running_server(one_stage()) as (_, base), client_for(base) as http:
        with watch_logs("omni_trio.server.access") as logs:
            r = await http.post("/v1/completions", json={"model": "scripted", "prompt": "ab"})
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            assert r.json()["id"] == f"cmpl-{rid}"  # the OpenAI id carries the request id
            await http.get("/health")
            await http.get("/missing")
            await logs.wait_for(lambda m: m.startswith("GET /missing"))
        lines = [rec.getMessage() for rec in logs.records]
        assert len(lines) == 3, lines
        assert all(rec.levelno == logging.INFO for rec in logs.records)
        pattern = r"(POST|GET) (\S+) (\d{3}) request_id=(\w+) (\d+\.\d)ms"
        parsed = [re.fullmatch(pattern, line) for line in lines]
        assert all(parsed), lines
        assert [(m[1], m[2], m[3]) for m in parsed if m] == [
            ("POST", "/v1/completions", "200"),
            ("GET", "/health", "200"),
            ("GET", "/missing", "404"),
        ]
        assert parsed[0] is not None and parsed[0][4] == rid


async def test_a_content_length_lying_small_cannot_smuggle_a_larger_body():
    # h11 frames the body by Content-Length: extra bytes are a new (malformed) request, so
    # a lie on the small side cannot smuggle a large body past the limit
    async with running_server(one_stage(), serve_options={"max_body_bytes": LIMIT}) as (_, base):
        port = int(base.rsplit(":", 1)[1])
        stream = await raw_connection(port)
        body = b'{"model": "scripted", "prompt": "' + b"y" * (2 * LIMIT) + b'"}'
        await stream.send_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n" + body
        )
        raw = await read_response(stream)
        statuses = [int(m) for m in re.findall(rb"HTTP/1.1 (\d{3})", raw)]
        assert statuses[0] == 400  # the first 10 bytes are not JSON
        assert 200 not in statuses
        await stream.aclose()
