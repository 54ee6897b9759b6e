"""The pure-ASGI middleware in front of every endpoint: request ids, access log, body limit,
and the requests a server phase turns away.

For each HTTP request :class:`RequestGuard`

1. gives it a request id (the ``x-request-id`` response header; handlers derive the
   OpenAI ids from it, so a log line and a response can be matched);
2. refuses work while the server is starting (503 + ``Retry-After``) or shutting down
   (503 ``server_shutdown``), see :func:`~.lifecycle.refusal`;
3. answers 413 to a body over ``max_body_bytes``: at once from ``Content-Length``, else as
   soon as the bytes received pass the limit (the rest is never read);
4. reads the body (so a client that disconnects during its upload is one INFO line, not an
   error in a handler) and hands it to the app;
5. logs one access line at INFO when the request ends: method, path, status, request id,
   duration, and notes (``client disconnected``...). Status 499 means no response was sent
   because the client went away (nginx's convention).

It is pure ASGI (no ``BaseHTTPMiddleware``): cancellation and disconnects reach the app.
"""

from __future__ import annotations

import logging
import time
import uuid

from .asgi import (
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    content_length,
    note,
    notes,
    read_body,
    replay,
    send_json,
)
from .lifecycle import ServerLifecycle, refusal
from .protocol import RequestTooLargeError
from .responses import error_for

__all__ = ["DEFAULT_MAX_BODY_BYTES", "RequestGuard", "access_line", "request_id_of"]

access_logger = logging.getLogger("omni_trio.server.access")

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
NO_RESPONSE = 499  # logged when the client left before any response was sent
_REQUEST_ID = "omni_trio.request_id"


def request_id_of(scope: Scope) -> str:
    """The id :class:`RequestGuard` gave this request (a fresh one if it went around the
    guard). Pure apart from that fallback."""
    state = scope.setdefault("state", {})
    rid: str = state.setdefault(_REQUEST_ID, uuid.uuid4().hex[:24])
    return rid


def access_line(
    method: str, path: str, status: int, request_id: str, seconds: float, extra: list[str]
) -> str:
    """One access-log line (pure): ``POST /v1/completions 200 request_id=... 12.3ms``."""
    line = f"{method} {path} {status} request_id={request_id} {seconds * 1000:.1f}ms"
    return f"{line} ({'; '.join(extra)})" if extra else line


class RequestGuard:
    """Pure-ASGI middleware; see the module docstring. ``lifecycle`` says which phase the
    server is in; ``max_body_bytes`` bounds every request body."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        lifecycle: ServerLifecycle,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.lifecycle = lifecycle
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan, websockets: nothing to guard
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        rid = request_id_of(scope)
        status = NO_RESPONSE

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [*message.get("headers", ()), (b"x-request-id", rid.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self._guarded(scope, receive, send_with_id)
        except Exception:
            if status == NO_RESPONSE:
                status = 500  # the app's error handler answered it (or the connection broke)
            raise
        finally:
            path = str(scope.get("path", ""))
            line = access_line(
                str(scope.get("method", "")), path, status, rid, time.monotonic() - t0, notes(scope)
            )
            access_logger.info("%s", line)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = refusal(self.lifecycle.phase, str(scope.get("path", "")))
        if refused is not None:
            status, refused_body, headers = refused
            await send_json(send, status, refused_body, headers)
            return
        declared = content_length(scope)
        try:
            if declared is not None and declared > self.max_body_bytes:
                note(scope, "body not read")
                raise RequestTooLargeError(self.max_body_bytes, declared=declared)
            body = await read_body(receive, self.max_body_bytes)
        except RequestTooLargeError as exc:
            status, error = error_for(exc)
            # the rest of the body stays unread, so the connection cannot be reused
            await send_json(send, status, error, [(b"connection", b"close")])
            return
        if body is None:
            note(scope, "client disconnected during upload")
            return
        await self.app(scope, replay(body, receive), send)
