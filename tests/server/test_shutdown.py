"""The server's life in-process, over a real Hypercorn: 503 while the stages start, the cut at
the end of the grace period (SSE ``server_shutdown`` event, then ``[DONE]``), and a bounded
stop even when a client never reads what it is sent."""

from __future__ import annotations

import gc
import json
import logging
import socket
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from omni_trio.errors import StageStartError
from omni_trio.server import (
    ServerLifecycle,
    ServerPhase,
    bind_socket,
    create_app,
    health_report,
    serve_engine,
    serve_http,
)
from omni_trio.server.lifecycle import refusal
from omni_trio.testing import scripted_backends, scripted_pipeline

from .conftest import (
    admission_event,
    client_for,
    raw_connection,
    running_server,
    wait_until_idle,
    wait_until_queued,
    watch_logs,
)

MSG = [{"role": "user", "content": "hi"}]
STREAM_CHAT = {"model": "scripted", "messages": MSG, "stream": True}


async def start_unread_stream(port: int) -> trio.SocketStream:
    """A client that starts a streamed completion whose first event (the echoed 1 MiB prompt)
    is far larger than both kernel buffers, then never reads: once its receive queue is
    full, the server's write of that event is blocked, and stays blocked."""
    client = await raw_connection(port, rcvbuf=4096)
    request = {"model": "scripted", "prompt": "x" * 2**20, "stream": True, "echo": True}
    body = json.dumps(request).encode()
    await client.send_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await wait_until_queued(client, 4000)
    return client


def hanging():
    return scripted_pipeline(["thinker", "talker"], name="scripted", hang=True)


async def test_a_stream_cut_at_shutdown_ends_with_a_server_shutdown_event_and_done():
    stop = trio.Event()
    options = {"shutdown_trigger": stop.wait, "grace_period": 0.0}
    async with running_server(hanging(), serve_options=options) as (engine, base):
        async with client_for(base) as http:
            async with http.stream("POST", "/v1/chat/completions", json=STREAM_CHAT) as r:
                assert r.status_code == 200
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        if len(events) == 1:  # the role chunk: admitted, now hanging
                            stop.set()
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutdown" and error["type"] == "server_error"
        assert "grace period" in error["message"]
        await wait_until_idle(engine)
        assert engine.statistics().requests_aborted == 1
        for sid in ("thinker", "talker"):
            assert len(scripted_backends(engine, sid)[0].aborted) == 1


async def test_a_non_streaming_request_cut_at_shutdown_is_503_server_shutdown():
    stop = trio.Event()
    lifecycle = ServerLifecycle()
    async with running_server(hanging()) as (engine, _):
        app = create_app(engine, lifecycle=lifecycle)
        async with trio.open_nursery() as nursery:
            serve = partial(
                serve_http, engine, port=0, app=app, shutdown_trigger=stop.wait, grace_period=0
            )
            port = await nursery.start(serve)
            admitted = admission_event(engine)
            async with client_for(f"http://127.0.0.1:{port}") as http:

                async def stop_once_admitted() -> None:
                    await admitted.wait()
                    stop.set()

                nursery.start_soon(stop_once_admitted)
                body = {"model": "scripted", "prompt": "x"}
                r = await http.post("/v1/completions", json=body)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "server_shutdown"
        assert lifecycle.phase is ServerPhase.STOPPED
        await wait_until_idle(engine)
        assert engine.statistics().requests_aborted == 1


async def test_a_client_that_never_reads_cannot_hold_the_server_past_the_bound():
    sock = bind_socket("127.0.0.1", 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    cfg = scripted_pipeline(["thinker"], name="scripted", outputs=10_000_000)
    stop = trio.Event()
    grace, cut = 1.0, 0.5
    done = trio.Event()
    lifecycle = ServerLifecycle()
    async with running_server(cfg) as (engine, _):
        app = create_app(engine, lifecycle=lifecycle)

        async def serve() -> None:
            await serve_http(
                engine,
                app=app,
                sock=sock,
                shutdown_trigger=stop.wait,
                grace_period=grace,
                cut_timeout=cut,
            )
            done.set()

        with watch_logs() as logs:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                client = await start_unread_stream(sock.getsockname()[1])
                t0 = trio.current_time()
                stop.set()
                with trio.move_on_after(grace + cut + 10):
                    await done.wait()
                if not done.is_set():  # unwedge the server before failing the test
                    await client.aclose()
                    pytest.fail("the server did not stop while a client did not read")
                elapsed = trio.current_time() - t0
                await client.aclose()
        # the write was still blocked at the cut: its connection was closed under it
        warnings = [r.getMessage() for r in logs.at_least(logging.WARNING)]
        assert any("closed 1 connection(s) still open" in m for m in warnings), warnings
        assert grace <= elapsed < grace + cut + 10
        assert lifecycle.phase is ServerPhase.STOPPED
        await wait_until_idle(engine)
        assert engine.statistics().requests_aborted == 1


async def test_serve_engine_listens_first_and_answers_503_while_stages_start(mock_clock):
    # the stage's start delay runs on the mock clock: it starts when the test says so
    cfg = scripted_pipeline(
        ["thinker", "talker"],
        name="scripted",
        outputs=2,
        stage_options={"talker": {"start_delay_s": 60}},
    )
    ready = trio.Event()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        serve = partial(
            serve_engine,
            cfg,
            port=0,
            shutdown_trigger=stop.wait,
            on_ready=lambda engine, port: ready.set(),
        )
        port = await nursery.start(serve)
        base = f"http://127.0.0.1:{port}"
        async with client_for(base) as http:
            r = await http.get("/health")
            assert r.status_code == 503
            assert r.json()["status"] == "starting"
            assert set(r.json()["stages"]) == {"thinker", "talker"}
            r = await http.post("/v1/chat/completions", json={"model": "scripted", "messages": MSG})
            assert r.status_code == 503
            assert r.headers["retry-after"] == "5"
            assert r.json()["error"]["code"] == "starting"
            r = await http.get("/v1/models")
            assert r.status_code == 200
        assert not ready.is_set()
        mock_clock.jump(60)
        await ready.wait()
        async with client_for(base) as http:
            r = await http.get("/health")
            assert r.status_code == 200 and r.json()["status"] == "ok"
            r = await http.post("/v1/chat/completions", json={"model": "scripted", "messages": MSG})
            assert r.status_code == 200
        stop.set()
    # the server drained and stopped, then the engine closed
    with pytest.raises(httpx.ConnectError):
        async with client_for(base) as http:
            await http.get("/health")


async def test_a_shutdown_while_stages_start_stops_them_at_once():
    cfg = scripted_pipeline(
        ["thinker"], name="scripted", stage_options={"thinker": {"start_delay_s": 3600}}
    )
    stop = trio.Event()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(serve_engine, cfg, port=0, shutdown_trigger=stop.wait))
            stop.set()


@pytest.mark.parametrize("freeze", [True, False])
async def test_serve_engine_freezes_the_startup_heap_while_it_serves(freeze):
    cfg = scripted_pipeline(["thinker"], name="scripted", outputs=2)
    stop = trio.Event()
    frozen_when_ready: list[int] = []
    ready = trio.Event()

    def on_ready(engine: object, port: int) -> None:
        frozen_when_ready.append(gc.get_freeze_count())
        ready.set()

    assert gc.get_freeze_count() == 0
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                partial(
                    serve_engine,
                    cfg,
                    port=0,
                    shutdown_trigger=stop.wait,
                    freeze_heap=freeze,
                    on_ready=on_ready,
                )
            )
            await ready.wait()
            async with client_for(f"http://127.0.0.1:{port}") as http:
                r = await http.post(
                    "/v1/chat/completions", json={"model": "scripted", "messages": MSG}
                )
                assert r.status_code == 200
            stop.set()
    # frozen once the stages were up (the default), and undone when serving ended
    assert len(frozen_when_ready) == 1 and (frozen_when_ready[0] > 0) == freeze
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("when", ["starting", "serving", "stopping"])
async def test_serve_engine_cancelled_in_any_phase_leaves_the_heap_unfrozen(when):
    # the stage's start takes a while (the cancel lands during it), and a request that never
    # answers is in flight when the shutdown begins
    cfg = scripted_pipeline(
        ["thinker"],
        name="scripted",
        outputs=2,
        stage_options={"thinker": {"start_delay_s": 0.2, "latency_s": 3600}},
    )
    stop = trio.Event()
    ready = trio.Event()
    engines: list[Any] = []

    def on_ready(engine: Any, port: int) -> None:
        engines.append(engine)
        ready.set()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                partial(serve_engine, cfg, port=0, shutdown_trigger=stop.wait, on_ready=on_ready)
            )
            if when != "starting":
                await ready.wait()
                assert gc.get_freeze_count() > 0
            if when == "stopping":
                admitted = admission_event(engines[0])

                async def never_answered() -> None:
                    async with client_for(f"http://127.0.0.1:{port}") as http:
                        await http.post(
                            "/v1/chat/completions", json={"model": "scripted", "messages": MSG}
                        )

                nursery.start_soon(never_answered)
                await admitted.wait()
                stop.set()  # the shutdown begins with the request in flight (its grace period)
                await trio.lowlevel.checkpoint()
            nursery.cancel_scope.cancel()
    assert ready.is_set() == (when != "starting")
    assert gc.get_freeze_count() == 0


async def test_serve_engine_whose_stage_fails_to_start_never_freezes_the_heap():
    cfg = scripted_pipeline(
        ["thinker"], name="scripted", stage_options={"thinker": {"fail_start": True}}
    )
    with trio.fail_after(30), pytest.RaisesGroup(StageStartError, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(serve_engine, cfg, port=0))
    assert gc.get_freeze_count() == 0


def test_refusal_by_phase():
    assert refusal(ServerPhase.SERVING, "/v1/completions") is None
    assert refusal(ServerPhase.STARTING, "/health") is None
    assert refusal(ServerPhase.STARTING, "/v1/models") is None
    status, body, headers = refusal(ServerPhase.STARTING, "/v1/audio/speech") or (0, {}, [])
    assert (status, headers) == (503, [(b"retry-after", b"5")])
    for phase in (ServerPhase.DRAINING, ServerPhase.CUT, ServerPhase.STOPPED):
        status, body, _ = refusal(phase, "/v1/chat/completions") or (0, {}, [])
        assert status == 503 and body["error"]["code"] == "server_shutdown"  # type: ignore[index]


async def test_health_report_by_phase():
    async with running_server(scripted_pipeline(["a"], name="scripted")) as (engine, _):
        stats = engine.statistics()
        assert health_report(stats)[0] == 200
        assert health_report(stats, ServerPhase.STARTING)[1]["status"] == "starting"
        code, body = health_report(stats, ServerPhase.DRAINING)
        assert code == 503 and body["status"] == "stopping"


def test_lifecycle_only_moves_forward():
    life = ServerLifecycle(starting=True)
    life.mark_cut()
    life.mark_serving()
    assert life.phase is ServerPhase.CUT
    assert ServerLifecycle().phase is ServerPhase.SERVING


async def test_cancelling_the_server_closes_a_connection_blocked_on_a_write_at_once():
    sock = bind_socket("127.0.0.1", 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    cfg = scripted_pipeline(["thinker"], name="scripted", outputs=10_000_000)
    async with running_server(cfg) as (engine, _):
        done = trio.Event()
        server_scope = trio.CancelScope()

        async def serve() -> None:
            with server_scope:
                await serve_http(engine, sock=sock, grace_period=600)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            client = await start_unread_stream(sock.getsockname()[1])
            server_scope.cancel()  # a second Ctrl-C
            with trio.move_on_after(10):
                await done.wait()
            if not done.is_set():
                await client.aclose()
                pytest.fail("cancellation did not stop a server blocked on a write")
            await client.aclose()
        await wait_until_idle(engine)
        assert engine.statistics().requests_aborted == 1
