"""vLLM's own span nests under the stage span (a real tiny engine): the engine traces over
OTLP/HTTP to an in-process receiver, the vllm stage's ``otlp_traces_endpoint`` sends vLLM's
``llm_request`` span to the same receiver, and the stage handed vLLM its span's context."""

from __future__ import annotations

import pytest
import trio
from opentelemetry import trace

import omni_trio

from ..conftest import bounded
from ..otlp_receiver import otlp_receiver

pytestmark = pytest.mark.vllm

CALLER_TRACE = "5b8efff798038103d269b633813fc60c"
TRACEPARENT = f"00-{CALLER_TRACE}-eee19b7ec3c1b174-01"


async def test_vllms_span_nests_under_the_stage_span(monkeypatch):
    # vLLM exports with its own provider, over the protocol this variable names; it also
    # sets OTEL_EXPORTER_OTLP_TRACES_ENDPOINT in this process (for its workers), which would
    # turn tracing on for every later engine and subprocess: undone after the test (a
    # delenv of an unset variable records nothing to undo, a setenv does)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s, not 5 s
    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    with otlp_receiver() as rx:
        config = {
            "name": "traced",
            "stages": [
                {
                    "id": "thinker",
                    "backend": "vllm",
                    "engine_args": {"model": "tiny:thinker", "otlp_traces_endpoint": rx.endpoint},
                    "final_output": True,
                    "default_sampling_params": {"max_tokens": 8, "temperature": 0.0},
                }
            ],
            "tracing": {"enabled": True, "otlp_traces_endpoint": rx.endpoint},
        }
        async with omni_trio.open_engine(config) as engine:
            with bounded("a request on the tiny thinker", 120, engine):
                outs = await engine.generate(
                    "the river and the moon sing a song",
                    request_id="traced-1",
                    trace_headers={"traceparent": TRACEPARENT},
                ).collect()
            assert outs[-1].finished
            with bounded("vLLM's llm_request span at the receiver", 60, engine):
                vllm_span = await trio.to_thread.run_sync(
                    lambda: rx.wait_for(lambda s: s.name == "llm_request", 60.0)
                )
        # leaving the engine flushed its own spans
        spans = rx.spans()
        provider = trace.get_tracer_provider()  # vLLM's, global: nothing left to send
        flush = getattr(provider, "force_flush", None)
        if flush is not None:
            await trio.to_thread.run_sync(flush, 5000)
    (root,) = [s for s in spans if s.name == "omni_trio.request"]
    (stage,) = [s for s in spans if s.name == "omni_trio.stage"]
    assert root.trace_id == stage.trace_id == vllm_span.trace_id == CALLER_TRACE
    assert stage.parent_span_id == root.span_id
    assert vllm_span.parent_span_id == stage.span_id
    assert vllm_span.attributes["gen_ai.request.id"] == "traced-1"
    assert stage.attributes["omni_trio.stage.backend"] == "vllm"
    assert stage.attributes["omni_trio.stage.tokens_out"] == 8
