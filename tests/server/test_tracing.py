"""A W3C ``traceparent`` through the server (server/tracing.py): with tracing on, the HTTP
request's span continues the caller's trace and the engine's request span nests under it;
with tracing off, the caller's headers reach the engine as they came."""

from __future__ import annotations

from typing import Any

import openai
import trio

from omni_trio.observer import EngineObserver, RequestInfo
from omni_trio.server.tracing import incoming_trace_headers
from omni_trio.testing import scripted_pipeline

from ..otlp_receiver import otlp_receiver
from .conftest import client_for, running_server
from .test_realtime import in_thread, read_until, send_resume, user_text
from .test_realtime import pipeline as realtime_pipeline

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
BODY = {"model": "scripted", "prompt": "hello", "max_tokens": 4}


def connect(base: str, headers: dict[str, str]) -> Any:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    return client.realtime.connect(model="scripted", max_retries=0, extra_headers=headers)


class Infos(EngineObserver):
    def __init__(self) -> None:
        self.infos: dict[str, RequestInfo] = {}

    def request_info(self, request_id: str, info: RequestInfo, t: float) -> None:
        self.infos[request_id] = info


def test_incoming_trace_headers_need_a_traceparent():
    scope = {"headers": [(b"tracestate", b"a=1")]}
    assert incoming_trace_headers(scope) is None
    scope["headers"].append((b"traceparent", TRACEPARENT.encode()))
    assert incoming_trace_headers(scope) == {"traceparent": TRACEPARENT, "tracestate": "a=1"}


async def test_a_traceparent_continues_through_the_server_into_the_engine():
    with otlp_receiver() as rx:
        tracing = {"enabled": True, "otlp_traces_endpoint": rx.endpoint}
        async with running_server(scripted_pipeline(2, outputs=3), tracing=tracing) as (
            engine,
            base,
        ):
            async with client_for(base) as client:
                with trio.fail_after(30):
                    r = await client.post(
                        "/v1/completions", json=BODY, headers={"traceparent": TRACEPARENT}
                    )
                assert r.status_code == 200
                # a request without a traceparent starts a trace of its own
                with trio.fail_after(30):
                    r = await client.post("/v1/completions", json=BODY)
                assert r.status_code == 200
        spans = rx.spans()  # the engine's provider was flushed when it closed
    http = [s for s in spans if s.name == "POST /v1/completions"]
    roots = [s for s in spans if s.name == "omni_trio.request"]
    assert len(http) == 2 and len(roots) == 2
    (continued,) = [s for s in http if s.trace_id == CALLER_TRACE]
    assert continued.parent_span_id == CALLER_SPAN
    assert continued.attributes["http.response.status_code"] == 200
    (own,) = [s for s in http if s is not continued]
    assert own.parent_span_id == ""
    for h in http:
        (root,) = [r for r in roots if r.trace_id == h.trace_id]
        assert root.parent_span_id == h.span_id
        stages = [s for s in spans if s.name == "omni_trio.stage" and s.trace_id == h.trace_id]
        assert len(stages) == 2 and {s.parent_span_id for s in stages} == {root.span_id}


async def test_without_tracing_the_callers_headers_reach_the_engine():
    async with running_server(scripted_pipeline(2, outputs=3)) as (engine, base):
        assert engine.tracer is None
        infos = Infos()
        engine.add_observer(infos)
        headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
        async with client_for(base) as client:
            with trio.fail_after(30):
                r = await client.post("/v1/completions", json=BODY, headers=headers)
                assert r.status_code == 200
                r = await client.post("/v1/completions", json=BODY)
                assert r.status_code == 200
    first, second = infos.infos.values()
    assert first.trace_headers == headers
    assert second.trace_headers is None


async def test_a_websockets_traceparent_continues_into_its_sessions_turns():
    # the first connection's turn continues its caller's trace; the session resumed on a
    # second connection continues that one's
    resumer_trace = "5bf92f3577b34da6a3ce929d0e0e4736"
    resumer = f"00-{resumer_trace}-{CALLER_SPAN}-01"

    def first(base: str) -> tuple[str, str]:
        with connect(base, {"traceparent": TRACEPARENT}) as conn:
            created = read_until(conn, "session.created")[-1]
            user_text(conn, "one")
            conn.response.create()
            read_until(conn, "response.done")
            return created.session.id, created.session.resume_token

    def second(base: str, sid: str, token: str) -> None:
        with connect(base, {"traceparent": resumer}) as conn:
            read_until(conn, "session.created")
            send_resume(conn, sid, token, 0)
            read_until(conn, "session.resumed")
            user_text(conn, "two")
            conn.response.create()
            read_until(conn, "response.done")

    config = realtime_pipeline(outputs=2, sessions={"detach_grace_s": 30})
    with otlp_receiver() as rx:
        tracing = {"enabled": True, "otlp_traces_endpoint": rx.endpoint}
        async with running_server(config, tracing=tracing) as (_, base):
            sid, token = await in_thread(first, base)
            await in_thread(second, base, sid, token)
        spans = rx.spans()
    sockets = {s.trace_id: s for s in spans if s.name == "GET /v1/realtime"}
    assert set(sockets) == {CALLER_TRACE, resumer_trace}
    assert {s.parent_span_id for s in sockets.values()} == {CALLER_SPAN}
    assert sockets[CALLER_TRACE].attributes["http.response.status_code"] == 101
    roots = {
        s.attributes["omni_trio.request.id"]: s for s in spans if s.name == "omni_trio.request"
    }
    assert set(roots) == {f"{sid}/turn-0", f"{sid}/turn-1"}
    for turn, trace_id in ((0, CALLER_TRACE), (1, resumer_trace)):
        root = roots[f"{sid}/turn-{turn}"]
        assert (root.trace_id, root.parent_span_id) == (trace_id, sockets[trace_id].span_id)


async def test_without_tracing_a_websockets_headers_reach_its_turns():
    headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}

    def converse(base: str) -> None:
        with connect(base, headers) as conn:
            read_until(conn, "session.created")
            user_text(conn, "one")
            conn.response.create()
            read_until(conn, "response.done")

    async with running_server(realtime_pipeline(outputs=2)) as (engine, base):
        infos = Infos()
        engine.add_observer(infos)
        await in_thread(converse, base)
    ((request_id, info),) = infos.infos.items()
    assert request_id.endswith("/turn-0") and info.trace_headers == headers
