"""Serve an ASGI app with Hypercorn's HTTP protocol on sockets bound beforehand, holding
every connection, so that shutdown takes bounded time.

Why not ``hypercorn.trio.serve``: its connection writes run in a shielded cancel scope
(``TCPServer.protocol_send``), so a client that stops reading blocks a write forever; the
connection's task can then never finish, and neither cancellation nor the graceful timeout
ends the server (one such client wedged ``omni-trio serve`` on SIGTERM). Here each accepted
stream is tracked, and a write still blocked when the time is up is abandoned by closing its
socket (trio wakes the blocked ``send_all`` with ``ClosedResourceError``). The HTTP parsing
and the ASGI bridge stay Hypercorn's (``TCPServer``, unchanged).

Shutdown (``shutdown_trigger()`` returned)::

    stop accepting -> DRAINING: idle keep-alive connections close, in-flight requests run
    -> after grace_period: CUT (responses end, streams get a server_shutdown event)
    -> after cut_timeout more: close every connection left, cancel its task -> STOPPED

Cancellation (a second Ctrl-C) skips the waits: every connection is closed at once.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import trio

from ..errors import ServerBindError
from .asgi import ASGIApp
from .lifecycle import ServerLifecycle

if TYPE_CHECKING:
    from hypercorn.config import Config
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ASGIFramework

__all__ = ["CUT_TIMEOUT_S", "bind_socket", "hypercorn_config", "serve_asgi"]

logger = logging.getLogger(__name__)

# after the grace period, how long responses get to send their last words (the shutdown
# event, [DONE]) before their connections are closed under them
CUT_TIMEOUT_S = 2.0


def bind_socket(host: str, port: int, *, backlog: int = 1024) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: a free one). Synchronous.

    Bind before the slow work (starting stages) so that a taken port fails at once.
    Raises :class:`~omni_trio.errors.ServerBindError` (an OSError) naming ``host:port``."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ServerBindError(host, port, exc) from exc
    try:
        # lets a restarted server rebind while old connections linger in TIME_WAIT; it
        # does not let two servers listen on one port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ServerBindError(host, port, exc) from exc
    return sock


def hypercorn_config(*, keep_alive_timeout: float = 5.0) -> Config:
    """Hypercorn's settings for :func:`serve_asgi` (its own access log off: the app logs).
    Synchronous."""
    from hypercorn.config import Config

    config = Config()
    config.accesslog = None
    config.errorlog = logging.getLogger("omni_trio.server.hypercorn")
    config.keep_alive_timeout = keep_alive_timeout
    return config


class _Connections:
    """The accepted streams whose connection task is still running."""

    def __init__(self) -> None:
        self._streams: set[trio.SocketStream] = set()
        self._empty = trio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._streams)

    @contextmanager
    def track(self, stream: trio.SocketStream) -> Iterator[None]:
        if self._empty.is_set():
            self._empty = trio.Event()
        self._streams.add(stream)
        try:
            yield
        finally:
            self._streams.discard(stream)
            if not self._streams:
                self._empty.set()

    async def wait_empty(self) -> None:
        """Return once no connection is left. Checkpoints."""
        while self._streams:
            await self._empty.wait()
        await trio.lowlevel.checkpoint()

    def close_all(self) -> int:
        """Close every socket now (synchronous): a write blocked on one, even in a shielded
        scope, wakes with ClosedResourceError. Returns how many were open."""
        streams = list(self._streams)
        for stream in streams:
            stream.socket.close()
        return len(streams)


async def serve_asgi(
    app: ASGIApp,
    sockets: Sequence[socket.socket],
    *,
    lifecycle: ServerLifecycle,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    grace_period: float = 10.0,
    cut_timeout: float = CUT_TIMEOUT_S,
    config: Config | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on the listening ``sockets`` (see :func:`bind_socket`; this takes them
    over and closes them) until ``shutdown_trigger()`` returns, then shut down as the module
    docstring says and return; ``lifecycle`` follows (DRAINING, CUT, STOPPED).

    Reports the first socket's port with ``task_status.started``. Cancellation closes every
    connection at once and returns promptly (no grace period). Returns at most
    ``grace_period + cut_timeout`` seconds after the trigger, plus what the cancelled
    requests take to abort, whatever the clients do."""
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState
    from hypercorn.utils import wrap_app

    if not sockets:
        raise ValueError("serve_asgi needs at least one listening socket")
    config = config or hypercorn_config()
    context = WorkerContext(None)
    asgi = wrap_app(cast("ASGIFramework", app), config.wsgi_max_body_size, "asgi")
    port = int(sockets[0].getsockname()[1])
    listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(s)) for s in sockets]
    connections = _Connections()

    async def handle(stream: trio.SocketStream) -> None:
        with connections.track(stream):
            # (TCPServer's annotation says SSLStream; it handles plain streams too)
            await TCPServer(asgi, config, context, ConnectionState({}), cast(Any, stream))

    try:
        async with trio.open_nursery() as handlers:
            try:
                async with trio.open_nursery() as accepting:
                    serve = partial(trio.serve_listeners, handler_nursery=handlers)
                    await accepting.start(serve, handle, listeners)
                    task_status.started(port)
                    await (shutdown_trigger or trio.sleep_forever)()
                    accepting.cancel_scope.cancel()  # closes the listening sockets
                await _shut_down(lifecycle, context, connections, grace_period, cut_timeout)
            finally:
                # normally nobody is left; on cancellation, nobody may keep us waiting
                connections.close_all()
                handlers.cancel_scope.cancel()
    finally:
        for sock in sockets:
            sock.close()
        lifecycle.mark_stopped()


async def _shut_down(
    lifecycle: ServerLifecycle,
    context: WorkerContext,
    connections: _Connections,
    grace_period: float,
    cut_timeout: float,
) -> None:
    lifecycle.mark_draining()
    # Hypercorn closes idle keep-alive connections, and each busy one after its response
    await context.terminated.set()
    with trio.move_on_after(grace_period):
        await connections.wait_empty()
    if len(connections):
        logger.info("grace period over: cutting %d connection(s)", len(connections))
    lifecycle.mark_cut()
    with trio.move_on_after(cut_timeout):
        await connections.wait_empty()
    if len(connections):
        n = connections.close_all()
        logger.warning(
            "closed %d connection(s) still open %.1fs after the grace period "
            "(clients that do not read what they are sent)",
            n,
            cut_timeout,
        )
