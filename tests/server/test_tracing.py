"""A W3C ``traceparent`` through the server (server/tracing.py): with tracing on, the HTTP
request's span continues the caller's trace and the engine's request span nests under it;
with tracing off, the caller's headers reach the engine as they came."""

from __future__ import annotations

import trio

from omni_trio.observer import EngineObserver, RequestInfo
from omni_trio.server.tracing import incoming_trace_headers
from omni_trio.testing import scripted_pipeline

from ..otlp_receiver import otlp_receiver
from .conftest import client_for, running_server

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
BODY = {"model": "scripted", "prompt": "hello", "max_tokens": 4}


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
