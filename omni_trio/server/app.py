"""The OpenAI-compatible HTTP app of one engine.

``create_app(engine)`` builds a Starlette app behind :class:`~.guard.RequestGuard` (pure
ASGI: ``BaseHTTPMiddleware`` would break disconnect-driven cancellation). Every error,
404 and 405 included, answers with the OpenAI error body. Handlers run their engine work
inside the response (:mod:`.responses`), so a client that disconnects cancels its request's
task, and with it the request in every stage. :mod:`.serve` runs the app.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/audio/speech``,
``POST /v1/images/generations`` (b64 PNGs), ``GET /v1/models``, ``GET /health``,
``GET /metrics``, ``WS /v1/realtime`` (live sessions, :mod:`.realtime`). A chat asking for
``"audio"`` in its ``modalities`` is answered by :mod:`.chat_audio`.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import TYPE_CHECKING, Any

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from ..audio import concat_audio, sample_rate_of, wav_bytes
from ..config.stageinfo import audio_stage, image_stage, text_stage
from ..engine.health import HealthReport, assess_health
from ..images import is_preview, output_images, png_bytes
from ..outputs import EngineStatistics
from .bodies import (
    chat_chunk,
    completion_chunk,
    error_body,
    model_card,
    now,
    openai_finish_reason,
    usage,
)
from .chat_audio import AudioChat, prompt_tokens_of
from .chat_model import ChatModel
from .guard import DEFAULT_MAX_BODY_BYTES, RequestGuard, request_id_of
from .lifecycle import ServerLifecycle, ServerPhase
from .metrics import CONTENT_TYPE, EngineMetrics
from .protocol import (
    ChatRequest,
    CompletionRequest,
    RequestValidationError,
    decode_json,
    parse_chat,
    parse_completion,
    parse_images,
    parse_speech,
)
from .realtime import RealtimeEndpoint, RealtimeLimits
from .responses import Computed, EngineJSONResponse, EventStreamResponse, error_for
from .tracing import TraceContext, request_trace_headers

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..engine.streams import RequestStream

__all__ = ["create_app", "health_body", "health_report", "json_response"]

logger = logging.getLogger(__name__)


def json_response(
    body: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    """A JSON response, ASCII-escaped (no string in it can fail to encode). Synchronous."""
    return Response(
        json.dumps(body), status_code=status, headers=headers, media_type="application/json"
    )


def health_body(report: HealthReport) -> dict[str, Any]:
    """The JSON of a health report: engine counters and, by stage id, the stage's ready
    (``live_replicas``) and member (``total_replicas``) replicas, its requests waiting and in
    flight, and per replica its state, requests in flight, failures, restarts and last
    error. Pure."""
    return {
        "requests_in_flight": report.requests_in_flight,
        "requests_waiting": report.requests_waiting,
        "paused": report.paused,
        "stages": {
            st.stage_id: {
                "live_replicas": st.live_replicas,
                "total_replicas": st.total_replicas,
                "requests_waiting": st.requests_waiting,
                "requests_in_flight": st.requests_in_flight,
                "replicas": [
                    {
                        "replica": r.replica,
                        "state": r.state,
                        "requests_in_flight": r.requests_in_flight,
                        "failures": r.failures,
                        "restarts": r.restarts,
                        "last_error": r.last_error,
                    }
                    for r in st.replicas
                ],
            }
            for st in report.stages
        },
    }


def health_report(
    health: HealthReport | EngineStatistics, phase: ServerPhase = ServerPhase.SERVING
) -> tuple[int, dict[str, Any]]:
    """``(200, ...)`` when the server serves, the engine is open and every stage has a ready
    replica (``status`` ``ok``, or ``degraded`` when some replica is not ready); else
    ``(503, ...)`` with ``status`` ``starting`` (the stages are starting), ``stopping``
    (shutdown), ``closed`` or ``unhealthy`` (``dead_stages`` and the message name every
    stage with no ready replica, and the message its replicas' states and last errors).
    Every body has ``status``, ``message`` and :func:`health_body`'s keys. Pure: takes the
    engine's :class:`~omni_trio.engine.health.HealthReport` (or the statistics it derives from) and
    the server's phase."""
    report = health if isinstance(health, HealthReport) else assess_health(health)
    body = health_body(report)
    if phase is ServerPhase.STARTING:
        message = "the pipeline's stages are starting; completions answer 503 until ready"
        return 503, {"status": "starting", "message": message, **body}
    if phase is not ServerPhase.SERVING:
        message = "the server is shutting down and takes no new requests"
        return 503, {"status": "stopping", "message": message, **body}
    if report.status == "unhealthy":
        dead = list(report.unhealthy_stages)
        return 503, {"status": "unhealthy", "message": report.message, "dead_stages": dead, **body}
    status = 200 if report.healthy else 503
    return status, {"status": report.status, "message": report.message, **body}


class _Handlers:
    """The endpoints of one engine (kept on an object so they share engine and metrics)."""

    def __init__(
        self, engine: Engine, metrics: EngineMetrics, model: str, lifecycle: ServerLifecycle
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model = model
        self.lifecycle = lifecycle
        self.text_stage = text_stage(engine.config)
        self.audio_stage = audio_stage(engine.config)
        self.image_stage = image_stage(engine.config)
        self.chat_model = ChatModel(engine, self.text_stage)
        self.audio_chat = AudioChat(
            engine, model, self.text_stage, self.audio_stage, self.chat_model
        )

    async def _text_stream(self, req: ChatRequest | CompletionRequest, rid: str) -> RequestStream:
        sampling = {self.text_stage: req.sampling}
        if isinstance(req, ChatRequest):
            prompt = await self.chat_model.prompt(req.messages, req.prompt)
            if req.modalities is not None:
                # the chat's modalities (text only here) pick the output stages
                return self.engine.generate(
                    prompt,
                    request_id=rid,
                    sampling_params=sampling,
                    trace_headers=request_trace_headers(),
                    output_modalities=req.modalities,
                )
            return self.engine.generate(
                prompt,
                request_id=rid,
                sampling_params=sampling,
                trace_headers=request_trace_headers(),
                final_stage_id=self.text_stage,
                output_stages=[self.text_stage],
            )
        return self.engine.generate(
            req.prompt,
            request_id=rid,
            sampling_params=sampling,
            trace_headers=request_trace_headers(),
            final_stage_id=self.text_stage,
            output_stages=[self.text_stage],
        )

    async def _guard(
        self, request: Request, parse: Callable[[Any, str], Any]
    ) -> Response | tuple[Any, str]:
        # the guard middleware read the body already (bounded) and gave the request an id:
        # random, so that two servers' logs never collide
        try:
            parsed = parse(decode_json(await request.body()), self.model)
        except RequestValidationError as exc:
            status, body = error_for(exc)
            return json_response(body, status)
        return parsed, request_id_of(request.scope)

    async def chat(self, request: Request) -> Any:
        got = await self._guard(request, parse_chat)
        if isinstance(got, Response):
            return got
        req, rid = got
        rid = f"chatcmpl-{rid}"
        if req.modalities is not None and "audio" in req.modalities:
            if req.stream:
                events = self.audio_chat.events(req, rid)
                return EventStreamResponse(events, lifecycle=self.lifecycle)
            return EngineJSONResponse(
                lambda: self.audio_chat.complete(req, rid), lifecycle=self.lifecycle
            )
        if req.stream:
            return EventStreamResponse(self._chat_events(req, rid), lifecycle=self.lifecycle)
        return EngineJSONResponse(
            lambda: self._complete(req, rid, chat=True), lifecycle=self.lifecycle
        )

    async def completions(self, request: Request) -> Any:
        got = await self._guard(request, parse_completion)
        if isinstance(got, Response):
            return got
        req, rid = got
        rid = f"cmpl-{rid}"
        if req.stream:
            return EventStreamResponse(self._completion_events(req, rid), lifecycle=self.lifecycle)
        return EngineJSONResponse(
            lambda: self._complete(req, rid, chat=False), lifecycle=self.lifecycle
        )

    async def _complete(
        self, req: ChatRequest | CompletionRequest, rid: str, *, chat: bool
    ) -> Computed:
        text, n_tokens, prompt_tokens, reason = [], 0, 0, None
        async with await self._text_stream(req, rid) as stream:
            async for out in stream:
                text.append(out.text)
                n_tokens += len(out.token_ids)
                prompt_tokens = prompt_tokens or prompt_tokens_of(out.metrics)
                if out.finished:
                    reason = out.finish_reason
        answer = "".join(text)
        finish = openai_finish_reason(reason)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": answer},
                "logprobs": None,
                "finish_reason": finish,
            }
            kind = "chat.completion"
        else:
            echo = isinstance(req, CompletionRequest) and req.echo
            prefix = req.prompt if echo and isinstance(req.prompt, str) else ""
            choice = {
                "index": 0,
                "text": prefix + answer,
                "logprobs": None,
                "finish_reason": finish,
            }
            kind = "text_completion"
        body = {
            "id": rid,
            "object": kind,
            "created": now(),
            "model": self.model,
            "choices": [choice],
            "usage": usage(prompt_tokens, n_tokens),
        }
        return 200, body, None

    async def _chat_events(self, req: ChatRequest, rid: str) -> AsyncGenerator[Any, None]:
        created, n_tokens, prompt_tokens = now(), 0, 0
        async with await self._text_stream(req, rid) as stream:
            # admitted (or raised) by now: the role chunk opens the stream at once
            yield chat_chunk(rid, self.model, created, {"role": "assistant", "content": ""}, None)
            async for out in stream:
                n_tokens += len(out.token_ids)
                prompt_tokens = prompt_tokens or prompt_tokens_of(out.metrics)
                finish = openai_finish_reason(out.finish_reason) if out.finished else None
                if out.text or finish:
                    delta = {"content": out.text} if out.text else {}
                    yield chat_chunk(rid, self.model, created, delta, finish)
        if req.include_usage:
            chunk = chat_chunk(rid, self.model, created, {}, None)
            chunk["choices"] = []
            chunk["usage"] = usage(prompt_tokens, n_tokens)
            yield chunk

    async def _completion_events(
        self, req: CompletionRequest, rid: str
    ) -> AsyncGenerator[Any, None]:
        created, n_tokens, prompt_tokens = now(), 0, 0
        async with await self._text_stream(req, rid) as stream:
            if req.echo and isinstance(req.prompt, str):
                yield completion_chunk(rid, self.model, created, req.prompt, None)
            else:
                # the first event is sent before any output: it proves admission at once
                yield completion_chunk(rid, self.model, created, "", None)
            async for out in stream:
                n_tokens += len(out.token_ids)
                prompt_tokens = prompt_tokens or prompt_tokens_of(out.metrics)
                finish = openai_finish_reason(out.finish_reason) if out.finished else None
                if out.text or finish:
                    yield completion_chunk(rid, self.model, created, out.text, finish)
        if req.include_usage:
            chunk = completion_chunk(rid, self.model, created, "", None)
            chunk["choices"] = []
            chunk["usage"] = usage(prompt_tokens, n_tokens)
            yield chunk

    def _ending_at(
        self, stage: str, prompt: str, rid: str, sampling: dict[str, Any]
    ) -> RequestStream:
        # a request answered by ``stage`` alone: the stages after it never run
        return self.engine.generate(
            prompt,
            request_id=rid,
            sampling_params=sampling,
            trace_headers=request_trace_headers(),
            final_stage_id=stage,
            output_stages=[stage],
        )

    def _no_stage_of(self, output_type: str) -> Response:
        # a 400 naming the model: what the endpoint answers in, the pipeline does not make
        status, body = error_for(
            RequestValidationError(
                f"the pipeline {self.model!r} has no {output_type} output stage "
                f"(no stage with output_type: {output_type})",
                param="model",
            )
        )
        return json_response(body, status)

    async def speech(self, request: Request) -> Any:
        got = await self._guard(request, parse_speech)
        if isinstance(got, Response):
            return got
        req, rid = got
        stage = self.audio_stage
        if stage is None:
            return self._no_stage_of("audio")
        options = self.engine.config.stage(stage).options

        async def compute() -> Computed:
            chunks, rate = [], None
            voices = await self.chat_model.voice_params(req.voice, param="voice")
            sampling = {self.text_stage: req.sampling, **voices}
            # the input as the user's turn: a Qwen-Omni talker speaks an assistant turn
            prompt = await self.chat_model.prompt([("user", req.input)], req.input)
            async with self._ending_at(stage, prompt, f"speech-{rid}", sampling) as stream:
                async for out in stream:
                    chunks.append(out.data)
                    if rate is None and out.metrics and "sample_rate" in out.metrics:
                        rate = sample_rate_of(out.metrics)
            wav = wav_bytes(concat_audio(chunks), rate or sample_rate_of(None, options))
            headers = [(b"content-type", b"audio/wav"), (b"content-length", str(len(wav)).encode())]
            return 200, wav, headers

        return EngineJSONResponse(compute, raw=True, lifecycle=self.lifecycle)

    async def images(self, request: Request) -> Any:
        got = await self._guard(request, parse_images)
        if isinstance(got, Response):
            return got
        req, rid = got
        stage = self.image_stage
        if stage is None:
            return self._no_stage_of("image")

        async def compute() -> Computed:
            images = []
            sampling = {stage: req.sampling}
            async with self._ending_at(stage, req.prompt, f"img-{rid}", sampling) as stream:
                async for out in stream:
                    if not is_preview(out.metrics):
                        images.extend(output_images(out))
            # PNG encoding is CPU work: off the event loop, which serves other requests
            data = [
                {"b64_json": base64.b64encode(png).decode("ascii")}
                for png in [await trio.to_thread.run_sync(png_bytes, image) for image in images]
            ]
            return 200, {"created": now(), "data": data}, None

        return EngineJSONResponse(compute, lifecycle=self.lifecycle)

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [model_card(self.model, self.engine)]})

    async def health(self, request: Request) -> Response:
        status, body = health_report(self.engine.check_health(), self.lifecycle.phase)
        return json_response(body, status)

    async def prometheus(self, request: Request) -> Response:
        return Response(
            self.metrics.render(), media_type=None, headers={"content-type": CONTENT_TYPE}
        )


async def _http_error(request: Request, exc: Exception) -> Response:
    """404, 405 (and any other HTTPException) with the OpenAI error body."""
    assert isinstance(exc, HTTPException)
    status, method, path = exc.status_code, request.method, request.url.path
    if status == 404:
        message, code = f"no endpoint {path}", "not_found"
    elif status == 405:
        headers = {k.lower(): v for k, v in (exc.headers or {}).items()}
        allowed = headers.get("allow", "")
        message = f"{path} does not accept {method}; allowed: {allowed}"
        code = "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json_response(error_body(message, type_=kind, code=code), status, exc.headers)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    """A bug: the OpenAI error body; Starlette re-raises, so the traceback is logged."""
    body = error_body(f"internal server error: {type(exc).__name__}", type_="server_error")
    return json_response(body, 500)


def create_app(
    engine: Engine,
    *,
    metrics: EngineMetrics | None = None,
    model: str | None = None,
    lifecycle: ServerLifecycle | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    realtime: RealtimeLimits | None = None,
) -> Starlette:
    """The ASGI app serving ``engine``. Synchronous. ``metrics`` defaults to a new
    :class:`EngineMetrics` attached to the engine; ``model`` (the id clients must send)
    defaults to the pipeline's name; ``lifecycle`` (the server's phase: starting, serving,
    shutting down) defaults to one already serving; request bodies over ``max_body_bytes``
    get 413; ``realtime`` bounds each ``/v1/realtime`` connection (:mod:`.realtime`).
    ``app.state`` holds ``metrics``, ``engine``, ``lifecycle`` and ``realtime`` (the
    websocket endpoint)."""
    metrics = metrics or EngineMetrics(engine)
    lifecycle = lifecycle or ServerLifecycle()
    h = _Handlers(engine, metrics, model or engine.config.name, lifecycle)
    realtime_endpoint = RealtimeEndpoint(engine, h.model, realtime, h.chat_model)
    routes = [
        Route("/v1/chat/completions", h.chat, methods=["POST"]),
        Route("/v1/completions", h.completions, methods=["POST"]),
        Route("/v1/audio/speech", h.speech, methods=["POST"]),
        Route("/v1/images/generations", h.images, methods=["POST"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/metrics", h.prometheus, methods=["GET"]),
        WebSocketRoute("/v1/realtime", realtime_endpoint),
    ]
    guard = Middleware(RequestGuard, lifecycle=lifecycle, max_body_bytes=max_body_bytes)
    # the engine's tracer, read per request (it exists while the engine's session is open)
    tracing = Middleware(TraceContext, tracer=lambda: engine.tracer)
    app = Starlette(
        routes=routes,
        middleware=[guard, tracing],
        exception_handlers={HTTPException: _http_error, Exception: _unexpected_error},
    )
    app.state.metrics = metrics
    app.state.engine = engine
    app.state.lifecycle = lifecycle
    app.state.realtime = realtime_endpoint
    return app
