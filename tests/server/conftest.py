"""Fixtures of the server tests: a real engine served by a real Hypercorn on 127.0.0.1:0.

No autojump clock here: these tests do real network I/O, and autojump would fire while a
task waits on a socket."""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import termios
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from typing import Any

import httpx
import trio

import omni_trio
from omni_trio import testing
from omni_trio.observer import EngineObserver
from omni_trio.server import serve_http


@asynccontextmanager
async def running_server(
    config: Any, *, serve_options: dict[str, Any] | None = None, **overrides: Any
) -> AsyncIterator[tuple[Any, str]]:
    """``(engine, base_url)`` of an engine served on a free port; stops both on exit.
    ``serve_options`` go to ``serve_http`` (``max_body_bytes``, ``shutdown_trigger``...)."""
    async with omni_trio.open_engine(config, **overrides) as engine:
        async with trio.open_nursery() as nursery:
            serve = partial(serve_http, engine, host="127.0.0.1", port=0, **(serve_options or {}))
            port = await nursery.start(serve)
            yield engine, f"http://127.0.0.1:{port}"
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def client_for(base: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=base, timeout=30.0) as client:
        yield client


async def wait_until_idle(engine: Any, timeout: float = 10.0) -> None:  # noqa: ASYNC109
    """Wait (bounded) until nothing is in flight: an abort travels through the server's
    task, the orchestrator and every stage before the counters drop."""

    with trio.fail_after(timeout):
        await testing.wait_until_idle(engine)


class LogWatch(logging.Handler):
    """Collects the records of one logger tree; :meth:`wait_for` returns the first record
    whose message satisfies a predicate, woken by the record itself (no polling)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._arrived = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self._arrived.set()

    async def wait_for(self, match: Callable[[str], bool], timeout: float = 10.0) -> str:  # noqa: ASYNC109
        with trio.fail_after(timeout):
            while True:
                for record in self.records:
                    if match(record.getMessage()):
                        return record.getMessage()
                self._arrived = trio.Event()
                await self._arrived.wait()

    def at_least(self, level: int) -> list[logging.LogRecord]:
        return [r for r in self.records if r.levelno >= level]


@contextmanager
def watch_logs(name: str = "omni_trio.server") -> Iterator[LogWatch]:
    """Watch every record of logger ``name`` and its children, INFO included."""
    logger = logging.getLogger(name)
    watch = LogWatch()
    old = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(watch)
    try:
        yield watch
    finally:
        logger.removeHandler(watch)
        logger.setLevel(old)


async def raw_connection(port: int, *, rcvbuf: int | None = None) -> trio.SocketStream:
    """A plain TCP connection to the server (for requests httpx will not send: lying
    headers, uploads cut short, a client that never reads). ``rcvbuf`` shrinks the
    receive buffer (set before connecting, so the advertised window stays small)."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


async def read_response(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes the connection (bounded)."""
    data = b""
    with trio.fail_after(10):
        while chunk := await stream.receive_some():
            data += chunk
    return data


class _Admissions(EngineObserver):
    def __init__(self) -> None:
        self.event = trio.Event()

    def request_started(self, request_id: str, t: float) -> None:
        self.event.set()


def admission_event(engine: Any) -> trio.Event:
    """An event set when the engine admits its next request (event-driven, no polling)."""
    watch = _Admissions()
    engine.add_observer(watch)
    return watch.event


async def wait_until_queued(stream: trio.SocketStream, nbytes: int, timeout: float = 10) -> None:  # noqa: ASYNC109
    """Wait (bounded, checking every 10 ms) until ``nbytes`` sent by the server wait unread
    in this client's kernel receive queue: with small buffers, the server's next writes
    block."""
    with trio.fail_after(timeout):
        while _queued(stream) < nbytes:  # noqa: ASYNC110 (the kernel offers no event for it)
            await trio.sleep(0.01)


def _queued(stream: trio.SocketStream) -> int:
    raw = fcntl.ioctl(stream.socket.fileno(), termios.FIONREAD, b"\0\0\0\0")
    return int(struct.unpack("i", raw)[0])
