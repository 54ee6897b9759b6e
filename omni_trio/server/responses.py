"""Pure-ASGI responses that run engine work inside the response, under two watches.

Why not Starlette's ``StreamingResponse``: when a client disconnects while the body
iterator is suspended at a ``yield``, Starlette cancels its task group but never closes the
iterator, so the ``async with engine.generate(...)`` inside it would stay open (the request
would keep running for nobody) until garbage collection. Here the iterator is always closed
(``aclosing``) before the response returns, and admission happens before the status line is
sent, so an overloaded engine still answers 429 instead of a broken 200 stream.

The two watches: a client disconnect cancels the work (which aborts the request in every
stage); the server's shutdown cut (:class:`~.lifecycle.ServerLifecycle`, the end of the
grace period) cancels it too, and then the client is told: a stream ends with an SSE error
event of code ``server_shutdown`` and ``[DONE]``, a response not started yet is a 503.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import trio

from ..errors import (
    EngineClosedError,
    EngineOverloadedError,
    InvalidRequestError,
    OmniTrioError,
    StageError,
)
from .asgi import Headers, Receive, Scope, Send, note, send_json
from .bodies import error_body
from .lifecycle import ServerLifecycle
from .protocol import RequestTooLargeError, RequestValidationError

__all__ = [
    "EngineJSONResponse",
    "EventStreamResponse",
    "error_for",
    "send_json",
    "shutdown_error",
    "sse",
]

logger = logging.getLogger(__name__)

Computed = tuple[int, Any, Headers | None]


def error_for(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """HTTP status and OpenAI error body for an engine/request error (pure).

    400 invalid request, 429 overloaded, 503 engine closed, 500 stage failure."""
    if isinstance(exc, RequestTooLargeError):
        return 413, error_body(str(exc), type_="invalid_request_error", code="request_too_large")
    if isinstance(exc, RequestValidationError):
        return 400, error_body(str(exc), type_="invalid_request_error", param=exc.param)
    if isinstance(exc, InvalidRequestError):
        return 400, error_body(str(exc), type_="invalid_request_error")
    if isinstance(exc, EngineOverloadedError):
        return 429, error_body(
            f"the engine is overloaded: {exc}", type_="rate_limit_error", code="overloaded"
        )
    if isinstance(exc, EngineClosedError):
        return 503, error_body(str(exc), type_="service_unavailable", code="engine_closed")
    if isinstance(exc, StageError):
        stage = f"stage {exc.stage_id!r} failed: " if exc.stage_id else ""
        return 500, error_body(f"{stage}{exc}", type_="server_error", code="stage_error")
    return 500, error_body(f"{type(exc).__name__}: {exc}", type_="server_error")


def shutdown_error() -> dict[str, Any]:
    """The error body of work cut at the end of the shutdown grace period. Pure."""
    return error_body(
        "the server is shutting down: the grace period for in-flight requests is over",
        type_="server_error",
        code="server_shutdown",
    )


def sse(data: Any) -> bytes:
    """One server-sent event carrying ``data`` (JSON-encoded unless it is a str). Pure."""
    text = data if isinstance(data, str) else json.dumps(data)
    return f"data: {text}\n\n".encode()


class _Watch:
    """Runs ``work`` in a scope that a client disconnect or the shutdown cut cancels, and
    says which of the two ended it (if either did)."""

    def __init__(self, scope: Scope, receive: Receive, lifecycle: ServerLifecycle | None) -> None:
        self._scope = scope
        self._receive = receive
        self._lifecycle = lifecycle
        self.disconnected = False
        self.cut = False

    async def run(self, work: Callable[[], Awaitable[None]]) -> None:
        """Checkpoints. Returns when ``work`` returns or once a watch cancelled it."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._disconnect, nursery.cancel_scope)
            if self._lifecycle is not None:
                nursery.start_soon(self._cut, self._lifecycle, nursery.cancel_scope)
            await work()
            nursery.cancel_scope.cancel()

    async def _disconnect(self, scope: trio.CancelScope) -> None:
        # the request body was read already: the next message is the disconnect
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                note(self._scope, "client disconnected")
                scope.cancel()
                return

    async def _cut(self, lifecycle: ServerLifecycle, scope: trio.CancelScope) -> None:
        await lifecycle.wait_cut()
        self.cut = True
        note(self._scope, "cut by server shutdown")
        scope.cancel()


class EngineJSONResponse:
    """Runs ``compute()`` (returns ``(status, body, headers)``) and sends its result; a client
    disconnect cancels ``compute`` (so its ``async with engine.generate`` aborts the request),
    and so does the shutdown cut (then the answer is 503 ``server_shutdown``).
    Omni-trio errors become OpenAI error bodies (:func:`error_for`)."""

    def __init__(
        self,
        compute: Callable[[], Awaitable[Computed]],
        *,
        raw: bool = False,
        lifecycle: ServerLifecycle | None = None,
    ) -> None:
        self._compute = compute
        self._raw = raw
        self._lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        result: Computed | None = None
        failed = False  # an error body is JSON even where the answer would be raw bytes

        async def work() -> None:
            nonlocal result, failed
            try:
                result = await self._compute()
            except OmniTrioError as exc:
                status, body = error_for(exc)
                result = (status, body, None)
                failed = True

        watch = _Watch(scope, receive, self._lifecycle)
        await watch.run(work)
        if result is None:
            if watch.cut and not watch.disconnected:
                await send_json(send, 503, shutdown_error())
            return  # else the client went away: nobody to answer
        status, body, headers = result
        if self._raw and not failed:
            await send({"type": "http.response.start", "status": status, "headers": headers or []})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            await send_json(send, status, body, headers)


class EventStreamResponse:
    """Streams the JSON events an async generator yields as ``text/event-stream``, then
    ``data: [DONE]``. The first event is pulled before the status line, so admission errors
    answer with a status code; an error later becomes an ``error`` event. A disconnect
    cancels the generator, and the generator is always closed before this returns. The
    shutdown cut closes the generator, then sends a ``server_shutdown`` error event and
    ``[DONE]`` (if the client's socket takes them: the server abandons a write that stays
    blocked)."""

    def __init__(
        self, events: AsyncGenerator[Any, None], *, lifecycle: ServerLifecycle | None = None
    ) -> None:
        self._events = events
        self._lifecycle = lifecycle
        self._started = False
        self._ended = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = _Watch(scope, receive, self._lifecycle)
        async with aclosing(self._events) as events:
            await watch.run(lambda: self._stream(events, send))
        # the generator is closed: the request was aborted in every stage if it had not ended
        if watch.cut and not watch.disconnected and not self._ended:
            if self._started:
                await self._send_body(send, sse(shutdown_error()), True)
                await self._send_body(send, sse("[DONE]"), False)
            else:
                await send_json(send, 503, shutdown_error())

    async def _send_body(self, send: Send, chunk: bytes, more: bool) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": more})
        self._ended = not more

    async def _stream(self, events: AsyncGenerator[Any, None], send: Send) -> None:
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None
        except OmniTrioError as exc:
            status, body = error_for(exc)
            self._ended = True
            await send_json(send, status, body)
            return
        self._started = True
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                ],
            }
        )
        try:
            if first is not None:
                await self._send_body(send, sse(first), True)
                async for event in events:
                    await self._send_body(send, sse(event), True)
        except OmniTrioError as exc:
            _, error = error_for(exc)
            logger.info("stream failed after it started: %s", exc)
            await self._send_body(send, sse(error), True)
        await self._send_body(send, sse("[DONE]"), False)
