"""``WS /v1/realtime`` end to end: a real Hypercorn serving scripted pipelines, the stock
``openai`` realtime client (its sync client, in a thread: its async one runs on asyncio)."""

from __future__ import annotations

import json
import socket
import threading
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import trio
from websockets.sync.client import connect as ws_connect

from omni_trio import ConfigError
from omni_trio.server import create_app, serve_http
from omni_trio.server.realtime import RealtimeLimits
from omni_trio.testing import scripted_backends, scripted_pipeline

from .conftest import running_server

WAIT = 30  # a bound on each client conversation (a wedged server fails, never hangs)


def pipeline(**options: Any) -> Any:
    sessions = {"detach_grace_s": 0.2, **options.pop("sessions", {})}
    return scripted_pipeline(
        ["a", "b"], stream_input=True, engine_options={"sessions": sessions}, **options
    )


def connect(base: str) -> Any:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    return client.realtime.connect(model="scripted", max_retries=0)


def user_text(conn: Any, text: str) -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    conn.conversation.item.create(item=item)


def read_until(conn: Any, kind: str) -> list[Any]:
    events = []
    for event in conn:
        events.append(event)
        if event.type == kind:
            return events
        if event.type == "error":
            raise AssertionError(f"an error event while awaiting {kind}: {event}")
    raise AssertionError(f"the connection closed before {kind}: {[e.type for e in events]}")


def send_resume(conn: Any, sid: str, token: str, last: int) -> None:
    resume = {"session_id": sid, "resume_token": token, "last_received_server_event_seq": last}
    conn.send_raw(json.dumps({"type": "session.resume", **resume}))


async def in_thread(fn: Any, *args: Any) -> Any:
    with trio.fail_after(WAIT):
        return await trio.to_thread.run_sync(partial(fn, *args), abandon_on_cancel=True)


def seqs(events: list[Any]) -> list[int]:
    return [e.server_event_seq for e in events]  # an extra field: pydantic keeps it


def texts(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


async def test_text_in_text_out_with_the_stock_client():
    def converse(base: str) -> tuple[Any, list[Any], Any]:
        with connect(base) as conn:
            created = conn.recv()
            conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
            updated = read_until(conn, "session.updated")[-1]
            user_text(conn, "hey")
            conn.response.create()
            events = read_until(conn, "response.done")
            conn.send_raw(json.dumps({"type": "heartbeat"}))
            beat = read_until(conn, "heartbeat")[-1]
            return created, [updated, *events, beat], conn

    async with running_server(pipeline(outputs=3)) as (engine, base):
        created, events, _ = await in_thread(converse, base)
        assert created.type == "session.created"
        assert created.session.resume_token  # the extras ride along in the session object
        assert events[0].session.output_modalities == ["text"]
        kinds = [e.type for e in events]
        assert "conversation.item.created" in kinds and "response.created" in kinds
        done = next(e for e in events if e.type == "response.done")
        assert done.response.status == "completed"
        # the last stage's three outputs, in order
        (received,) = scripted_backends(engine, "a")[0].received.values()
        assert [c.prompt for c in received] == ["hey"]
        assert texts(events).startswith("b:") and texts(events).count("b:") == 3
        assert seqs(events) == sorted(seqs(events))
        assert events[-1].type == "heartbeat"
        # the socket closed: the session is detached, not gone (it waits for a resume)
        with trio.fail_after(WAIT):
            while engine.statistics().sessions:  # noqa: ASYNC110 (no event for the grace end)
                await trio.sleep(0.01)


async def test_malformed_unknown_and_out_of_order_events_get_errors_and_the_socket_stays_open():
    def converse(base: str) -> list[Any]:
        with connect(base) as conn:
            read_until(conn, "session.created")
            errors = []
            for raw in (
                "not json",
                json.dumps(["a list"]),
                json.dumps({"type": "no.such.event", "event_id": "e1"}),
                json.dumps({"type": "response.create", "event_id": "e2"}),  # nothing to answer
                json.dumps({"type": "input_audio_buffer.append", "audio": "!!"}),
                json.dumps({"type": "session.event_ack", "server_event_seq": "x"}),
                json.dumps(
                    {
                        "type": "session.resume",
                        "session_id": "nope",
                        "resume_token": "t",
                        "last_received_server_event_seq": 0,
                    }
                ),
            ):
                conn.send_raw(raw)
                errors.append(read_until(conn, "error")[-1])
            user_text(conn, "ok")
            conn.response.create()
            events = read_until(conn, "response.done")
            return [*errors, events[-1]]

    async with running_server(pipeline(outputs=2)) as (
        engine,
        base,
    ):
        *errors, done = await in_thread(converse, base)
        codes = [e.error.code for e in errors]
        assert codes == [
            "invalid_event",
            "invalid_event",
            "unknown_event",
            "invalid_request",
            "invalid_event",
            "invalid_event",
            "session_resume",
        ]
        assert "JSON" in errors[0].error.message
        assert errors[2].error.event_id == "e1" and "no.such.event" in errors[2].error.message
        assert errors[3].error.event_id == "e2" and "nothing to commit" in errors[3].error.message
        assert errors[4].error.param == "audio"
        assert all(e.error.type for e in errors)
        # the same socket still converses
        assert done.response.status == "completed"


async def test_barge_in_cancels_the_response_in_every_stage():
    def converse(base: str) -> list[Any]:
        with connect(base) as conn:
            read_until(conn, "session.created")
            user_text(conn, "go")
            conn.response.create()
            read_until(conn, "response.created")
            conn.response.cancel()
            return read_until(conn, "response.done")

    config = pipeline(outputs=4, stage_options={"b": {"hang": True}})
    async with running_server(config) as (engine, base):
        events = await in_thread(converse, base)
        assert events[-1].response.status == "cancelled"
        assert not [e for e in events if e.type == "response.output_text.delta"]
        for stage in ("a", "b"):
            (backend,) = scripted_backends(engine, stage)
            assert backend.aborted == [events[-1].response.id] or stage == "a"
        assert engine.statistics().requests_in_flight == 0


async def test_reconnect_and_resume_replays_what_the_client_missed():
    def first(base: str) -> tuple[str, str, list[Any]]:
        with connect(base) as conn:
            created = read_until(conn, "session.created")[-1]
            user_text(conn, "abcdef")
            conn.response.create()
            events = read_until(conn, "response.output_text.delta")
            return created.session.id, created.session.resume_token, events

    def second(base: str, sid: str, token: str, last: int) -> list[Any]:
        with connect(base) as conn:
            read_until(conn, "session.created")
            send_resume(conn, sid, token, last)
            return read_until(conn, "response.done")

    config = pipeline(outputs=6, latency_s=0.05)
    async with running_server(config) as (engine, base):
        sid, token, before = await in_thread(first, base)
        last = before[-1].server_event_seq
        after = await in_thread(second, base, sid, token, last)
        assert (
            after[0].type == "session.resumed" and after[0].session["id"] == sid
        )  # not in the stock models
        replayed = after[1:]
        assert all(s > last for s in seqs(replayed))
        assert after[-1].response.status == "completed"
        # nothing lost, nothing twice: every output of the response, in order
        assert (texts(before) + texts(replayed)).count("b:") == 6
        # the token was used: a second resume with it is refused
        errors = await in_thread(second_error, base, sid, token)
        assert errors.error.code == "session_resume"


def second_error(base: str, sid: str, token: str) -> Any:
    with connect(base) as conn:
        read_until(conn, "session.created")
        send_resume(conn, sid, token, 0)
        return read_until(conn, "error")[-1]


async def test_a_client_that_stops_reading_is_told_and_its_session_closed():
    config = pipeline(outputs=100_000)
    limits = RealtimeLimits(max_output_events=64)

    done = threading.Event()

    def stall(port: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        # max_queue: the client library's reader stops taking frames off the socket once one
        # is queued, so nothing reads: the socket's buffers fill, then the server's output
        with ws_connect(f"ws://127.0.0.1:{port}/v1/realtime", sock=sock, max_queue=1) as ws:
            ws.recv(timeout=WAIT)  # session.created
            item = {"type": "message", "content": [{"type": "input_text", "text": "x"}]}
            ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            ws.send(json.dumps({"type": "response.create"}))
            done.wait(WAIT)  # ...and never reads again: the server must close it

    async with running_server(config) as (engine, base):
        app = create_app(engine, realtime=limits)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_http, engine, port=0, app=app))
            async with trio.open_nursery() as clients:
                clients.start_soon(
                    partial(trio.to_thread.run_sync, stall, port, abandon_on_cancel=True)
                )
                with trio.fail_after(WAIT):
                    # the connection stays until its client reads or goes: a sure sign
                    while not app.state.realtime.connections:  # noqa: ASYNC110
                        await trio.sleep(0.01)
                    while engine.statistics().sessions or engine.statistics().requests_total < 1:  # noqa: ASYNC110
                        await trio.sleep(0.01)
                # the session closed while the client still holds its socket unread
                assert app.state.realtime.detached == {}  # closed, not detached
                done.set()
                clients.cancel_scope.cancel()
            assert engine.statistics().requests_in_flight == 0
            # the server serves on
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                assert (await http.get("/health")).status_code == 200
            nursery.cancel_scope.cancel()


@pytest.mark.slow  # 100 real sockets against a real server
async def test_100_sessions_dropped_mid_response_some_resumed_leave_the_server_healthy():
    def drop(base: str, i: int) -> list[Any]:
        conn = connect(base).enter()
        created = read_until(conn, "session.created")[-1]
        user_text(conn, f"turn {i}")
        conn.response.create()
        last = read_until(conn, "response.output_text.delta")[-1].server_event_seq
        if i % 2:
            conn.close()  # a clean close
        else:
            # no close frame: the TCP connection just ends
            conn._connection.socket.shutdown(socket.SHUT_RDWR)
            try:
                conn.close()
            except Exception:  # noqa: BLE001 (the client's own close of a dead socket)
                pass
        if i % 10:
            return []
        with connect(base) as again:
            read_until(again, "session.created")
            send_resume(again, created.session.id, created.session.resume_token, last)
            return read_until(again, "response.done")

    # the grace outlasts a loaded machine's delay between a drop and its resume
    config = pipeline(outputs=40, latency_s=0.02, sessions={"detach_grace_s": 5.0})
    async with running_server(config) as (engine, base):
        results: list[list[Any]] = [[] for _ in range(100)]
        limiter = trio.CapacityLimiter(20)

        async def one(i: int) -> None:
            results[i] = await trio.to_thread.run_sync(
                partial(drop, base, i), limiter=limiter, abandon_on_cancel=True
            )

        with trio.fail_after(4 * WAIT):
            async with trio.open_nursery() as nursery:
                for i in range(100):
                    nursery.start_soon(one, i)
        resumed = [r for r in results if r]
        assert len(resumed) == 10
        for events in resumed:
            assert events[0].type == "session.resumed"
            assert events[-1].response.status == "completed"
        async with httpx.AsyncClient(base_url=base) as http:
            assert (await http.get("/health")).status_code == 200
            with trio.fail_after(WAIT):
                while engine.statistics().sessions:  # noqa: ASYNC110 (no event for grace ends)
                    await trio.sleep(0.05)
            metrics = (await http.get("/metrics")).text
        assert "\nomni_trio_sessions 0.0\n" in metrics
        assert engine.statistics().requests_in_flight == 0


async def test_session_update_sets_the_sampling_of_later_turns_and_bad_values_change_nothing():
    def converse(base: str) -> tuple[list[Any], ...]:
        with connect(base) as conn:
            read_until(conn, "session.created")
            update = {"type": "realtime", "max_output_tokens": 2, "temperature": 0.5}
            conn.session.update(session=update)
            updated = read_until(conn, "session.updated")
            user_text(conn, "hello")
            conn.response.create()
            capped = read_until(conn, "response.done")
            # bad values: an error naming the field; the settings stay as they were
            bad = []
            for session in ({"max_output_tokens": -1}, {"temperature": "hot"}, {"voice": ""}):
                conn.send_raw(json.dumps({"type": "session.update", "session": session}))
                bad.append(next(iter(conn)))
            user_text(conn, "hello")
            conn.response.create()
            still = read_until(conn, "response.done")
            conn.session.update(session={"type": "realtime", "max_output_tokens": "inf"})
            reset = read_until(conn, "session.updated")
            user_text(conn, "hello")
            conn.response.create()
            whole = read_until(conn, "response.done")
            return updated, capped, bad, still, reset, whole

    async with running_server(pipeline(outputs=4)) as (engine, base):
        updated, capped, bad, still, reset, whole = await in_thread(converse, base)
        assert updated[-1].session.max_output_tokens == 2
        assert texts(capped).count("b:") == 2
        assert [(e.type, e.error.param) for e in bad] == [
            ("error", "session.max_output_tokens"),
            ("error", "session.temperature"),
            ("error", "session.voice"),
        ]
        assert texts(still).count("b:") == 2
        assert reset[-1].session.max_output_tokens == "inf"
        assert texts(whole).count("b:") == 4
        # the text stage (the last one) got them; "inf" dropped the bound, not the temperature
        (first, *_), *_, (last, *_) = scripted_backends(engine, "b")[0].sampling.values()
        assert first["max_tokens"] == 2 and first["temperature"] == 0.5
        assert "max_tokens" not in last and last["temperature"] == 0.5


async def test_the_server_sends_a_heartbeat_after_a_silence():
    limits = RealtimeLimits(heartbeat_s=0.05)

    def listen(port: int) -> list[dict[str, Any]]:
        # vLLM-Omni's ?duplex=1 is accepted: every session here is full duplex
        with ws_connect(f"ws://127.0.0.1:{port}/v1/realtime?duplex=1") as ws:
            events = [json.loads(ws.recv(timeout=WAIT)) for _ in range(3)]
            ws.send(json.dumps({"type": "heartbeat"}))  # the client's own: answered too
            events.append(json.loads(ws.recv(timeout=WAIT)))
            return events

    async with running_server(pipeline(outputs=1)) as (engine, _):
        app = create_app(engine, realtime=limits)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_http, engine, port=0, app=app))
            events = await in_thread(listen, port)
            nursery.cancel_scope.cancel()
    assert [e["type"] for e in events] == ["session.created", "heartbeat", "heartbeat", "heartbeat"]
    assert all(e["server_event_seq"] == 0 for e in events)  # nothing of the session's journal


@pytest.mark.parametrize(
    ("limits", "named"),
    [
        ({"max_output_events": 0}, "max_output_events must be >= 1"),
        ({"max_output_bytes": -1}, "max_output_bytes must be >= 1"),
        ({"heartbeat_s": 0}, "heartbeat_s must be > 0 or None"),
    ],
)
def test_bad_limits_are_refused_naming_the_field(limits: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        RealtimeLimits(**limits)


async def test_session_close_ends_the_session_at_once_and_the_socket():
    def converse(base: str) -> list[Any]:
        with connect(base) as conn:
            read_until(conn, "session.created")
            user_text(conn, "hi")
            conn.response.create()
            read_until(conn, "response.done")
            conn.send_raw(json.dumps({"type": "session.close"}))
            closed = read_until(conn, "session.closed")
            rest = list(conn)  # the server closes the socket after it
            return [*closed, *rest]

    # a long detach grace: a session that were only detached would still be there
    async with running_server(pipeline(outputs=2, sessions={"detach_grace_s": 600})) as (
        engine,
        _base,
    ):
        events = await in_thread(converse, _base)
        assert events[-1].type == "session.closed"
        with trio.fail_after(WAIT):
            while engine.statistics().sessions:  # noqa: ASYNC110 (no event for it)
                await trio.sleep(0.01)
        assert engine.statistics().requests_in_flight == 0
