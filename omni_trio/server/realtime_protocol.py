"""The Realtime WebSocket's protocol, as pure functions: client events -> engine calls, session
events -> server events, and the output buffer's bound.

The subset of OpenAI's Realtime dialect that the ``openai`` package's realtime client drives:

- client: ``session.update``, ``input_audio_buffer.append`` / ``commit`` / ``clear``,
  ``conversation.item.create`` (a user message's ``input_text`` parts), ``response.create``,
  ``response.cancel``; the session extras ``session.resume``, ``session.event_ack``,
  ``barge_in``, ``heartbeat``, ``session.close``;
- server: ``session.created`` / ``updated`` / ``resumed`` / ``closed``,
  ``input_audio_buffer.committed`` / ``cleared``, ``conversation.item.created``,
  ``response.created``, ``response.output_text.delta``, ``response.output_audio.delta``,
  ``response.done``, ``heartbeat``, and ``error`` in OpenAI's shape
  (``{"type": "error", "error": {"type", "code", "message", "param", "event_id"}}``).

``session.update`` acts on ``output_modalities``, ``max_output_tokens`` and ``temperature``
(the text stage's sampling) and ``audio.output.voice`` (the talker stages' speaker), each for
the turns that start after it; its other keys (instructions, tools, turn detection) are not
acted on.

``server_event_seq`` is on every server event: the session journal's ``seq`` of the event it
was made from (one journal event may make several server events), else the last journal seq
the connection sent. A client resumes with the last one it received and gets what follows.

:mod:`omni_trio.server.realtime` does the I/O.
"""

from __future__ import annotations

import base64
import binascii
import json
import sys
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..audio import pcm16_bytes, to_float_list
from ..engine.live_events import (
    ResponseDelta,
    ResponseDone,
    ResponseStarted,
    SessionClosed,
    SessionEvent,
)

__all__ = [
    "Ack",
    "AppendAudio",
    "AppendText",
    "BargeIn",
    "ClearInput",
    "Close",
    "Command",
    "Commit",
    "Heartbeat",
    "ProtocolError",
    "Resume",
    "Update",
    "error_event",
    "over_output_bounds",
    "parse_client_event",
    "server_events",
]


class ProtocolError(Exception):
    """A client event the protocol cannot take: ``code`` and ``param`` go to the ``error``
    event."""

    def __init__(self, message: str, *, code: str = "invalid_event", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param
        self.event_id: str | None = None  # the client event's, once known


# -- client events -> commands ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Update:
    """``session.update``: the settings later turns use (None: unchanged).
    ``max_output_tokens`` 0 stands for ``"inf"`` (no bound but the model's)."""

    output_modalities: tuple[str, ...] | None
    session: Mapping[str, Any] = field(default_factory=dict)  # echoed in session.updated
    max_output_tokens: int | None = None
    temperature: float | None = None
    voice: str | None = None


@dataclass(frozen=True, slots=True)
class AppendAudio:
    """``input_audio_buffer.append``: PCM16 samples, as floats in [-1, 1]."""

    samples: list[float]
    nbytes: int


@dataclass(frozen=True, slots=True)
class AppendText:
    """``conversation.item.create`` of a user message: its text."""

    text: str
    item_id: str


@dataclass(frozen=True, slots=True)
class Commit:
    """``input_audio_buffer.commit`` or ``response.create``: end the user's turn."""

    reply: Literal["input_audio_buffer.committed", "response.create"]


@dataclass(frozen=True, slots=True)
class ClearInput:
    """``input_audio_buffer.clear``."""


@dataclass(frozen=True, slots=True)
class BargeIn:
    """``response.cancel`` or ``barge_in``; ``fence`` is ``(epoch, turn_id)`` when given."""

    fence: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class Resume:
    """``session.resume``."""

    session_id: str
    resume_token: str
    last_seq: int


@dataclass(frozen=True, slots=True)
class Ack:
    """``session.event_ack``: the client processed every server event up to ``seq``."""

    seq: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """``heartbeat``: the client is alive."""


@dataclass(frozen=True, slots=True)
class Close:
    """``session.close``: end the session now (a closed socket only detaches it)."""


Command = (
    Update
    | AppendAudio
    | AppendText
    | Commit
    | ClearInput
    | BargeIn
    | Resume
    | Ack
    | Heartbeat
    | Close
)


def _field(event: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    value = event.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise ProtocolError(
            f"{where}: {name!r} must be a {kind.__name__}, not {value!r}", param=name
        )
    return value


def decode_pcm16(audio: str) -> list[float]:
    """Base64 little-endian PCM16 -> float samples. Pure. Raises ProtocolError."""
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError(f"audio is not base64: {exc}", param="audio") from exc
    if len(raw) % 2:
        raise ProtocolError(
            f"audio must be 16-bit PCM (an even number of bytes), got {len(raw)} bytes",
            param="audio",
        )
    pcm = array("h")
    pcm.frombytes(raw)
    if sys.byteorder != "little":
        pcm.byteswap()
    return [x / 32768.0 for x in pcm]


def _message_text(item: Any) -> str:
    where = "conversation.item.create"
    if not isinstance(item, Mapping):
        raise ProtocolError(f"{where}: 'item' must be an object", param="item")
    if item.get("type", "message") != "message" or item.get("role", "user") != "user":
        raise ProtocolError(
            f"{where}: only user messages are supported, not type={item.get('type')!r} "
            f"role={item.get('role')!r}",
            code="unsupported",
            param="item",
        )
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise ProtocolError(f"{where}: 'item.content' must be a non-empty list", param="item")
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") not in ("input_text", "text"):
            raise ProtocolError(
                f"{where}: only input_text content parts are supported, not {part!r}",
                code="unsupported",
                param="item.content",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ProtocolError(f"{where}: a part's 'text' must be a string", param="item")
        texts.append(text)
    return "".join(texts)


def parse_client_event(raw: str | bytes) -> tuple[str | None, Command]:
    """One client message -> ``(its event_id, the command)``. Pure. Raises
    :class:`ProtocolError` naming what is wrong (not JSON, no ``type``, an unknown type, a
    missing or mistyped field)."""
    try:
        event = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"a client event must be a JSON object: {exc}") from None
    if not isinstance(event, dict):
        raise ProtocolError("a client event must be a JSON object")
    event_id = event.get("event_id")
    event_id = event_id if isinstance(event_id, str) else None
    kind = event.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("a client event needs a string 'type'", param="type")
    try:
        return event_id, _command(kind, event)
    except ProtocolError as exc:
        exc.event_id = event_id
        raise


def _max_output_tokens(value: object) -> int | None:
    if value is None:
        return None
    if value == "inf":
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ProtocolError(
        f"session.update: max_output_tokens must be a positive integer or 'inf', not {value!r}",
        param="session.max_output_tokens",
    )


def _temperature(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    raise ProtocolError(
        f"session.update: temperature must be a number >= 0, not {value!r}",
        param="session.temperature",
    )


def _voice(session: Mapping[str, Any]) -> str | None:
    # the GA shape (audio.output.voice) or the beta one (voice)
    audio = session.get("audio")
    output = audio.get("output") if isinstance(audio, Mapping) else None
    voice = output.get("voice") if isinstance(output, Mapping) else None
    param = "session.audio.output.voice"
    if voice is None:
        voice, param = session.get("voice"), "session.voice"
    if voice is None or isinstance(voice, str) and voice:
        return voice
    raise ProtocolError(
        f"session.update: the voice must be a non-empty string, not {voice!r}", param=param
    )


def _command(kind: str, event: dict[str, Any]) -> Command:
    if kind == "session.update":
        session = event.get("session", {})
        if not isinstance(session, dict):
            raise ProtocolError("session.update: 'session' must be an object", param="session")
        modalities = session.get("output_modalities", session.get("modalities"))
        if modalities is not None and (
            not isinstance(modalities, list)
            or not modalities
            or not all(m in ("text", "audio") for m in modalities)
        ):
            raise ProtocolError(
                "session.update: output_modalities must be a non-empty list of 'text' and "
                f"'audio', not {modalities!r}",
                param="session.output_modalities",
            )
        return Update(
            None if modalities is None else tuple(modalities),
            session,
            max_output_tokens=_max_output_tokens(session.get("max_output_tokens")),
            temperature=_temperature(session.get("temperature")),
            voice=_voice(session),
        )
    if kind == "input_audio_buffer.append":
        audio = _field(event, "audio", str, kind)
        samples = decode_pcm16(audio)
        return AppendAudio(samples, 2 * len(samples))
    if kind == "input_audio_buffer.commit":
        return Commit("input_audio_buffer.committed")
    if kind == "input_audio_buffer.clear":
        return ClearInput()
    if kind == "conversation.item.create":
        item = event.get("item")
        item_id = item.get("id") if isinstance(item, Mapping) else None
        return AppendText(_message_text(item), item_id if isinstance(item_id, str) else "")
    if kind == "response.create":
        return Commit("response.create")
    if kind in ("response.cancel", "barge_in"):
        fence = None
        if "epoch" in event or "turn_id" in event:
            fence = (_field(event, "epoch", int, kind), _field(event, "turn_id", int, kind))
        return BargeIn(fence)
    if kind == "session.resume":
        return Resume(
            _field(event, "session_id", str, kind),
            _field(event, "resume_token", str, kind),
            _field(event, "last_received_server_event_seq", int, kind),
        )
    if kind == "session.event_ack":
        return Ack(_field(event, "server_event_seq", int, kind))
    if kind == "heartbeat":
        return Heartbeat()
    if kind == "session.close":
        return Close()
    raise ProtocolError(f"unknown client event type {kind!r}", code="unknown_event", param="type")


# -- session events -> server events ---------------------------------------------------------


def error_event(
    message: str,
    *,
    code: str | None,
    type_: str = "invalid_request_error",
    param: str | None = None,
    event_id: str | None = None,
) -> dict[str, Any]:
    """An ``error`` server event in OpenAI's shape (``event_id`` names the client event it
    answers). Pure."""
    return {
        "type": "error",
        "error": {
            "type": type_,
            "code": code,
            "message": message,
            "param": param,
            "event_id": event_id,
        },
    }


def _response(response_id: str, status: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "realtime.response",
        "status": status,
        "output": [],
        **extra,
    }


def server_events(
    event: SessionEvent, *, text_stage: str, audio_stage: str | None
) -> list[dict[str, Any]]:
    """The server events of one session event (none for a delta of a stage the client does
    not hear), each with ``server_event_seq``. Pure."""
    out: list[dict[str, Any]]
    if isinstance(event, ResponseStarted):
        response = _response(event.response_id, "in_progress")
        response["metadata"] = {"turn_id": event.turn_id, "epoch": event.epoch}
        out = [{"type": "response.created", "response": response}]
    elif isinstance(event, ResponseDelta):
        part = {
            "response_id": event.response_id,
            "item_id": f"item-{event.response_id}",
            "output_index": 0,
            "content_index": 0,
        }
        out = []
        if event.stage_id == text_stage and event.text:
            out.append({"type": "response.output_text.delta", **part, "delta": event.text})
        if event.stage_id == audio_stage and event.data is not None:
            pcm = pcm16_bytes(to_float_list(event.data))
            if pcm:
                delta = base64.b64encode(pcm).decode("ascii")
                out.append({"type": "response.output_audio.delta", **part, "delta": delta})
    elif isinstance(event, ResponseDone):
        details: dict[str, Any] | None = None
        if event.status == "cancelled":
            details = {"type": "cancelled", "reason": "client_cancelled"}
        elif event.status == "failed":
            details = {"type": "failed", "error": _error_detail(event.error)}
        response = _response(event.response_id, event.status, status_details=details)
        out = [{"type": "response.done", "response": response}]
    elif isinstance(event, SessionClosed):
        closed: dict[str, Any] = {"type": "session.closed", "reason": event.reason}
        if event.error is not None:
            closed["error"] = _error_detail(event.error)
        out = [closed]
    else:  # pragma: no cover - every session event is handled above
        raise TypeError(f"not a session event: {event!r}")
    for e in out:
        e["server_event_seq"] = event.seq
    return out


def _error_detail(error: BaseException | None) -> dict[str, Any]:
    if error is None:
        return {"type": "server_error", "code": None, "message": "failed"}
    return {"type": "server_error", "code": type(error).__name__, "message": str(error)}


def over_output_bounds(*, events: int, nbytes: int, max_events: int, max_bytes: int) -> str | None:
    """Why a connection's unsent output is over its bounds (a client that does not read),
    or None. Pure."""
    if events > max_events:
        return f"{events} server events wait unsent, over the bound of {max_events}"
    if nbytes > max_bytes:
        return f"{nbytes} bytes of server events wait unsent, over the bound of {max_bytes}"
    return None
