"""``bench_sessions.py`` over the wire: live sessions on ``WS /v1/realtime`` against one-shot
``POST /v1/completions`` on the same engine and server.

The server is ``omni_trio.server.serve_http`` (Hypercorn on trio) in this process; the clients
are synchronous (``websockets``' and ``httpx``'s), one worker thread per concurrent client, so
the process CPU time counts both ends. Systems (one operation each):

- ``http_one_shot``: ``POST /v1/completions`` (not streamed) on a kept-alive connection;
- ``ws_one_turn``: a new socket (a new session), ``session.created``, one user message and
  ``response.create``, read until ``response.done``, socket closed;
- ``ws_open_close``: a new socket, ``session.created``, socket closed.

A closed socket detaches its session (the protocol has no close event): the pipeline's
``detach_grace_s`` is short, and each run waits until every session has gone before the next.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import trio
from websockets.sync.client import connect

import omni_trio
from omni_trio.server import serve_http

from .session_cells import RateRun

WS_SYSTEMS = ("http_one_shot", "ws_one_turn", "ws_open_close")


def _receive_until(ws: Any, kind: str, bound_s: float) -> dict[str, Any]:
    while True:
        event: dict[str, Any] = json.loads(ws.recv(timeout=bound_s))
        if event["type"] == kind:
            return event
        if event["type"] == "error":
            raise AssertionError(f"an error event while awaiting {kind}: {event}")


def _ws_open_close(url: str, bound_s: float) -> None:
    with connect(url, open_timeout=bound_s) as ws:
        _receive_until(ws, "session.created", bound_s)


def _ws_one_turn(url: str, prompt: str, bound_s: float) -> None:
    content = [{"type": "input_text", "text": prompt}]
    item = {"type": "message", "role": "user", "content": content}
    with connect(url, open_timeout=bound_s) as ws:
        _receive_until(ws, "session.created", bound_s)
        ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        ws.send(json.dumps({"type": "response.create"}))
        done = _receive_until(ws, "response.done", bound_s)
        if done["response"]["status"] != "completed":
            raise AssertionError(f"a response ended {done['response']['status']}")


def _client_ops(
    system: str, base: str, model: str, prompt: str, count: int, bound_s: float
) -> None:
    """``count`` operations of ``system``, one after the other (in a worker thread)."""
    url = base.replace("http://", "ws://") + f"/v1/realtime?model={model}"
    if system == "http_one_shot":
        with httpx.Client(base_url=base, timeout=bound_s) as client:
            for _ in range(count):
                reply = client.post("/v1/completions", json={"model": model, "prompt": prompt})
                reply.raise_for_status()
                if not reply.json()["choices"][0]["text"]:
                    raise AssertionError("an empty completion")
        return
    op: Callable[[], None] = (
        partial(_ws_one_turn, url, prompt, bound_s)
        if system == "ws_one_turn"
        else partial(_ws_open_close, url, bound_s)
    )
    for _ in range(count):
        op()


async def _no_session_left(engine: omni_trio.Engine, bound_s: float) -> None:
    with trio.fail_after(bound_s):
        while engine.statistics().sessions:  # noqa: ASYNC110 (no event marks a grace's end)
            await trio.sleep(0.005)


async def ws_run(
    engine: omni_trio.Engine,
    base: str,
    system: str,
    prompt: str,
    n: int,
    concurrency: int,
    bound_s: float,
) -> RateRun:
    """``n`` operations of ``system`` by ``concurrency`` client threads; then wait until the
    sessions they detached are gone (not timed)."""
    model = engine.config.name
    per_client = [n // concurrency + (1 if c < n % concurrency else 0) for c in range(concurrency)]
    cpu0, t0 = time.process_time(), time.perf_counter()
    with trio.fail_after(bound_s * max(per_client)):
        async with trio.open_nursery() as nursery:
            for count in per_client:
                ops = partial(_client_ops, system, base, model, prompt, count, bound_s)
                nursery.start_soon(partial(trio.to_thread.run_sync, ops, abandon_on_cancel=True))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await _no_session_left(engine, bound_s)
    return RateRun(system, n, wall, cpu)


async def serving(config: Any, body: Callable[[omni_trio.Engine, str], Any], bound_s: float) -> Any:
    """Open an engine, serve it on a free port, run ``await body(engine, base_url)``."""
    async with omni_trio.open_engine(config) as engine:
        async with trio.open_nursery() as nursery:
            serve = partial(serve_http, engine, host="127.0.0.1", port=0)
            with trio.fail_after(bound_s):
                port = await nursery.start(serve)
            result = await body(engine, f"http://127.0.0.1:{port}")
            nursery.cancel_scope.cancel()
    return result
