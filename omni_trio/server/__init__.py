"""HTTP serving: an OpenAI-compatible API and Prometheus metrics for an omni-trio engine.

Needs the ``serve`` extra (hypercorn, starlette, prometheus-client)::

    async with omni_trio.open_engine("tiny-omni.yaml") as engine, trio.open_nursery() as n:
        port = await n.start(partial(serve_http, engine, host="127.0.0.1", port=0))

or, listening before the stages start (``/health`` says ``starting`` meanwhile)::

    await serve_engine("tiny-omni.yaml", port=8000, shutdown_trigger=stop.wait)

Its modules: ``serve`` (``serve_http``, ``serve_engine``) and ``connections`` (Hypercorn on
sockets bound beforehand, every connection held so shutdown takes bounded time); ``app``
(the OpenAI-compatible app of one engine) with ``protocol`` (requests: validation, sampling
params), ``bodies`` (the wire format of responses), ``responses`` (responses that run engine
work), ``chat_audio`` (chat completions with audio), ``chat_model`` (the served model's
chat template and voices), ``guard`` (the middleware in front of
every endpoint), ``tracing`` (the HTTP request's trace context into the engine's requests),
``asgi`` (plumbing they share); ``realtime`` (``WS /v1/realtime``: live
sessions over a WebSocket) with ``realtime_protocol`` (its event mapping, pure);
``lifecycle`` (where the server is in its life); ``metrics`` (Prometheus).
"""

from __future__ import annotations

from .app import create_app, health_report
from .connections import bind_socket
from .guard import DEFAULT_MAX_BODY_BYTES
from .lifecycle import ServerLifecycle, ServerPhase
from .metrics import EngineMetrics
from .serve import serve_engine, serve_http

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "EngineMetrics",
    "ServerLifecycle",
    "ServerPhase",
    "bind_socket",
    "create_app",
    "health_report",
    "serve_engine",
    "serve_http",
]
