"""HTTP serving: an OpenAI-compatible API and Prometheus metrics for an omni-trio engine.

Needs the ``serve`` extra (hypercorn, starlette, prometheus-client)::

    async with omni_trio.open_engine("tiny-omni.yaml") as engine, trio.open_nursery() as n:
        port = await n.start(partial(serve_http, engine, host="127.0.0.1", port=0))
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from .app import create_app, health_report, serve_http
from .metrics import EngineMetrics

__all__ = ["EngineMetrics", "create_app", "health_report", "serve_engine", "serve_http"]


async def serve_engine(
    config: Any | Mapping[str, Any] | str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    grace_period: float = 10.0,
    **overrides: Any,
) -> None:
    """Open an engine on ``config`` and serve it over HTTP until ``shutdown_trigger()``
    returns or the caller is cancelled; then stop the server (in-flight requests get up to
    ``grace_period`` seconds) and close the engine (aborting what is left, stopping every
    stage). Reports the bound port through ``task_status``. Raises ConfigError,
    StageStartError (the engine did not start) or OSError (the address is taken)."""
    from ..engine import open_engine

    async with open_engine(config, **overrides) as engine:
        await serve_http(
            engine,
            host=host,
            port=port,
            task_status=task_status,
            shutdown_trigger=shutdown_trigger,
            grace_period=grace_period,
        )
