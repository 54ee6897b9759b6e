"""Seeing requests: tracing, audio service levels, timelines. Built on the engine's observer
hooks (:mod:`omni_trio.observer`); nothing here runs unless an engine asks for it.

- ``settings``: whether tracing is on and where spans go (the ``tracing`` key, ``OTEL_*``);
- ``spans``: OpenTelemetry spans of requests (imported only when tracing is on: the only
  module of the package that imports OpenTelemetry);
- ``audio_slo``: the audio figures of a stream (time to first packet, real-time factor,
  underruns), pure;
- ``timeline``: the stage runs of requests and the start-up phases as a Chrome trace-event
  file (Perfetto, ``chrome://tracing``).

This namespace holds what needs no OpenTelemetry; the tracer is
:class:`omni_trio.telemetry.spans.RequestTracer`.
"""

from __future__ import annotations

from .audio_slo import AudioStream, audio_samples, is_underrun, real_time_factor
from .settings import TracingSettings, tracing_settings
from .timeline import RequestRecord, StageRun, TimelineRecorder, chrome_trace, record_timeline

__all__ = [
    "AudioStream",
    "RequestRecord",
    "StageRun",
    "TimelineRecorder",
    "TracingSettings",
    "audio_samples",
    "chrome_trace",
    "is_underrun",
    "real_time_factor",
    "record_timeline",
    "tracing_settings",
]
