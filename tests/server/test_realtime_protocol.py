"""The Realtime protocol's pure mapping: client events -> commands, session events -> server
events, the output bound."""

from __future__ import annotations

import base64
import json

import pytest

from omni_trio import ResponseDelta, ResponseDone, ResponseStarted, SessionClosed, StageError
from omni_trio.audio import pcm16_bytes
from omni_trio.server.realtime_protocol import (
    Ack,
    AppendAudio,
    AppendText,
    BargeIn,
    ClearInput,
    Close,
    Commit,
    Heartbeat,
    ProtocolError,
    Resume,
    Update,
    error_event,
    over_output_bounds,
    parse_client_event,
    server_events,
)


def parse(**event):
    return parse_client_event(json.dumps(event))


def test_each_client_event_maps_to_its_command():
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    pcm = base64.b64encode(pcm16_bytes([0.5, -0.5])).decode()
    assert parse(type="session.update", session={"output_modalities": ["text"]})[1] == Update(
        ("text",), {"output_modalities": ["text"]}
    )
    ga = {"max_output_tokens": 7, "temperature": 1, "audio": {"output": {"voice": "Ethan"}}}
    assert parse(type="session.update", session=ga)[1] == Update(
        None, ga, max_output_tokens=7, temperature=1.0, voice="Ethan"
    )
    beta = {"max_output_tokens": "inf", "voice": "Chelsie"}
    assert parse(type="session.update", session=beta)[1] == Update(
        None, beta, max_output_tokens=0, voice="Chelsie"
    )
    assert parse(type="conversation.item.create", item=item, event_id="e") == (
        "e",
        AppendText("hi", ""),
    )
    audio = parse(type="input_audio_buffer.append", audio=pcm)[1]
    assert isinstance(audio, AppendAudio) and audio.nbytes == 4
    assert audio.samples == pytest.approx([0.5, -0.5], abs=1e-4)
    assert parse(type="input_audio_buffer.commit")[1] == Commit("input_audio_buffer.committed")
    assert parse(type="response.create")[1] == Commit("response.create")
    assert parse(type="input_audio_buffer.clear")[1] == ClearInput()
    assert parse(type="response.cancel")[1] == BargeIn(None)
    assert parse(type="barge_in", epoch=2, turn_id=3)[1] == BargeIn((2, 3))
    resume = parse(
        type="session.resume", session_id="s", resume_token="t", last_received_server_event_seq=7
    )
    assert resume[1] == Resume("s", "t", 7)
    assert parse(type="session.event_ack", server_event_seq=4)[1] == Ack(4)
    assert parse(type="heartbeat")[1] == Heartbeat()
    assert parse(type="session.close")[1] == Close()


@pytest.mark.parametrize(
    ("raw", "code", "words"),
    [
        ("{", "invalid_event", "JSON object"),
        ("[1]", "invalid_event", "JSON object"),
        ('{"type": 3}', "invalid_event", "string 'type'"),
        ('{"type": "nope"}', "unknown_event", "'nope'"),
        ('{"type": "input_audio_buffer.append", "audio": "@@"}', "invalid_event", "base64"),
        ('{"type": "input_audio_buffer.append", "audio": "AAAA"}', "invalid_event", "even"),
        ('{"type": "session.event_ack", "server_event_seq": true}', "invalid_event", "int"),
        ('{"type": "barge_in", "epoch": 1}', "invalid_event", "'turn_id'"),
        (
            '{"type": "session.update", "session": {"output_modalities": ["x"]}}',
            "invalid_event",
            "'text' and 'audio'",
        ),
        (
            '{"type": "session.update", "session": {"max_output_tokens": 0}}',
            "invalid_event",
            "positive integer or 'inf'",
        ),
        (
            '{"type": "session.update", "session": {"temperature": -1}}',
            "invalid_event",
            "number >= 0",
        ),
        (
            '{"type": "session.update", "session": {"audio": {"output": {"voice": 3}}}}',
            "invalid_event",
            "non-empty string",
        ),
        (
            '{"type": "conversation.item.create", "item": {"role": "assistant", "content": []}}',
            "unsupported",
            "user messages",
        ),
        (
            '{"type": "conversation.item.create", "item": {"content": [{"type": "input_audio"}]}}',
            "unsupported",
            "input_text",
        ),
    ],
)
def test_bad_client_events_raise_a_protocol_error_naming_what_is_wrong(raw, code, words):
    with pytest.raises(ProtocolError, match=words) as info:
        parse_client_event(raw)
    assert info.value.code == code


def test_a_protocol_error_keeps_the_client_event_id():
    with pytest.raises(ProtocolError) as info:
        parse(type="nope", event_id="e9")
    assert info.value.event_id == "e9"


def test_session_events_map_to_server_events_with_their_seq():
    started = server_events(
        ResponseStarted(seq=1, response_id="r", turn_id=0, epoch=0),
        text_stage="t",
        audio_stage="v",
    )
    assert [(e["type"], e["server_event_seq"]) for e in started] == [("response.created", 1)]
    assert started[0]["response"]["status"] == "in_progress"
    text = server_events(
        ResponseDelta(seq=2, response_id="r", stage_id="t", text="hi", token_ids=(1,)),
        text_stage="t",
        audio_stage="v",
    )
    assert [(e["type"], e["delta"]) for e in text] == [("response.output_text.delta", "hi")]
    audio = server_events(
        ResponseDelta(seq=3, response_id="r", stage_id="v", text="", token_ids=(), data=[0.5]),
        text_stage="t",
        audio_stage="v",
    )
    assert audio[0]["type"] == "response.output_audio.delta"
    assert base64.b64decode(audio[0]["delta"]) == pcm16_bytes([0.5])
    # a stage the client does not hear makes no event
    other = ResponseDelta(seq=4, response_id="r", stage_id="x", text="z", token_ids=())
    assert server_events(other, text_stage="t", audio_stage="v") == []
    cancelled = server_events(
        ResponseDone(seq=5, response_id="r", status="cancelled"), text_stage="t", audio_stage=None
    )
    assert cancelled[0]["response"]["status"] == "cancelled"
    failed = server_events(
        ResponseDone(seq=6, response_id="r", status="failed", error=StageError("boom")),
        text_stage="t",
        audio_stage=None,
    )[0]
    assert failed["response"]["status_details"]["error"]["message"] == "boom"
    closed = server_events(
        SessionClosed(seq=7, reason="idle_timeout"), text_stage="t", audio_stage=None
    )
    assert closed == [{"type": "session.closed", "reason": "idle_timeout", "server_event_seq": 7}]


def test_error_event_has_openais_shape():
    assert error_event("bad", code="c", param="p", event_id="e") == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "code": "c",
            "message": "bad",
            "param": "p",
            "event_id": "e",
        },
    }


def test_output_bounds():
    assert over_output_bounds(events=4, nbytes=10, max_events=4, max_bytes=10) is None
    assert "5 server events" in over_output_bounds(events=5, nbytes=0, max_events=4, max_bytes=9)
    assert "11 bytes" in over_output_bounds(events=1, nbytes=11, max_events=4, max_bytes=10)
