"""Turning tracing on and off (telemetry/settings.py, the engine): the ``tracing`` key, the
``OTEL_*`` variables, the engine's own provider exporting over OTLP/HTTP to an in-process
receiver, and no OpenTelemetry import at all while tracing is off."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import trio

import omni_trio
from omni_trio.config.pipeline import TracingConfig
from omni_trio.errors import ConfigError
from omni_trio.telemetry.settings import TracingSettings, tracing_settings
from omni_trio.testing import scripted_pipeline

from ..otlp_receiver import otlp_receiver

ON = TracingConfig(enabled=True)
OFF = TracingConfig()


@pytest.mark.parametrize(
    ("config", "env", "expected"),
    [
        (OFF, {}, None),
        (ON, {}, TracingSettings()),
        (
            TracingConfig(enabled=True, otlp_traces_endpoint="http://c:4318/v1/traces"),
            {},
            TracingSettings("http://c:4318/v1/traces"),
        ),
        (OFF, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, TracingSettings()),
        (OFF, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, TracingSettings()),
        (OFF, {"OTEL_TRACES_EXPORTER": "console"}, TracingSettings(exporter="console")),
        (OFF, {"OTEL_TRACES_EXPORTER": "none"}, None),
        (ON, {"OTEL_SDK_DISABLED": "true"}, None),
        (TracingConfig(enabled=True, sample_ratio=0.25), {}, TracingSettings(sample_ratio=0.25)),
        (
            ON,
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
            TracingSettings(sample_ratio=0.1),
        ),
    ],
)
def test_when_tracing_is_on_and_where_spans_go(config, env, expected):
    assert tracing_settings(config, env) == expected


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin'"),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
            "OTEL_TRACES_SAMPLER_ARG='2'",
        ),
    ],
)
def test_a_bad_variable_is_a_config_error_naming_it(env, named):
    with pytest.raises(ConfigError, match=named) as info:
        tracing_settings(ON, env)
    assert info.value.source == "environment"


def test_the_tracing_key_is_checked_and_true_is_short_for_enabled():
    cfg = omni_trio.load_config(scripted_pipeline(1), tracing=True)
    assert cfg.tracing == TracingConfig(enabled=True)
    with pytest.raises(ConfigError, match=r"\$\.tracing\.sample_ratio"):
        omni_trio.load_config(scripted_pipeline(1), tracing={"sample_ratio": 2})
    with pytest.raises(ConfigError, match="unknown_key"):
        omni_trio.load_config(scripted_pipeline(1), tracing={"unknown_key": 1})


async def test_an_engine_with_tracing_on_exports_its_spans_over_otlp(monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.setenv(var, "")  # restored as it was after the test, even if unset
        monkeypatch.delenv(var)
    with otlp_receiver() as rx:
        tracing = {"enabled": True, "otlp_traces_endpoint": rx.endpoint}
        async with omni_trio.open_engine(
            scripted_pipeline(2, outputs=3), tracing=tracing
        ) as engine:
            tracer = engine.tracer
            assert tracer is not None and tracer in engine.orchestrator.observers._observers
            await engine.generate("hi", request_id="otlp-1").collect()
            assert tracer.open_spans == 0
        # leaving the engine flushed its provider: every span is here, no waiting
        assert engine.tracer is None
        spans = rx.spans()
    (root,) = [s for s in spans if s.name == "omni_trio.request"]
    stages = [s for s in spans if s.name == "omni_trio.stage"]
    assert root.attributes["omni_trio.request.id"] == "otlp-1"
    assert root.service == "omni-trio"
    assert sorted(s.attributes["omni_trio.stage.id"] for s in stages) == ["s0", "s1"]
    assert {(s.trace_id, s.parent_span_id) for s in stages} == {(root.trace_id, root.span_id)}


async def test_sampled_out_requests_make_no_recorded_span(monkeypatch):
    with otlp_receiver() as rx:
        tracing = {"enabled": True, "otlp_traces_endpoint": rx.endpoint, "sample_ratio": 0.0}
        async with omni_trio.open_engine(
            scripted_pipeline(2, outputs=3), tracing=tracing
        ) as engine:
            async with engine.generate("hi", request_id="held") as stream:
                await stream.receive()
                tracer = engine.tracer
                assert tracer is not None and tracer.open_spans == 1  # its root only
                headers = tracer.stage_trace_headers("held", "s1")
                # the W3C flags' sampled bit is clear
                assert headers is not None and not int(headers["traceparent"][-2:], 16) & 1
            for i in range(5):
                await engine.generate("hi", request_id=f"s{i}").collect()
            assert tracer.open_spans == 0
        assert rx.spans() == []


def test_tracing_off_imports_no_opentelemetry():
    # a fresh interpreter: import omni_trio, run a request with tracing off (and the OTEL_*
    # variables unset), then list what got imported
    script = textwrap.dedent(
        """
        import os, sys, trio
        for var in list(os.environ):
            if var.startswith("OTEL_"):
                del os.environ[var]
        import omni_trio
        from omni_trio.testing import scripted_pipeline

        async def main():
            async with omni_trio.open_engine(scripted_pipeline(3, outputs=4)) as engine:
                assert engine.tracer is None
                assert not engine.orchestrator.observers
                outs = await engine.generate("hi").collect()
                assert len(outs) == 4
        trio.run(main)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
        loaded += sorted(m for m in sys.modules if m == "omni_trio.telemetry.spans")
        print("LOADED", loaded)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "LOADED []" in done.stdout, done.stdout


async def test_tracing_on_without_opentelemetry_says_which_extra(monkeypatch):
    # the extra absent: importing the spans module fails, the engine names the extra
    monkeypatch.setitem(sys.modules, "omni_trio.telemetry.spans", None)
    with pytest.raises(omni_trio.BackendUnavailableError, match=r"omni-trio\[otel\]"):
        omni_trio.open_engine(scripted_pipeline(1), tracing=True)
    await trio.lowlevel.checkpoint()
