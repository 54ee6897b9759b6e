"""Trace context through the server: the HTTP request's W3C ``traceparent`` continues into
the engine's request (and on to vLLM), and a WebSocket's upgrade request's into the turns of
its live session.

:class:`TraceContext` is pure-ASGI middleware. For each HTTP request it picks the request's
``traceparent`` and ``tracestate`` headers; when the engine traces
(:attr:`Engine.tracer <omni_trio.engine.engine.Engine.tracer>`), it also opens a SERVER span
for the HTTP request (``POST /v1/chat/completions``, its status code, continuing the
caller's trace) and hands on that span's context instead; a WebSocket's span (``GET
/v1/realtime``) lasts as long as its connection. The handlers pass
:func:`request_trace_headers` as ``generate(trace_headers=)`` (the realtime endpoint as its
session's, for every turn): the engine's request span then
nests under the HTTP span, and a vllm stage gives vLLM its stage span's context. Without
tracing the caller's headers go to the engine as they came (vLLM's own span then continues
the caller's trace). Nothing here imports OpenTelemetry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING

from .asgi import ASGIApp, Message, Receive, Scope, Send, header

if TYPE_CHECKING:
    from ..telemetry.spans import RequestTracer

__all__ = ["TraceContext", "incoming_trace_headers", "request_trace_headers"]

_HEADERS: ContextVar[Mapping[str, str] | None] = ContextVar("omni_trio_trace_headers", default=None)


def incoming_trace_headers(scope: Scope) -> dict[str, str] | None:
    """The request's W3C trace context headers (``traceparent`` and, with it,
    ``tracestate``), or None without a ``traceparent``. Pure."""
    parent = header(scope, b"traceparent")
    if parent is None:
        return None
    headers = {"traceparent": parent.decode("latin-1")}
    state = header(scope, b"tracestate")
    if state is not None:
        headers["tracestate"] = state.decode("latin-1")
    return headers


def request_trace_headers() -> Mapping[str, str] | None:
    """The trace headers the HTTP request being handled hands to the engine
    (``generate(trace_headers=)``), or None. Synchronous."""
    return _HEADERS.get()


class TraceContext:
    """Pure-ASGI middleware; see the module docstring. ``tracer`` gives the engine's tracer
    (read per request: tracing lives as long as the engine's session)."""

    def __init__(self, app: ASGIApp, *, tracer: Callable[[], RequestTracer | None]) -> None:
        self.app = app
        self._tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        incoming = incoming_trace_headers(scope)
        tracer = self._tracer()
        if tracer is None:
            token = _HEADERS.set(incoming)
            try:
                await self.app(scope, receive, send)
            finally:
                _HEADERS.reset(token)
            return
        # a websocket's span is its upgrade request's, open as long as the connection
        method = scope.get("method", "GET")
        with tracer.http_span(method, scope["path"], incoming or {}) as status:
            token = _HEADERS.set(status(0))

            async def send_status(message: Message) -> None:
                kind = message["type"]
                if kind in ("http.response.start", "websocket.http.response.start"):
                    status(int(message["status"]))
                elif kind == "websocket.accept":
                    status(101)
                await send(message)

            try:
                await self.app(scope, receive, send_status)
            finally:
                _HEADERS.reset(token)
