"""A live session over ``WS /v1/realtime`` with the stock ``openai`` realtime client.

Start the server in another terminal (the first start builds the tiny models, then each
vLLM engine takes about 20 s to start; wait for ``GET /health`` to say ``ok``)::

    omni-trio serve tiny-omni

then run ``python examples/realtime_client.py [URL]`` (``URL`` defaults to
``$OMNI_TRIO_URL``, else http://127.0.0.1:8000). tiny-omni's models have random weights: the
text is gibberish and the audio noise, but every stage is a real engine.

It shows three things: a text turn answered with text and audio (base64 PCM16 deltas), a
barge-in that cancels a response while it streams, and a reconnect that resumes the session
and gets the events it missed replayed. The ``openai`` client runs on asyncio.
"""

import asyncio
import base64
import json
import os
import sys
from typing import Any

from openai import AsyncOpenAI

URL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OMNI_TRIO_URL", "http://127.0.0.1:8000")
WAIT_S = 120  # for each server answer: a bound on a server that hangs, not a speed goal


def user_message(text: str) -> Any:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def read_until(conn: Any, kind: str) -> list[Any]:
    """The server events up to and including the first one of type ``kind``."""
    events = []
    async with asyncio.timeout(WAIT_S):
        async for event in conn:
            if event.type == "error":
                raise RuntimeError(f"the server refused an event: {event.error.message}")
            events.append(event)
            if event.type == kind:
                return events
    raise RuntimeError(f"the server closed the socket before {kind}")


def of_type(events: list[Any], kind: str) -> list[Any]:
    return [e for e in events if e.type == kind]


def audio_of(events: list[Any]) -> bytes:
    """A response's audio: its deltas' base64 PCM16 (little-endian 16-bit samples)."""
    return b"".join(
        base64.b64decode(e.delta) for e in of_type(events, "response.output_audio.delta")
    )


async def main() -> None:
    client = AsyncOpenAI(base_url=f"{URL}/v1", api_key="unused")  # the server needs no key
    async with client.realtime.connect(model="tiny-omni", max_retries=0) as conn:
        session = (await read_until(conn, "session.created"))[-1].session
        print(f"session: {session.id}, audio out PCM16 at {session.audio.output.format.rate} Hz")

        # 1. text in, text and audio out
        await conn.conversation.item.create(item=user_message("Tell me about the river."))
        await conn.response.create()  # the user's turn ends; the response streams on
        events = await read_until(conn, "response.done")
        text = "".join(e.delta for e in of_type(events, "response.output_text.delta"))
        audio = audio_of(events)
        print(f"turn 1 text: {text!r}")
        print(f"turn 1 audio: {len(audio)} bytes ({len(audio) // 2} samples)")
        print(f"turn 1 response: {events[-1].response.status}")

        # 2. barge-in: the model answers while the user's turn is still open (full duplex),
        # and the user cuts it off: the response ends cancelled at once, in every stage
        await conn.conversation.item.create(item=user_message("And what about the moon?"))
        await read_until(conn, "response.output_text.delta")  # it streams...
        await conn.response.cancel()  # ...or send the extra {"type": "barge_in"}
        done = (await read_until(conn, "response.done"))[-1]
        print(f"turn 2 barge-in: response {done.response.status}")

        # 3. the socket drops while a response streams...
        await conn.conversation.item.create(item=user_message("Sing me a song of the sea."))
        await conn.response.create()
        last_seq = (await read_until(conn, "response.output_text.delta"))[-1].server_event_seq
    print(f"turn 3 socket closed: after server event {last_seq}")

    # ...and the client comes back within the detach grace (30 s by default) to resume
    resume = {
        "type": "session.resume",
        "session_id": session.id,
        "resume_token": session.resume_token,  # an extra of the session object
        "last_received_server_event_seq": last_seq,  # an extra of every server event
    }
    async with client.realtime.connect(model="tiny-omni", max_retries=0) as conn:
        await read_until(conn, "session.created")  # a fresh session: the resume swaps it
        await conn.send_raw(json.dumps(resume))
        resumed, *replayed = await read_until(conn, "response.done")
        seqs = [e.server_event_seq for e in replayed]
        print(
            f"turn 3 resumed: session {resumed.session['id']}, {len(replayed)} events "
            f"replayed (server events {seqs[0]} to {seqs[-1]})"
        )
        audio = audio_of(replayed)
        print(f"turn 3 audio: {len(audio)} bytes ({len(audio) // 2} samples)")
        print(f"turn 3 response: {replayed[-1].response.status}")

        # done: end the session now (a closed socket would only detach it for the grace)
        await conn.send_raw(json.dumps({"type": "session.close"}))
        closed = (await read_until(conn, "session.closed"))[-1]
        print(f"session closed: {closed.reason}")  # an extra event type: pydantic keeps it


if __name__ == "__main__":
    asyncio.run(main())
