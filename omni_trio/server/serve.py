"""Run the HTTP app: ``serve_http`` for an engine that is open, ``serve_engine`` for a config
(listen first, then start the stages, then serve).

Both run inside the caller's nursery, so every HTTP request's task lives beside the engine's
own tasks: a client that disconnects cancels its request's task, and with it the request in
every stage. Shutdown is bounded whatever the clients do (see :mod:`.connections`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, nullcontext
from functools import partial
from typing import TYPE_CHECKING

import trio

from ..heap import frozen_heap
from .app import create_app
from .asgi import ASGIApp
from .connections import CUT_TIMEOUT_S, bind_socket, serve_asgi
from .guard import DEFAULT_MAX_BODY_BYTES
from .lifecycle import ServerLifecycle

if TYPE_CHECKING:
    from ..config.pipeline import PipelineConfig
    from ..engine.engine import Engine

__all__ = ["serve_engine", "serve_http"]


def _lifecycle_of(app: ASGIApp) -> ServerLifecycle:
    # an app from create_app shares its lifecycle; a foreign ASGI app gets a fresh one
    # (it is not told of the cut, its connections are still closed in bounded time)
    state = getattr(app, "state", None)
    found = getattr(state, "lifecycle", None)
    return found if isinstance(found, ServerLifecycle) else ServerLifecycle()


async def serve_http(
    engine: Engine,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    grace_period: float = 10.0,
    app: ASGIApp | None = None,
    sock: socket.socket | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    cut_timeout: float = CUT_TIMEOUT_S,
) -> None:
    """Serve ``engine`` over HTTP until cancelled or until ``shutdown_trigger()`` returns.

    Listens on ``sock`` if given (see :func:`~.connections.bind_socket`), else binds
    ``host:port`` (``port=0`` picks a free one), and reports the port with
    ``task_status.started(port)``. ``app`` defaults to ``create_app(engine,
    max_body_bytes=...)``. On shutdown it stops accepting, lets in-flight requests finish for
    up to ``grace_period`` seconds, then cuts them (which aborts them in every stage; a
    stream ends with a ``server_shutdown`` event), closes whatever connection is still
    open ``cut_timeout`` seconds later, and returns. Cancellation closes every connection at
    once. Raises :class:`~omni_trio.errors.ServerBindError` if the address cannot be bound."""
    listening = sock if sock is not None else bind_socket(host, port)
    asgi = app if app is not None else create_app(engine, max_body_bytes=max_body_bytes)
    await serve_asgi(
        asgi,
        [listening],
        lifecycle=_lifecycle_of(asgi),
        shutdown_trigger=shutdown_trigger,
        grace_period=grace_period,
        cut_timeout=cut_timeout,
        task_status=task_status,
    )


async def serve_engine(
    config: PipelineConfig | Mapping[str, object] | str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    grace_period: float = 10.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    on_ready: Callable[[Engine, int], object] | None = None,
    enter_engine: Callable[[Engine], AbstractAsyncContextManager[object]] | None = None,
    freeze_heap: bool = True,
    **overrides: object,
) -> None:
    """Serve a pipeline over HTTP: load ``config``, listen on ``host:port`` (reported with
    ``task_status.started(port)`` before any stage starts), start the engine's stages
    (meanwhile ``/health`` answers 503 ``starting`` and completions 503 with
    ``Retry-After``), call ``on_ready(engine, port)``, and serve until ``shutdown_trigger()``
    returns (see :func:`serve_http` for the bounded shutdown) or the caller is cancelled;
    then close the engine (aborting what is left, stopping every stage). A shutdown during
    start-up stops the starting stages at once. ``enter_engine(engine)``, if given, is the
    async context manager that starts and closes the engine instead of ``async with
    engine`` (the command line's progress display: :mod:`omni_trio.cli.progress`).
    ``freeze_heap``: once the stages are up, leave the startup heap (vLLM, torch) out of
    the garbage collector's full collections while serving, as vLLM's API server does
    (:func:`~omni_trio.heap.frozen_heap`: a full collection otherwise stops the process for
    ~0.4 s with vLLM loaded); process-wide, undone when serving ends.

    Raises ConfigError (synchronously, before listening), ServerBindError (the address is
    taken: at once, not after the stages started) or StageStartError."""
    from ..engine.engine import open_engine

    engine = open_engine(config, **overrides)
    listening = bind_socket(host, port)
    lifecycle = ServerLifecycle(starting=True)
    app = create_app(engine, lifecycle=lifecycle, max_body_bytes=max_body_bytes)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(
            partial(
                serve_asgi,
                app,
                [listening],
                lifecycle=lifecycle,
                shutdown_trigger=shutdown_trigger,
                grace_period=grace_period,
            )
        )
        task_status.started(bound)
        serving = trio.Event()
        with trio.CancelScope() as session:
            # a shutdown while the stages start stops them at once
            nursery.start_soon(_cancel_if_stopped_first, lifecycle, serving, session)
            async with engine if enter_engine is None else enter_engine(engine):
                with frozen_heap() if freeze_heap else nullcontext():
                    serving.set()
                    lifecycle.mark_serving()
                    if on_ready is not None:
                        on_ready(engine, bound)
                    # the server stops first (draining its requests); then the engine closes
                    await lifecycle.wait_stopped()


async def _cancel_if_stopped_first(
    lifecycle: ServerLifecycle, serving: trio.Event, scope: trio.CancelScope
) -> None:
    await lifecycle.wait_stopped()
    if not serving.is_set():
        scope.cancel()
