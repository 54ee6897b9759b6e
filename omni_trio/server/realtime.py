"""``WS /v1/realtime``: a live session (:mod:`omni_trio.engine.live_session`) over a WebSocket,
in the OpenAI Realtime dialect (:mod:`.realtime_protocol` holds the mapping).

One connection, one nursery: a reader (client events -> engine calls, in order), a pump (the
session's events -> server events, into the connection's output buffer) and a writer (the
buffer -> the socket). A connection opens a new session and says ``session.created`` (its
``resume_token`` is this connection's secret); ``session.resume`` swaps that fresh session for
a detached one and replays what the client missed. A closed socket, clean or not, detaches
the session (it lives ``detach_grace_s`` for a resume) and ends only this connection. A client
that does not read fills the output buffer: over ``max_output_events`` or
``max_output_bytes`` the session is told (an ``error``, ``slow_client``), closed, and the
socket closed (1008). A malformed or unknown event gets an ``error`` and the socket stays
open. A fourth task sends a ``heartbeat`` after ``heartbeat_s`` without a server event.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections import OrderedDict, deque
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
from hypercorn.utils import UnexpectedMessageError
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..audio import sample_rate_of
from ..config.stageinfo import audio_stage, text_stage
from ..engine.live_rules import remember
from ..errors import ConfigError, OmniTrioError, SessionResumeError
from .chat_model import ChatModel
from .realtime_protocol import (
    Ack,
    AppendAudio,
    AppendText,
    BargeIn,
    ClearInput,
    Close,
    Command,
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
from .tracing import request_trace_headers

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..engine.live_session import Session

__all__ = ["RealtimeEndpoint", "RealtimeLimits"]

logger = logging.getLogger(__name__)

#: what a send to a socket that went away raises (the connection then ends)
_GONE = (WebSocketDisconnect, UnexpectedMessageError, OSError, trio.BrokenResourceError)


@dataclass(frozen=True, slots=True)
class RealtimeLimits:
    """Bounds of one connection: its unsent server events (a client that stops reading), and
    ``heartbeat_s``: after that long without a server event the server sends a
    ``heartbeat`` (a socket that went away is then found out by its failed send; None: no
    heartbeat). The server's heartbeat does not renew the session's idle lease: the
    client's events do."""

    max_output_events: int = 4096
    max_output_bytes: int = 16 * 1024 * 1024
    heartbeat_s: float | None = 15.0

    def __post_init__(self) -> None:
        for name in ("max_output_events", "max_output_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"RealtimeLimits.{name} must be >= 1, not {getattr(self, name)}")
        if self.heartbeat_s is not None and not self.heartbeat_s > 0:
            raise ConfigError(
                f"RealtimeLimits.heartbeat_s must be > 0 or None, not {self.heartbeat_s}"
            )


def _max_output_tokens(sampling: dict[str, object]) -> object:
    return sampling.get("max_tokens", "inf")


def _error_code(exc: OmniTrioError) -> str:
    name = type(exc).__name__.removesuffix("Error")
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


class RealtimeEndpoint:
    """The ASGI websocket endpoint of one engine. Keeps which connection holds which session
    and the resume secrets of detached ones (at most ``sessions.max_sessions`` kept)."""

    def __init__(
        self,
        engine: Engine,
        model: str,
        limits: RealtimeLimits | None = None,
        chat_model: ChatModel | None = None,
    ) -> None:
        self.engine = engine
        self.model = model
        self.limits = limits or RealtimeLimits()
        self.text_stage = text_stage(engine.config)
        self.chat_model = chat_model or ChatModel(engine, self.text_stage)
        self.audio_stage = audio_stage(engine.config)
        options = engine.config.stage(self.audio_stage).options if self.audio_stage else None
        self.sample_rate = sample_rate_of(None, options)
        self.attached: dict[str, _Connection] = {}
        # session id -> (the client's secret, the engine's resume token)
        self.detached: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self.connections = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        websocket = WebSocket(scope, receive, send)
        await websocket.accept()
        self.connections += 1
        try:
            await _Connection(self, websocket, request_trace_headers()).run()
        finally:
            self.connections -= 1

    def __repr__(self) -> str:
        return (
            f"<RealtimeEndpoint connections={self.connections} attached={len(self.attached)} "
            f"detached={len(self.detached)}>"
        )


class _Connection:
    def __init__(
        self,
        endpoint: RealtimeEndpoint,
        websocket: WebSocket,
        trace_headers: Mapping[str, str] | None,
    ) -> None:
        self.endpoint = endpoint
        #: the upgrade request's trace context: the turns of its session continue it
        self.trace_headers = trace_headers
        self.engine = endpoint.engine
        self.ws = websocket
        self.session: Session | None = None
        self.secret = ""
        self.stack = AsyncExitStack()  # the session's block
        self.pump_scope = trio.CancelScope()
        self.nursery: trio.Nursery | None = None
        self.out: deque[str] = deque()
        self.out_bytes = 0
        self.out_ready = trio.Event()
        self.last_push = trio.current_time()
        self.sent_seq = 0  # the last journal seq put out
        self.n_events = 0
        self.slow: str | None = None  # why the output buffer overflowed
        self.taken_over = False
        self.over = False  # the session closed: end once its last events are sent
        self.released = trio.Event()
        self.modalities: list[str] | None = None
        # session.update's sampling: the text stage's, and each talker stage's voice
        self.text_sampling: dict[str, object] = {}
        self.voices: dict[str, dict[str, object]] = {}
        self.voice: str | None = None

    # -- output ------------------------------------------------------------------------------
    def push(self, event: dict[str, Any]) -> None:
        """Queue one server event (synchronous); over the bounds, the session is told and
        this connection ends."""
        if self.slow is not None:
            return
        self.n_events += 1
        event.setdefault("server_event_seq", self.sent_seq)
        event["event_id"] = f"event_{self.n_events}"
        data = json.dumps(event)
        self.out.append(data)
        self.out_bytes += len(data)
        self.out_ready.set()
        self.last_push = trio.current_time()
        limits = self.endpoint.limits
        reason = over_output_bounds(
            events=len(self.out),
            nbytes=self.out_bytes,
            max_events=limits.max_output_events,
            max_bytes=limits.max_output_bytes,
        )
        if reason is not None:
            self.slow = f"the client does not read: {reason}; the session is closed"
            self.out.append(json.dumps(error_event(self.slow, code="slow_client")))
            # the session closes now: the writer may be stuck in the server's send (a
            # shielded write to a socket nobody reads) until the client reads or goes away
            if self.session is not None:
                self.session.close_nowait("slow_client")
            if self.nursery is not None:
                self.nursery.cancel_scope.cancel()

    def push_error(self, message: str, code: str, event_id: str | None, **kw: Any) -> None:
        self.push(error_event(message, code=code, event_id=event_id, **kw))

    async def _writer(self) -> None:
        while True:
            while self.out:
                data = self.out.popleft()
                self.out_bytes -= len(data)
                await self.ws.send_text(data)
            if self.over:
                assert self.nursery is not None
                self.nursery.cancel_scope.cancel()
                return
            self.out_ready = trio.Event()
            await self.out_ready.wait()

    async def _heartbeat(self, interval: float) -> None:
        while True:
            await trio.sleep_until(self.last_push + interval)
            if trio.current_time() >= self.last_push + interval:
                self.push({"type": "heartbeat"})

    async def _pump(self, session: Session, *, task_status: trio.TaskStatus[None]) -> None:
        with self.pump_scope:
            task_status.started()
            ep = self.endpoint
            async for event in session.events():
                for server_event in server_events(
                    event, text_stage=ep.text_stage, audio_stage=ep.audio_stage
                ):
                    self.push(server_event)
                self.sent_seq = event.seq
            if not session.attached and session.statistics().state != "open":
                # SessionClosed is queued: the conversation is over once the writer sent it
                self.over = True
                self.out_ready.set()

    async def _attach(self, session: Session, kind: str) -> None:
        assert self.nursery is not None
        self.session = session
        self.secret = secrets.token_urlsafe(24)
        self.endpoint.attached[session.session_id] = self
        self.pump_scope = trio.CancelScope()
        self.push({"type": kind, "session": self._session_body()})  # before any replay
        await self.nursery.start(self._pump, session)

    def _session_body(self) -> dict[str, Any]:
        assert self.session is not None
        s, ep = self.session, self.endpoint
        audio_format = {"type": "audio/pcm", "rate": ep.sample_rate}
        return {
            "id": s.session_id,
            "object": "realtime.session",
            "type": "realtime",
            "model": ep.model,
            "output_modalities": self.modalities,
            "max_output_tokens": _max_output_tokens(self.text_sampling),
            "voice": self.voice,
            "audio": {"input": {"format": audio_format}, "output": {"format": audio_format}},
            "resume_token": self.secret,
            "epoch": s.epoch,
            "turn_id": s.turn_id,
        }

    # -- the connection ---------------------------------------------------------------------
    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                nursery.start_soon(self._writer_guarded)
                try:
                    session = await self.stack.enter_async_context(
                        self.engine.open_session(trace_headers=self.trace_headers)
                    )
                except OmniTrioError as exc:
                    self.push_error(str(exc), _error_code(exc), None, type_="server_error")
                    await self._drain_and_close(1013)
                    return
                await self._attach(session, "session.created")
                if self.endpoint.limits.heartbeat_s is not None:
                    nursery.start_soon(self._heartbeat, self.endpoint.limits.heartbeat_s)
                await self._read()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._end()

    async def _writer_guarded(self) -> None:
        try:
            await self._writer()
        except _GONE as exc:
            logger.debug("realtime: the socket went away while sending: %r", exc)
            assert self.nursery is not None
            self.nursery.cancel_scope.cancel()

    async def _drain_and_close(self, code: int) -> None:
        while self.out:
            await self.ws.send_text(self.out.popleft())
        await self.ws.close(code)

    async def _end(self) -> None:
        session, ep = self.session, self.endpoint
        try:
            if session is not None and session.attached:
                if self.slow is None:
                    token = await session.detach()
                    remember(
                        ep.detached,
                        session.session_id,
                        (self.secret, token),
                        max(1, self.engine.config.sessions.max_sessions),
                    )
                else:
                    logger.warning("realtime session %s: %s", session.session_id, self.slow)
            await self.stack.aclose()  # closes the session unless it was detached
        finally:
            if session is not None and ep.attached.get(session.session_id) is self:
                del ep.attached[session.session_id]
            self.released.set()
            if self.slow is not None:
                await self._close_socket(1008, "slow client")
            elif session is not None and session.statistics().state == "closed":
                await self._close_socket(1000, "session closed")

    async def _close_socket(self, code: int, reason: str) -> None:
        # best effort: the client may be gone, or not reading (a full socket)
        with trio.move_on_after(1):
            try:
                await self.ws.close(code, reason)
            except (*_GONE, RuntimeError):
                pass

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            raw = message.get("text")
            if raw is None:
                raw = message.get("bytes") or b""
            try:
                event_id, command = parse_client_event(raw)
            except ProtocolError as exc:
                self.push_error(str(exc), exc.code, exc.event_id, param=exc.param)
                continue
            try:
                await self._apply(command, event_id)
            except ProtocolError as exc:
                self.push_error(str(exc), exc.code, event_id, param=exc.param)
            except OmniTrioError as exc:
                kind = "server_error" if getattr(exc, "retryable", False) else None
                self.push_error(
                    str(exc), _error_code(exc), event_id, type_=kind or "invalid_request_error"
                )

    async def _apply(self, command: Command, event_id: str | None) -> None:
        session = self.session
        assert session is not None
        if isinstance(command, AppendText):
            await session.append(command.text, operation_id=event_id)
            item = {
                "id": command.item_id or f"item-{session.session_id}-{session.turn_id}",
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": command.text}],
            }
            self.push({"type": "conversation.item.created", "item": item})
        elif isinstance(command, AppendAudio):
            rate = self.endpoint.sample_rate
            chunk = {"prompt": "", "multi_modal_data": {"audio": (command.samples, rate)}}
            await session.append(chunk, operation_id=event_id)
        elif isinstance(command, Commit):
            response_id = await session.commit()
            if command.reply == "input_audio_buffer.committed":
                self.push({"type": "input_audio_buffer.committed", "item_id": response_id})
        elif isinstance(command, BargeIn):
            await session.barge_in(fence=command.fence)
        elif isinstance(command, Update):
            await self._update(session, command)
            self.push({"type": "session.updated", "session": self._session_body()})
        elif isinstance(command, ClearInput):
            if session.statistics().pending_input_bytes:
                raise ProtocolError(
                    "input_audio_buffer.clear: this turn's input already streams to the model; "
                    "cancel it with response.cancel",
                    code="input_already_streamed",
                )
            session.touch()
            self.push({"type": "input_audio_buffer.cleared"})
        elif isinstance(command, Ack):
            session.ack(command.seq)
        elif isinstance(command, Heartbeat):
            session.touch()
            self.push({"type": "heartbeat"})
        elif isinstance(command, Close):
            # SessionClosed goes out through the pump, which then ends the connection
            await session.aclose()
        elif isinstance(command, Resume):
            await self._resume(command)
        else:  # pragma: no cover - parse_client_event makes only the commands above
            raise TypeError(f"not a command: {command!r}")

    async def _update(self, session: Session, command: Update) -> None:
        # everything is checked (the voice against the model's) before anything changes
        ep = self.endpoint
        text = dict(self.text_sampling)
        if command.max_output_tokens == 0:  # "inf": the stage's own bound
            text.pop("max_tokens", None)
        elif command.max_output_tokens is not None:
            text["max_tokens"] = command.max_output_tokens
        if command.temperature is not None:
            text["temperature"] = command.temperature
        voices = self.voices
        if command.voice is not None:
            voices = await ep.chat_model.voice_params(
                command.voice, param="session.audio.output.voice"
            )
            self.voice = command.voice
        settings: dict[str, object] = {}
        if command.output_modalities is not None:
            settings["output_modalities"] = list(command.output_modalities)
        if text != self.text_sampling or voices is not self.voices:
            settings["sampling_params"] = {ep.text_stage: text, **voices}
        session.update(**settings)
        self.text_sampling, self.voices = text, voices
        if command.output_modalities is not None:
            self.modalities = list(command.output_modalities)

    async def _resume(self, command: Resume) -> None:
        session, ep = self.session, self.endpoint
        assert session is not None
        sid = command.session_id
        if sid == session.session_id:
            raise ProtocolError("session.resume: this connection holds that session already")
        stats = session.statistics()
        if stats.responses_total or stats.pending_input_bytes:
            raise ProtocolError(
                "session.resume: only a connection's fresh session (no turn yet) can be "
                "swapped for a resumed one; resume on a new connection",
                code="session_in_use",
            )
        holder = ep.attached.get(sid)
        if (
            holder is not None
            and holder is not self
            and secrets.compare_digest(holder.secret, command.resume_token)
        ):
            # the client came back before its old socket was seen closed: take it over
            holder.taken_over = True
            if holder.nursery is not None:
                holder.nursery.cancel_scope.cancel()
            await holder.released.wait()
        kept = ep.detached.get(sid)
        if kept is None or not secrets.compare_digest(kept[0], command.resume_token):
            raise SessionResumeError(
                f"cannot resume session {sid!r}: no detached session with that id and "
                "resume_token (it expired, was resumed already, or the token is stale)"
            )
        stack = AsyncExitStack()
        try:
            new = await stack.enter_async_context(
                self.engine.resume_session(
                    sid, kept[1], last_seq=command.last_seq, trace_headers=self.trace_headers
                )
            )
        finally:
            del ep.detached[sid]  # used, or useless: the session is not open
        fresh, self.stack = self.stack, stack
        # the fresh session goes: its pump first, then the session
        self.pump_scope.cancel()
        if ep.attached.get(session.session_id) is self:
            del ep.attached[session.session_id]
        await fresh.aclose()
        self.sent_seq = command.last_seq
        await self._attach(new, "session.resumed")
