"""Fixtures of the server tests: a real engine served by a real Hypercorn on 127.0.0.1:0.

No MockClock here: these tests do real network I/O, and autojump would fire while a task
waits on a socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import trio

import omni_trio
from omni_trio import testing
from omni_trio.server import serve_http


@asynccontextmanager
async def running_server(config: Any, **overrides: Any) -> AsyncIterator[tuple[Any, str]]:
    """``(engine, base_url)`` of an engine served on a free port; stops both on exit."""
    async with omni_trio.open_engine(config, **overrides) as engine:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_http, engine, host="127.0.0.1", port=0))
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
