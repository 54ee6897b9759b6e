"""The OpenAI-compatible HTTP app of one engine, and ``serve_http`` to run it with Hypercorn.

``create_app(engine)`` builds a Starlette app (no middleware: any middleware added later
must be pure ASGI, since ``BaseHTTPMiddleware`` breaks disconnect-driven cancellation).
``serve_http(engine, host=..., port=...)`` serves it with Hypercorn's trio worker inside the
caller's nursery, so every HTTP request's task lives beside the engine's own tasks: a client
that disconnects cancels its request's task, and with it the request in every stage.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/audio/speech``,
``GET /v1/models``, ``GET /health``, ``GET /metrics``.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..audio import concat_audio, sample_rate_of, wav_bytes
from .metrics import CONTENT_TYPE, EngineMetrics
from .protocol import (
    ChatRequest,
    CompletionRequest,
    RequestValidationError,
    audio_stage,
    chat_chunk,
    completion_chunk,
    now,
    openai_finish_reason,
    parse_chat,
    parse_completion,
    parse_speech,
    text_stage,
    usage,
)
from .responses import EngineJSONResponse, EventStreamResponse, error_for

__all__ = ["create_app", "health_report", "serve_http"]

logger = logging.getLogger(__name__)


def health_report(stats: Any) -> tuple[int, dict[str, Any]]:
    """``(200, ...)`` when every stage has a live replica and the engine is open, else
    ``(503, ...)`` naming the stages without one. Pure (takes EngineStatistics)."""
    dead = [st.stage_id for st in stats.stages if st.live_replicas == 0]
    stages = {st.stage_id: {"live_replicas": st.live_replicas} for st in stats.stages}
    if stats.closed:
        return 503, {"status": "closed", "message": "the engine is closed", "stages": stages}
    if dead:
        return 503, {
            "status": "unhealthy",
            "message": f"stage(s) {', '.join(dead)} have no live replica",
            "dead_stages": dead,
            "stages": stages,
        }
    return 200, {"status": "ok", "stages": stages}


def _prompt_tokens(metrics: Any) -> int:
    if metrics:
        for key in ("prompt_tokens", "num_prompt_tokens"):
            value = metrics.get(key)
            if isinstance(value, int):
                return value
    return 0


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestValidationError(f"the request body is not valid JSON: {exc}") from None


class _Handlers:
    """The endpoints of one engine (kept on an object so they share engine and metrics)."""

    def __init__(self, engine: Any, metrics: EngineMetrics, model: str) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model = model
        self.text_stage = text_stage(engine.config)
        self.audio_stage = audio_stage(engine.config)

    def _text_stream(self, prompt: Any, sampling: dict[str, Any], rid: str) -> Any:
        return self.engine.generate(
            prompt,
            request_id=rid,
            sampling_params={self.text_stage: sampling},
            final_stage_id=self.text_stage,
            output_stages=[self.text_stage],
        )

    async def _guard(
        self, request: Request, parse: Callable[[Any, str], Any]
    ) -> Response | tuple[Any, str]:
        try:
            parsed = parse(await _json_body(request), self.model)
        except RequestValidationError as exc:
            status, body = error_for(exc)
            return JSONResponse(body, status_code=status)
        # OpenAI-style ids; random so that two servers' logs never collide
        return parsed, uuid.uuid4().hex[:24]

    async def chat(self, request: Request) -> Any:
        got = await self._guard(request, parse_chat)
        if isinstance(got, Response):
            return got
        req, rid = got
        rid = f"chatcmpl-{rid}"
        if req.stream:
            return EventStreamResponse(self._chat_events(req, rid))
        return EngineJSONResponse(lambda: self._complete(req, rid, chat=True))

    async def completions(self, request: Request) -> Any:
        got = await self._guard(request, parse_completion)
        if isinstance(got, Response):
            return got
        req, rid = got
        rid = f"cmpl-{rid}"
        if req.stream:
            return EventStreamResponse(self._completion_events(req, rid))
        return EngineJSONResponse(lambda: self._complete(req, rid, chat=False))

    async def _complete(
        self, req: ChatRequest | CompletionRequest, rid: str, *, chat: bool
    ) -> tuple[int, Any, None]:
        text, n_tokens, prompt_tokens, reason = [], 0, 0, None
        async with self._text_stream(req.prompt, req.sampling, rid) as stream:
            async for out in stream:
                text.append(out.text)
                n_tokens += len(out.token_ids)
                prompt_tokens = prompt_tokens or _prompt_tokens(out.metrics)
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
        async with self._text_stream(req.prompt, req.sampling, rid) as stream:
            # admitted (or raised) by now: the role chunk opens the stream at once
            yield chat_chunk(rid, self.model, created, {"role": "assistant", "content": ""}, None)
            async for out in stream:
                n_tokens += len(out.token_ids)
                prompt_tokens = prompt_tokens or _prompt_tokens(out.metrics)
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
        async with self._text_stream(req.prompt, req.sampling, rid) as stream:
            if req.echo and isinstance(req.prompt, str):
                yield completion_chunk(rid, self.model, created, req.prompt, None)
            else:
                # the first event is sent before any output: it proves admission at once
                yield completion_chunk(rid, self.model, created, "", None)
            async for out in stream:
                n_tokens += len(out.token_ids)
                prompt_tokens = prompt_tokens or _prompt_tokens(out.metrics)
                finish = openai_finish_reason(out.finish_reason) if out.finished else None
                if out.text or finish:
                    yield completion_chunk(rid, self.model, created, out.text, finish)
        if req.include_usage:
            chunk = completion_chunk(rid, self.model, created, "", None)
            chunk["choices"] = []
            chunk["usage"] = usage(prompt_tokens, n_tokens)
            yield chunk

    async def speech(self, request: Request) -> Any:
        got = await self._guard(request, parse_speech)
        if isinstance(got, Response):
            return got
        req, rid = got
        stage = self.audio_stage
        if stage is None:
            status, body = error_for(
                RequestValidationError(
                    f"the pipeline {self.model!r} has no audio output stage "
                    "(no stage with output_type: audio)",
                    param="model",
                )
            )
            return JSONResponse(body, status_code=status)
        options = self.engine.config.stage(stage).options

        async def compute() -> tuple[int, bytes, list]:
            chunks, rate = [], None
            sampling = {self.text_stage: req.sampling} if req.sampling else None
            async with self.engine.generate(
                req.input,
                request_id=f"speech-{rid}",
                sampling_params=sampling,
                final_stage_id=stage,
                output_stages=[stage],
            ) as stream:
                async for out in stream:
                    chunks.append(out.data)
                    if rate is None and out.metrics and "sample_rate" in out.metrics:
                        rate = sample_rate_of(out.metrics)
            wav = wav_bytes(concat_audio(chunks), rate or sample_rate_of(None, options))
            headers = [(b"content-type", b"audio/wav"), (b"content-length", str(len(wav)).encode())]
            return 200, wav, headers

        return EngineJSONResponse(compute, raw=True)

    async def models(self, request: Request) -> Response:
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "omni-trio"}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        status, body = health_report(self.engine.statistics())
        return JSONResponse(body, status_code=status)

    async def prometheus(self, request: Request) -> Response:
        return Response(
            self.metrics.render(), media_type=None, headers={"content-type": CONTENT_TYPE}
        )


def create_app(
    engine: Any, *, metrics: EngineMetrics | None = None, model: str | None = None
) -> Starlette:
    """The ASGI app serving ``engine``. Synchronous. ``metrics`` defaults to a new
    :class:`EngineMetrics` attached to the engine; ``model`` (the id clients must send)
    defaults to the pipeline's name. The app's ``state.metrics`` holds the metrics."""
    metrics = metrics or EngineMetrics(engine)
    h = _Handlers(engine, metrics, model or engine.config.name)
    routes = [
        Route("/v1/chat/completions", h.chat, methods=["POST"]),
        Route("/v1/completions", h.completions, methods=["POST"]),
        Route("/v1/audio/speech", h.speech, methods=["POST"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/metrics", h.prometheus, methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    app.state.metrics = metrics
    app.state.engine = engine
    return app


def _bound_port(binds: list[str]) -> int:
    # hypercorn reports "http://127.0.0.1:54321"; the port is what a caller needs for port 0
    return int(binds[0].rsplit(":", 1)[1])


async def serve_http(
    engine: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    grace_period: float = 10.0,
    app: Any = None,
) -> None:
    """Serve ``engine`` over HTTP until cancelled or until ``shutdown_trigger()`` returns.

    Reports the bound port with ``task_status.started(port)`` (``port=0`` picks a free one).
    On shutdown it stops accepting connections, lets in-flight requests finish for up to
    ``grace_period`` seconds, then cancels them (which aborts them in every stage), and
    returns. Cancellation stops the server the same way, without the grace period.
    Raises OSError if the address cannot be bound."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.graceful_timeout = grace_period
    config.accesslog = None
    config.errorlog = logging.getLogger("omni_trio.server.hypercorn")
    config.keep_alive_timeout = 5.0
    asgi: Any = app if app is not None else create_app(engine)

    async def run(*, task_status: trio.TaskStatus[list[str]]) -> None:
        await serve(asgi, config, shutdown_trigger=shutdown_trigger, task_status=task_status)

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(run)
        task_status.started(_bound_port(binds))
