"""Pure-ASGI responses that run engine work inside the response, under a disconnect watch.

Why not Starlette's ``StreamingResponse``: when a client disconnects while the body
iterator is suspended at a ``yield``, Starlette cancels its task group but never closes the
iterator, so the ``async with engine.generate(...)`` inside it would stay open (the request
would keep running for nobody) until garbage collection. Here the iterator is always closed
(``aclosing``) before the response returns, and admission happens before the status line is
sent, so an overloaded engine still answers 429 instead of a broken 200 stream.
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
from .protocol import RequestValidationError, error_body

__all__ = ["EngineJSONResponse", "EventStreamResponse", "error_for", "send_json"]

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def error_for(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """HTTP status and OpenAI error body for an engine/request error (pure).

    400 invalid request, 429 overloaded, 503 engine closed, 500 stage failure."""
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


async def send_json(send: Send, status: int, body: Any, headers: list | None = None) -> None:
    """Send a whole JSON response. Checkpoints."""
    payload = json.dumps(body).encode("utf-8")
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload, "more_body": False})


async def _watch_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    # the request body was read already: the next message is the disconnect
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


class EngineJSONResponse:
    """Runs ``compute()`` (returns ``(status, body, headers)``) and sends its result; a client
    disconnect cancels ``compute`` (so its ``async with engine.generate`` aborts the request).
    Omni-trio errors become OpenAI error bodies (:func:`error_for`)."""

    def __init__(
        self, compute: Callable[[], Awaitable[tuple[int, Any, list | None]]], *, raw: bool = False
    ) -> None:
        self._compute = compute
        self._raw = raw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        result: tuple[int, Any, list | None] | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope)
            try:
                result = await self._compute()
            except OmniTrioError as exc:
                status, body = error_for(exc)
                result = (status, body, None)
            nursery.cancel_scope.cancel()
        if result is None:  # the client went away: nobody to answer
            return
        status, body, headers = result
        if self._raw:
            await send({"type": "http.response.start", "status": status, "headers": headers or []})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            await send_json(send, status, body, headers)


def sse(data: Any) -> bytes:
    """One server-sent event carrying ``data`` (JSON-encoded unless it is a str)."""
    text = data if isinstance(data, str) else json.dumps(data)
    return f"data: {text}\n\n".encode()


class EventStreamResponse:
    """Streams the JSON events an async generator yields as ``text/event-stream``, then
    ``data: [DONE]``. The first event is pulled before the status line, so admission errors
    answer with a status code; an error later becomes an ``error`` event. A disconnect
    cancels the generator, and the generator is always closed before this returns."""

    def __init__(self, events: AsyncGenerator[Any, None]) -> None:
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with aclosing(self._events) as events, trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope)
            await self._stream(events, send)
            nursery.cancel_scope.cancel()

    async def _stream(self, events: AsyncGenerator[Any, None], send: Send) -> None:
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None
        except OmniTrioError as exc:
            status, body = error_for(exc)
            await send_json(send, status, body)
            return
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
                await send({"type": "http.response.body", "body": sse(first), "more_body": True})
                async for event in events:
                    chunk = sse(event)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except OmniTrioError as exc:
            _, error = error_for(exc)
            logger.info("stream failed after it started: %s", exc)
            await send({"type": "http.response.body", "body": sse(error), "more_body": True})
        await send({"type": "http.response.body", "body": sse("[DONE]"), "more_body": False})
