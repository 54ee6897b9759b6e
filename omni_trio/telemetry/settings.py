"""Whether tracing is on and where spans go: :func:`tracing_settings`, a pure function of the
pipeline's ``tracing`` key and the standard ``OTEL_*`` environment variables.

Tracing is on when ``tracing.enabled`` is true, or when the environment asks for traces the
standard way (``OTEL_TRACES_EXPORTER`` other than ``none``, or an
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``);
``OTEL_SDK_DISABLED=true`` turns it off whatever the config says. Where spans go, first match:

1. ``tracing.otlp_traces_endpoint``: OTLP/HTTP to that URL;
2. the global tracer provider, when the program set one (``"global"``: decided when the
   tracer is made, since only OpenTelemetry can tell);
3. the exporter the environment names (``OTEL_TRACES_EXPORTER``: ``otlp``, the default, or
   ``console``), which reads its own ``OTEL_EXPORTER_OTLP_*`` settings.

``OTEL_TRACES_SAMPLER_ARG`` sets the sampling ratio when the config leaves it at 1.0 and
``OTEL_TRACES_SAMPLER`` names a ratio sampler. Nothing here imports OpenTelemetry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ..config.pipeline import TracingConfig
from ..errors import ConfigError

__all__ = ["TracingSettings", "tracing_settings"]

#: what the spans are exported with when no global tracer provider is set
Exporter = Literal["otlp", "console"]

_ENV = "environment"
_RATIO_SAMPLERS = frozenset({"traceidratio", "parentbased_traceidratio"})


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """Tracing is on: where its spans go and which share of requests is traced."""

    #: OTLP/HTTP endpoint from the config (None: the global provider, else ``exporter``)
    endpoint: str | None = None
    exporter: Exporter = "otlp"
    sample_ratio: float = 1.0


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")


def tracing_settings(config: TracingConfig, environ: Mapping[str, str]) -> TracingSettings | None:
    """The tracing settings of an engine, or ``None`` when tracing is off. Pure. Raises
    :class:`ConfigError` (source ``environment``) naming the variable when
    ``OTEL_TRACES_EXPORTER`` names an exporter this engine does not make, or
    ``OTEL_TRACES_SAMPLER_ARG`` is not a ratio in [0, 1]."""
    if _truthy(environ.get("OTEL_SDK_DISABLED")):
        return None
    exporters = [
        e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()
    ]
    by_env = bool(exporters and exporters != ["none"]) or bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    if not (config.enabled or by_env):
        return None
    exporter: Exporter = "otlp"
    named = [e for e in exporters if e != "none"]
    if named:
        if named[0] not in ("otlp", "console"):
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER={named[0]!r}: omni-trio exports traces with "
                "'otlp' or 'console' (or set a global tracer provider)",
                path="$.tracing",
                source=_ENV,
            )
        exporter = "console" if named[0] == "console" else "otlp"
    ratio = config.sample_ratio
    sampler = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    arg = environ.get("OTEL_TRACES_SAMPLER_ARG")
    if ratio == 1.0 and sampler in _RATIO_SAMPLERS and arg is not None:
        try:
            ratio = float(arg)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise ConfigError(
                f"OTEL_TRACES_SAMPLER_ARG={arg!r} is not a ratio in [0, 1]",
                path="$.tracing.sample_ratio",
                source=_ENV,
            )
    return TracingSettings(config.otlp_traces_endpoint, exporter, ratio)
