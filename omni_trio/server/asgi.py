"""ASGI plumbing shared by the server's middleware and responses.

The ASGI callable types, reading a request body under a size limit (stopping as soon as
the limit is passed, so an oversized upload is never held whole), handing a body that was
read already to the app, sending a whole JSON response, and the per-request record that
the access log prints (status, request id, notes such as "client disconnected").

Everything that touches the network checkpoints; the rest is pure.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .protocol import RequestTooLargeError

__all__ = [
    "ASGIApp",
    "Headers",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "content_length",
    "header",
    "note",
    "notes",
    "read_body",
    "replay",
    "send_json",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

_NOTES = "omni_trio.notes"


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of the request header ``name`` (lower case), or None. Pure."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


def content_length(scope: Scope) -> int | None:
    """The declared body size, or None when the request does not declare one (chunked) or
    declares nonsense (the HTTP layer rejects that itself). Pure."""
    raw = header(scope, b"content-length")
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """Read the whole request body, at most ``limit`` bytes.

    Returns None if the client disconnected before the body ended (nobody is left to answer).
    Raises :class:`RequestTooLargeError` as soon as the bytes received pass ``limit``: the
    rest is never read. Checkpoints (each ``receive``); cancellation leaves the body unread.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = bytes(message.get("body", b""))
        size += len(chunk)
        if size > limit:
            raise RequestTooLargeError(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands out ``body`` (already read) as one message, then passes
    every later call (the disconnect) through to ``receive``."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_again() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return receive_again


async def send_json(send: Send, status: int, body: Any, headers: Headers | None = None) -> None:
    """Send a whole JSON response (ASCII-escaped, so no string can fail to encode).
    Checkpoints."""
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


def note(scope: Scope, text: str) -> None:
    """Add ``text`` to the request's access-log line (what happened beyond the status)."""
    state = scope.setdefault("state", {})
    notes: list[str] = state.setdefault(_NOTES, [])
    if text not in notes:
        notes.append(text)


def notes(scope: Scope) -> list[str]:
    """The notes :func:`note` added to this request. Pure."""
    found: list[str] = scope.get("state", {}).get(_NOTES, [])
    return found
