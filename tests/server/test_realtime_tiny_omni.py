"""``WS /v1/realtime`` on the real tiny-omni pipeline (a vLLM thinker -> a vLLM talker -> the
torch vocoder), driven by the stock ``openai`` realtime client (its sync client, in a thread).

One server for the module (its engines take ~40 s to start): it runs in a trio loop of its
own thread (an anyio blocking portal), since each test is its own ``trio.run``; the tests
read the engine on that loop. Each test ends with nothing in flight in any layer, no request
left in either vLLM engine, no session left, and ``/metrics`` saying so.

A barge-in lands mid-response without a race: the entry stage serves each user turn as a
streaming-input request, and vLLM answers each input segment as it comes but finishes the
request only once its input ends (the commit). So a response whose turn is still open is in
flight for sure, however fast the engines are.
"""

from __future__ import annotations

import base64
import json
import math
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import trio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from omni_trio import testing
from omni_trio.cli.runner import resolve_config_arg
from omni_trio.engine.engine import Engine, EngineStatistics

from ..conftest import EngineWaitTimeout, bounded, engine_seconds
from .conftest import running_server
from .test_realtime import read_until, send_resume, seqs, texts, user_text

pytestmark = pytest.mark.vllm

#: a dropped socket's session waits this long for a resume, then closes (and the tests'
#: ends wait for that): longer than a loaded machine takes between a drop and its resume
SESSIONS = {"detach_grace_s": 5.0}
START_S = 300.0  # the engines' start (tiny models built on first use): a hang guard
STOP_S = 120.0
WAIT_S = 120.0  # one client conversation, or settling afterwards: a hang guard
PROMPTS = [
    "the tiny omni model sings a song about the river and the moon",
    "a long and winding road leads to the quiet village by the sea",
]
VLLM_STAGES = ["thinker", "talker"]


class SharedServer:
    """The module's engine and server, on the portal's trio loop."""

    def __init__(self, portal: BlockingPortal, engine: Engine, base: str) -> None:
        self.portal = portal
        self.engine = engine
        self.base = base

    async def run(self, check: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``await check(engine, *args)`` on the server's loop; its result or what it raised."""
        call = partial(self.portal.call, check, self.engine, *args)
        with bounded(f"{check.__name__} on the server's loop", WAIT_S, self.engine):
            return await trio.to_thread.run_sync(call, abandon_on_cancel=True)

    async def client(self, converse: Callable[..., Any], *args: Any) -> Any:
        """``converse(base_url, *args)``: a blocking client, in a thread."""
        call = partial(converse, self.base, *args)
        with bounded(f"the client's {converse.__name__}", WAIT_S, self.engine):
            return await trio.to_thread.run_sync(call, abandon_on_cancel=True)

    async def settle(self) -> EngineStatistics:
        """Wait until every session ended (a detached one lives ``detach_grace_s``) and
        nothing is in flight; check it in every layer, in vLLM and on ``/metrics``."""
        stats: EngineStatistics = await self.run(settled)
        assert stats.sessions == 0 and stats.requests_in_flight == 0
        assert await self.run(vllm_unfinished) == [0, 0]
        async with httpx.AsyncClient(base_url=self.base, timeout=WAIT_S) as http:
            metrics = (await http.get("/metrics")).text
        assert "\nomni_trio_sessions 0.0\n" in metrics
        return stats


async def settled(engine: Engine) -> EngineStatistics:
    await testing.wait_until_idle(engine)
    while engine.statistics().sessions:  # noqa: ASYNC110 (no event for a grace's end)
        await trio.sleep(0.05)
    testing.assert_nothing_in_flight(engine)
    return engine.statistics()


async def vllm_unfinished(engine: Engine) -> list[int]:
    return list(await engine.collective_rpc("get_num_unfinished_requests", stage_ids=VLLM_STAGES))


@asynccontextmanager
async def serving() -> AsyncIterator[tuple[Engine, str]]:
    """The tiny-omni server; its start and its stop bounded (hang guards)."""
    with trio.CancelScope(deadline=trio.current_time() + engine_seconds(START_S)) as guard:
        async with running_server(resolve_config_arg("tiny-omni"), sessions=SESSIONS) as served:
            guard.deadline = math.inf
            yield served
            guard.deadline = trio.current_time() + engine_seconds(STOP_S)
    if guard.cancelled_caught:
        raise EngineWaitTimeout("the tiny-omni server did not start or stop within its bound")


@pytest.fixture(scope="module")
def shared() -> Iterator[SharedServer]:
    with start_blocking_portal(backend="trio") as portal:
        with portal.wrap_async_context_manager(serving()) as (engine, base):
            yield SharedServer(portal, engine, base)


def connect(base: str) -> Any:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    return client.realtime.connect(model="tiny-omni", max_retries=0)


def pcm16(events: list[Any]) -> bytes:
    """The response's audio: its audio deltas' base64 PCM16, decoded and joined."""
    deltas = [e for e in events if e.type == "response.output_audio.delta"]
    chunks = [base64.b64decode(e.delta) for e in deltas]
    assert all(len(c) % 2 == 0 for c in chunks)  # whole 16-bit samples in every delta
    return b"".join(chunks)


def of_response(events: list[Any], response_id: str) -> list[Any]:
    """The events of ``events`` that belong to that response."""
    return [
        e
        for e in events
        if getattr(e, "response_id", None) == response_id
        or getattr(getattr(e, "response", None), "id", None) == response_id
    ]


async def test_a_text_turn_streams_text_and_audio_deltas_then_completes(
    shared: SharedServer,
) -> None:
    def converse(base: str) -> tuple[Any, list[Any]]:
        with connect(base) as conn:
            created = read_until(conn, "session.created")[-1]
            user_text(conn, PROMPTS[0])
            conn.response.create()
            return created, read_until(conn, "response.done")

    created, events = await shared.client(converse)
    assert created.session.audio.output.format.rate == 16_000  # the vocoder's rate
    started = next(e for e in events if e.type == "response.created")
    response_id = started.response.id
    done = events[-1]
    assert done.response.id == response_id and done.response.status == "completed"
    # the thinker's text and the vocoder's audio, each delta of this response
    text_deltas = [e for e in events if e.type == "response.output_text.delta"]
    audio_deltas = [e for e in events if e.type == "response.output_audio.delta"]
    assert text_deltas and audio_deltas
    assert {e.response_id for e in text_deltas + audio_deltas} == {response_id}
    assert texts(events)
    audio = pcm16(events)
    samples = array("h", audio)
    assert len(samples) > 0 and any(samples)  # noise from random weights, not silence
    assert seqs(events) == sorted(seqs(events))
    assert events.index(started) < events.index(text_deltas[0])
    await shared.settle()


async def test_a_barge_in_mid_response_cancels_it_and_the_next_turn_completes(
    shared: SharedServer,
) -> None:
    def converse(base: str) -> tuple[list[Any], list[Any], Any, list[Any]]:
        with connect(base) as conn:
            read_until(conn, "session.created")
            # the user's turn is open: the model answers it while more input may come
            user_text(conn, PROMPTS[0])
            streaming = read_until(conn, "response.output_text.delta")
            conn.response.cancel()
            cut = read_until(conn, "response.done")
            user_text(conn, PROMPTS[1])
            conn.response.create()
            # a barge-in fenced to the epoch before the cancel: refused, no effect
            conn.send_raw(json.dumps({"type": "barge_in", "epoch": 0, "turn_id": 0}))
            between = read_until(conn, "error")
            after = read_until(conn, "response.done")
            return streaming, cut, between.pop(), between + after

    streaming, cut, stale, after = await shared.client(converse)
    cancelled = next(e for e in streaming if e.type == "response.created").response
    assert cancelled.metadata == {"turn_id": 0, "epoch": 0}
    assert streaming[-1].response_id == cancelled.id  # it streamed when the cancel came
    assert cut[-1].response.id == cancelled.id
    assert cut[-1].response.status == "cancelled"
    assert cut[-1].response.status_details.reason == "client_cancelled"
    assert stale.error.code == "stale_fence"
    # nothing of the cancelled response after its end; the next turn is a new epoch's
    assert not of_response(after, cancelled.id)
    started = next(e for e in after if e.type == "response.created").response
    assert started.metadata == {"turn_id": 1, "epoch": 1}
    assert after[-1].response.id == started.id
    assert after[-1].response.status == "completed"
    assert texts(after) and pcm16(after)
    # the cancel reached vLLM: settle() checks that neither engine holds a request
    await shared.settle()


async def test_a_dropped_socket_resumes_and_gets_the_rest_of_the_response_replayed(
    shared: SharedServer,
) -> None:
    def first(base: str) -> tuple[Any, list[Any], list[Any]]:
        with connect(base) as conn:
            session = read_until(conn, "session.created")[-1].session
            user_text(conn, PROMPTS[1])
            conn.response.create()
            whole = read_until(conn, "response.done")  # the same turn, not interrupted
            user_text(conn, PROMPTS[1])
            conn.response.create()
            before = read_until(conn, "response.output_text.delta")
            return session, whole, before  # leaving the block closes the socket

    def second(base: str, session: Any, last: int) -> list[Any]:
        with connect(base) as conn:
            read_until(conn, "session.created")
            send_resume(conn, session.id, session.resume_token, last)
            return read_until(conn, "response.done")

    session, whole, before = await shared.client(first)
    last = before[-1].server_event_seq
    after = await shared.client(second, session, last)
    assert after[0].type == "session.resumed" and after[0].session["id"] == session.id
    replayed = after[1:]
    assert replayed and all(s > last for s in seqs(replayed))
    assert seqs(replayed) == sorted(seqs(replayed))
    response_id = before[-1].response_id
    assert of_response(replayed, response_id) == replayed
    assert replayed[-1].response.status == "completed"
    # the talker makes a fixed number of codes (ignore_eos), so the audio's length is the
    # same for every response: none of it lost, none of it twice
    assert len(pcm16(replayed)) == len(pcm16(whole)) > 0
    await shared.settle()
