"""OpenTelemetry spans of requests: :class:`RequestTracer`, an engine observer.

This module imports OpenTelemetry (the ``otel`` extra) and is itself imported only when
tracing is on (``open_engine(config, tracing=True)``, the ``tracing:`` key, the ``OTEL_*``
variables: :mod:`~omni_trio.telemetry.settings`), or by a program that makes a tracer.

One trace per request. Its root span, ``omni_trio.request`` (kind SERVER), continues the
caller's trace: the W3C ``traceparent`` of the request's ``trace_headers`` (the server passes
the HTTP request's, under its own HTTP span), else the span current where the request was
admitted. Each stage run is a child span, ``omni_trio.stage``. The stage span's own
``traceparent`` is what the stage hands its engine (:meth:`RequestTracer.stage_trace_headers`):
a vllm stage gives it to vLLM, whose ``llm_request`` span then nests under it.

Attributes (``omni_trio.`` prefix left out): the root has ``request.id``, ``request.route``
(its stages), ``request.output_stages``, ``request.output_modalities``,
``request.outcome`` (finished, aborted, failed) and, when it failed, ``error.type``; a stage
span has ``stage.id``, ``stage.index``, ``stage.backend``, ``stage.output_type``,
``replica.index``, ``stage.outputs``, ``stage.tokens_in``/``bytes_in`` (its input: the prompt
for an entry stage, the chunks handed to it otherwise), ``stage.tokens_out``/``bytes_out``,
``stage.time_to_first_output_s`` and ``stage.outcome``. Events: ``admission_wait`` (root,
when it waited), ``abort_requested`` and ``abort_committed`` (root), ``replica_wait``,
``bound``, ``replica_restarted``, ``first_input``, ``first_output`` (stage), and the
exception of a failed stage. A failed stage's span and the root have status ERROR.

Every span ends exactly once: a stage's when it ends, whatever ended it, and whatever is
still open when the request ends (a stage that never got to run has no span). A request
sampled out (``sample_ratio``, or a caller's trace that is not sampled) gets no stage spans;
its stages hand their engines its root's unsampled context. The tracer
holds nothing of a request once it ended (:attr:`RequestTracer.open_spans` is 0 when idle).
Detached (removed from the engine, or for a hook that raised), it ends every span it holds
open, with ``tracing.detached`` set and no outcome.
Hooks are synchronous and never checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Final

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..config.pipeline import PipelineConfig
from ..observer import EngineObserver, RequestInfo, Transfer, payload_nbytes
from ..outputs import StageOutput
from .settings import TracingSettings

__all__ = ["RequestTracer", "make_tracer_provider", "open_request_tracer"]

logger = logging.getLogger(__name__)

TRACER_NAME: Final = "omni_trio"
#: what a stage hands its engine: W3C trace context (vLLM reads ``traceparent``)
_W3C: Final = TraceContextTextMapPropagator()
P: Final = "omni_trio."  # every attribute's prefix


class _StageRun:
    """One stage run's span and counts."""

    __slots__ = (
        "bytes_in",
        "bytes_out",
        "errored",
        "first_input",
        "first_output",
        "outputs",
        "replica",
        "restarts",
        "span",
        "started",
        "tokens_in",
        "tokens_out",
    )

    def __init__(self, span: Span, started: float, restarts: int) -> None:
        self.span = span
        self.started = started
        self.restarts = restarts  # the stage's restarts when it started (restarts seen)
        self.tokens_in = self.bytes_in = self.tokens_out = self.bytes_out = self.outputs = 0
        self.first_input = False
        self.first_output: float | None = None  # its time
        self.replica: int | None = None
        self.errored = False


class _RequestSpans:
    """One request's root span and its open stage spans."""

    __slots__ = ("abort_requested", "context", "error", "info", "recording", "root", "stages")

    def __init__(self, root: Span, info: RequestInfo) -> None:
        self.root = root
        #: the context its stage spans start in (made once: each stage would make its own)
        self.context = trace.set_span_in_context(root)
        self.info = info
        #: sampled: its stages get spans (a request sampled out has its root's context only)
        self.recording = root.is_recording()
        self.stages: dict[str, _StageRun] = {}
        self.error: BaseException | None = None
        self.abort_requested = False


class RequestTracer(EngineObserver):
    """Makes the spans of an engine's requests (see the module docstring). Attach it with
    ``engine.add_observer(tracer)``; an engine with tracing on makes and attaches its own.

    ``tracer_provider``: where the spans go (default: the global tracer provider).
    ``restarts``: the number of times a stage's replicas were replaced so far (the engine
    passes one; without it no ``replica_restarted`` event). ``owned``: :meth:`shutdown`
    shuts the provider down (the engine's own provider).

    It needs no event per output as it is routed: requests run as without observers
    (:attr:`~omni_trio.observer.EngineObserver.routes_stages` is false)."""

    routes_stages = False

    def __init__(
        self,
        config: PipelineConfig,
        tracer_provider: trace.TracerProvider | None = None,
        *,
        restarts: Callable[[str], int] | None = None,
        owned: bool = False,
    ) -> None:
        self._provider = tracer_provider or trace.get_tracer_provider()
        self._tracer = self._provider.get_tracer(TRACER_NAME)
        self._owned = owned
        self._restarts = restarts
        stages = list(config.stages)
        self._stage_attrs: dict[str, dict[str, str | int]] = {
            st.id: {
                P + "stage.id": st.id,
                P + "stage.index": i,
                P + "stage.backend": st.backend,
                P + "stage.output_type": st.output_type,
            }
            for i, st in enumerate(stages)
        }
        self._output_type = {st.id: st.output_type for st in stages}
        self._entries = frozenset(st.id for st in stages if not st.inputs)
        self._requests: dict[str, _RequestSpans] = {}
        # perf_counter seconds -> epoch nanoseconds (what span timestamps are)
        self._epoch_ns = time.time_ns() - time.perf_counter_ns()

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._epoch_ns

    @property
    def open_spans(self) -> int:
        """Spans started and not ended yet (roots and stages): 0 when no request is in flight."""
        return sum(1 + len(r.stages) for r in self._requests.values())

    # -- request -------------------------------------------------------------------------
    def request_info(self, request_id: str, info: RequestInfo, t: float) -> None:
        headers = info.trace_headers
        if headers and any(k.lower() == "traceparent" for k in headers):
            parent = propagate.extract(headers)
        else:
            parent = otel_context.get_current()  # the admitting task's: the caller's span
        modalities = tuple(dict.fromkeys(self._output_type[s] for s in info.output_stages))
        wait = info.admission_wait_s
        root = self._tracer.start_span(
            "omni_trio.request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                P + "request.id": request_id,
                P + "request.route": info.stages,
                P + "request.output_stages": info.output_stages,
                P + "request.output_modalities": modalities,
            },
            start_time=self._ns(t - wait),
        )
        if wait > 0:
            root.add_event("admission_wait", {P + "wait_s": wait}, timestamp=self._ns(t))
        old = self._requests.pop(request_id, None)
        if old is not None:  # never left open, even if an end was missed
            self._end_request(old, "aborted", t)
        self._requests[request_id] = _RequestSpans(root, info)

    def abort_requested(self, request_id: str, t: float) -> None:
        req = self._requests.get(request_id)
        if req is not None and not req.abort_requested:
            req.abort_requested = True
            req.root.add_event("abort_requested", timestamp=self._ns(t))

    def stage_error(self, request_id: str, stage_id: str, error: BaseException, t: float) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        if req.error is None:
            req.error = error
        run = req.stages.get(stage_id)
        if run is not None and not run.errored:
            run.errored = True
            run.span.record_exception(error, timestamp=self._ns(t))
            run.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))

    def request_finished(self, request_id: str, status: str, t: float) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._end_request(req, status, t)

    def _end_request(self, req: _RequestSpans, status: str, t: float) -> None:
        for sid in list(req.stages):
            self._end_stage(req, sid, status, t)
        root = req.root
        root.set_attribute(P + "request.outcome", status)
        if status == "aborted":
            root.add_event("abort_committed", timestamp=self._ns(t))
        elif status == "failed":
            error = req.error
            name = type(error).__name__ if error is not None else "StageError"
            root.set_attribute("error.type", name)
            root.set_status(Status(StatusCode.ERROR, f"{name}: {error}" if error else name))
        root.end(end_time=self._ns(t))

    # -- stages --------------------------------------------------------------------------
    def _stage(self, request_id: str, stage_id: str, t: float) -> _StageRun | None:
        # a stage's span, started by the first of its events (they come from two tasks)
        req = self._requests.get(request_id)
        if req is None or not req.recording:
            return None
        run = req.stages.get(stage_id)
        if run is None:
            span = self._tracer.start_span(
                "omni_trio.stage",
                context=req.context,
                attributes=self._stage_attrs.get(stage_id),
                start_time=self._ns(t),
            )
            restarts = self._restarts(stage_id) if self._restarts is not None else 0
            run = req.stages[stage_id] = _StageRun(span, t, restarts)
            if stage_id in self._entries:
                run.tokens_in = req.info.input_tokens
                run.bytes_in = req.info.input_bytes
        return run

    def _restarts_seen(self, stage_id: str, run: _StageRun, t: float) -> None:
        if self._restarts is None:
            return
        now = self._restarts(stage_id)
        if now > run.restarts:
            attrs = {P + "replica.restarts": now - run.restarts}
            run.span.add_event("replica_restarted", attrs, timestamp=self._ns(t))
            run.restarts = now

    def stage_started(self, request_id: str, stage_id: str, t: float) -> None:
        self._stage(request_id, stage_id, t)

    def stage_bound(
        self, request_id: str, stage_id: str, replica: int, waited_s: float, t: float
    ) -> None:
        run = self._stage(request_id, stage_id, t)
        if run is None:
            return
        span = run.span
        run.replica = replica
        if waited_s > 0:
            span.add_event(
                "replica_wait", {P + "wait_s": waited_s}, timestamp=self._ns(t - waited_s)
            )
        span.add_event("bound", {P + "replica.index": replica}, timestamp=self._ns(t))
        self._restarts_seen(stage_id, run, t)

    def stage_trace_headers(self, request_id: str, stage_id: str) -> Mapping[str, str] | None:
        req = self._requests.get(request_id)
        if req is None:
            return None
        # a request sampled out hands on its root's context: the engine's spans drop too
        run = self._stage(request_id, stage_id, time.perf_counter())
        context = trace.set_span_in_context(run.span) if run is not None else req.context
        carrier: dict[str, str] = {}
        _W3C.inject(carrier, context=context)
        return carrier or None

    def stage_output(self, request_id: str, stage_id: str, first: bool, t: float) -> None:
        run = self._stage(request_id, stage_id, t) if first else None
        if run is not None and run.first_output is None:
            run.first_output = t
            run.span.add_event("first_output", timestamp=self._ns(t))

    def stage_delta(self, request_id: str, stage_id: str, output: object, t: float) -> None:
        # once per output: the cheapest form of payload_nbytes's sum
        req = self._requests.get(request_id)
        run = req.stages.get(stage_id) if req is not None else None
        if run is None or type(output) is not StageOutput:
            return
        tokens, text, data = output.token_ids, output.text, output.data
        run.outputs += 1
        run.tokens_out += len(tokens)
        n = 4 * len(tokens) + (len(text) if text.isascii() else len(text.encode("utf-8")))
        run.bytes_out += n if data is None else n + payload_nbytes((), None, data)

    def transfer_sent(self, request_id: str, transfer: Transfer, t: float) -> None:
        run = self._stage(request_id, transfer.target, t)
        if run is None:
            return
        run.tokens_in += transfer.tokens
        run.bytes_in += transfer.nbytes
        if not run.first_input:
            run.first_input = True
            at = self._ns(t - transfer.seconds)
            run.span.add_event("first_input", {P + "source": transfer.source}, timestamp=at)

    def stage_finished(self, request_id: str, stage_id: str, status: str, t: float) -> None:
        req = self._requests.get(request_id)
        if req is not None and stage_id in req.stages:
            self._end_stage(req, stage_id, status, t)

    def _end_stage(self, req: _RequestSpans, stage_id: str, status: str, t: float) -> None:
        run = req.stages.pop(stage_id)
        self._restarts_seen(stage_id, run, t)
        # everything learnt while it ran, in one update (each costs the SDK a lock and a check)
        attributes: dict[str, str | int | float] = {
            P + "stage.outcome": status,
            P + "stage.outputs": run.outputs,
            P + "stage.tokens_in": run.tokens_in,
            P + "stage.bytes_in": run.bytes_in,
            P + "stage.tokens_out": run.tokens_out,
            P + "stage.bytes_out": run.bytes_out,
        }
        if run.replica is not None:
            attributes[P + "replica.index"] = run.replica
        if run.first_output is not None:
            attributes[P + "stage.time_to_first_output_s"] = run.first_output - run.started
        run.span.set_attributes(attributes)
        run.span.end(end_time=self._ns(t))

    def detached(self, t: float) -> None:
        # removed, or detached because a hook raised: what is open ends now, marked as
        # ended by the detach (the request's outcome is not known here)
        requests, self._requests = self._requests, {}
        for request_id, req in requests.items():
            try:
                for run in req.stages.values():
                    run.span.set_attribute(P + "tracing.detached", True)
                    run.span.end(end_time=self._ns(t))
                req.root.set_attribute(P + "tracing.detached", True)
                req.root.end(end_time=self._ns(t))
            except Exception:
                logger.exception("ending the spans of request %r failed", request_id)

    # -- the HTTP side and shutdown ------------------------------------------------------
    @contextmanager
    def http_span(
        self, method: str, route: str, headers: Mapping[str, str]
    ) -> Iterator[Callable[[int], dict[str, str]]]:
        """A SERVER span for one HTTP request (continuing its ``traceparent``), current in
        the block. Yields ``status(code) -> headers``: record the response status and get
        the W3C headers to pass as the request's ``trace_headers``. Synchronous; the span
        ends when the block does (with status ERROR on an exception or a 5xx)."""
        parent = propagate.extract(headers) if headers else None
        span = self._tracer.start_span(
            f"{method} {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": route},
        )
        token = otel_context.attach(trace.set_span_in_context(span))

        def status(code: int) -> dict[str, str]:
            if code:
                span.set_attribute("http.response.status_code", code)
                if code >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            carrier: dict[str, str] = {}
            propagate.inject(carrier, context=trace.set_span_in_context(span))
            return carrier

        try:
            yield status
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            otel_context.detach(token)
            span.end()

    def shutdown(self) -> None:
        """Flush and shut down the tracer provider if the tracer made it (the engine's
        own); a global or given provider is left to its owner. Blocking (an exporter may
        wait on the network, bounded by its own timeout): run it in a worker thread."""
        if self._owned:
            shutdown = getattr(self._provider, "shutdown", None)
            if shutdown is not None:
                shutdown()

    def __repr__(self) -> str:
        return f"<RequestTracer requests={len(self._requests)} open_spans={self.open_spans}>"


def make_tracer_provider(settings: TracingSettings) -> TracerProvider:
    """A tracer provider for ``settings``: sampled at ``settings.sample_ratio`` (a caller's
    sampling decision is kept), exporting in batches through OTLP/HTTP (to the configured
    endpoint, else where the ``OTEL_EXPORTER_OTLP_*`` variables say) or to the console.
    Synchronous. Raises :class:`~omni_trio.errors.BackendUnavailableError` if the OTLP
    exporter is not installed."""
    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
        resource=Resource.create({"service.name": "omni-trio"}),
    )
    exporter: SpanExporter
    if settings.endpoint is None and settings.exporter == "console":
        exporter = ConsoleSpanExporter()
    else:
        exporter = _otlp_exporter(settings.endpoint)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _otlp_exporter(endpoint: str | None) -> SpanExporter:
    from ..errors import BackendUnavailableError

    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise BackendUnavailableError(
            "tracing exports over OTLP, which needs the otel extra "
            "(pip install 'omni-trio[otel]'), or set a global tracer provider"
        ) from exc
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


def open_request_tracer(
    config: PipelineConfig,
    settings: TracingSettings,
    restarts: Callable[[str], int] | None = None,
) -> RequestTracer:
    """The tracer of an engine with tracing on: on the configured endpoint's own provider,
    else the global tracer provider when the program set one, else a provider of its own
    as the environment says (:func:`make_tracer_provider`). Synchronous."""
    global_set = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    if settings.endpoint is None and global_set:
        return RequestTracer(config, restarts=restarts)
    return RequestTracer(config, make_tracer_provider(settings), restarts=restarts, owned=True)
