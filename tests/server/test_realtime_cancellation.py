"""``WS /v1/realtime`` cancelled at every checkpoint of a conversation, deterministically.

The endpoint is the ASGI application a server runs per connection; here it runs in memory
(the ASGI websocket messages a server would pass, over trio channels) under ``MockClock`` on
scripted stages, so ``cancel_at_every_checkpoint`` can cancel the connection at each of its
checkpoints: a text turn, a barge-in (``response.cancel``), another turn, a disconnect. The
real-socket tests are in ``test_realtime.py``."""

from __future__ import annotations

import json
import math
from typing import Any

import trio

from omni_trio import open_engine
from omni_trio.server.realtime import RealtimeEndpoint
from omni_trio.testing import (
    assert_nothing_in_flight,
    cancel_at_every_checkpoint,
    scripted_pipeline,
)

SCOPE = {"type": "websocket", "path": "/v1/realtime", "headers": [], "query_string": b""}


class MemoryWebSocket:
    """Both ends of one ASGI websocket: the application's ``receive``/``send`` and a
    client's calls."""

    def __init__(self) -> None:
        self._to_app_tx, self._to_app_rx = trio.open_memory_channel[dict[str, Any]](math.inf)
        self._to_client_tx, self._to_client_rx = trio.open_memory_channel[dict[str, Any]](math.inf)
        self.gone = False

    # the application's side
    async def receive(self) -> dict[str, Any]:
        return await self._to_app_rx.receive()

    async def send(self, message: dict[str, Any]) -> None:
        if self.gone:
            raise OSError("the client went away")  # what a server's send raises then
        await self._to_client_tx.send(message)

    # the client's side
    async def connect(self) -> None:
        await self._to_app_tx.send({"type": "websocket.connect"})
        accepted = await self._to_client_rx.receive()
        assert accepted["type"] == "websocket.accept", accepted

    async def send_event(self, event: dict[str, Any]) -> None:
        await self._to_app_tx.send({"type": "websocket.receive", "text": json.dumps(event)})

    async def recv_until(self, kind: str) -> list[dict[str, Any]]:
        events = []
        while True:
            message = await self._to_client_rx.receive()
            assert message["type"] == "websocket.send", message
            event = json.loads(message["text"])
            events.append(event)
            if event["type"] == kind:
                return events
            assert event["type"] != "error", event

    async def disconnect(self) -> None:
        self.gone = True
        await self._to_app_tx.send({"type": "websocket.disconnect", "code": 1000})


def user_text(text: str) -> dict[str, Any]:
    content = [{"type": "input_text", "text": text}]
    return {"type": "conversation.item.create", "item": {"role": "user", "content": content}}


async def test_cancel_at_every_checkpoint_of_a_conversation(autojump_clock):
    cfg = scripted_pipeline(
        ["a", "b"],
        stream_input=True,
        outputs=4,
        latency_s=0.5,
        engine_options={"sessions": {"detach_grace_s": 1.0}},
    )
    endpoints: list[RealtimeEndpoint] = []
    done: list[str] = []

    async def conversation(engine: Any) -> None:
        endpoint = RealtimeEndpoint(engine, "scripted")
        endpoints.append(endpoint)
        ws = MemoryWebSocket()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(endpoint, SCOPE, ws.receive, ws.send)
                await ws.connect()
                await ws.recv_until("session.created")
                await ws.send_event(user_text("hi"))
                await ws.send_event({"type": "response.create"})
                await ws.recv_until("response.output_text.delta")
                await ws.send_event({"type": "response.cancel"})
                cancelled = (await ws.recv_until("response.done"))[-1]
                assert cancelled["response"]["status"] == "cancelled"
                await ws.send_event(user_text("again"))
                await ws.send_event({"type": "response.create"})
                completed = (await ws.recv_until("response.done"))[-1]
                assert completed["response"]["status"] == "completed"
                done.append(completed["response"]["id"])
                await ws.disconnect()
        finally:
            # a connection that ends (cancelled or not) leaves its session detached: the
            # client's part of the cleanup is the grace running out
            with trio.CancelScope(shield=True), trio.fail_after(60):
                while engine.statistics().sessions:  # noqa: ASYNC110 (no event for it)
                    await trio.sleep(0.1)

    def connection_gone(engine: Any) -> None:
        endpoint = endpoints[-1]
        assert (endpoint.connections, endpoint.attached) == (0, {}), endpoint
        assert engine.statistics().sessions == 0

    async with open_engine(cfg) as engine:
        report = await cancel_at_every_checkpoint(engine, conversation, invariant=connection_gone)
        report.raise_if_failed()
        assert report.runs == report.checkpoints + 1 >= 50
        # the uncancelled run got to its second, completed response
        assert done[:1] and done[0].endswith("/turn-1")
        assert_nothing_in_flight(engine)
