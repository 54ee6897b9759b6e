"""Chat completions with audio output: OpenAI's ``modalities: ["text", "audio"]``.

The chat request's modalities become the engine's ``output_modalities`` (so the route runs
the audio stages only when audio is asked for). The answer follows OpenAI's audio message
shape. Non-streaming: ``message.content`` is null and ``message.audio`` is ``{id, data,
expires_at, transcript}`` (``data``: the whole answer, base64, as a WAV file or raw
``pcm16``; ``transcript``: the text stage's answer). Streaming (``pcm16`` only, as at OpenAI):
``delta.audio`` chunks carrying ``id`` with ``transcript`` text or ``data`` (base64 PCM16
little-endian mono at the audio stage's sample rate) as the stages emit them, then one
update with only ``expires_at``, then the finish chunk.

The server keeps no audio for later turns: ``expires_at`` is the response's creation time.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..audio import concat_audio, pcm16_bytes, sample_rate_of, to_float_list, wav_bytes
from ..outputs import OmniOutput
from .bodies import chat_chunk, now, openai_finish_reason, usage
from .chat_model import ChatModel
from .protocol import ChatRequest
from .responses import Computed
from .tracing import request_trace_headers

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..engine.streams import RequestStream

__all__ = ["AudioChat", "audio_message", "engine_modalities", "prompt_tokens_of"]


def engine_modalities(modalities: tuple[str, ...], produces_text: bool) -> tuple[str, ...]:
    """The engine's ``output_modalities`` for a chat's ``modalities`` (pure): audio always
    comes with the text stage's answer (its transcript) when the pipeline produces text."""
    if "audio" in modalities and produces_text:
        return ("text", "audio")
    return modalities


def audio_message(audio_id: str, data: bytes, transcript: str, expires_at: int) -> dict[str, Any]:
    """OpenAI's assistant message with audio (content null). Pure."""
    return {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "audio": {
            "id": audio_id,
            "data": base64.b64encode(data).decode("ascii"),
            "expires_at": expires_at,
            "transcript": transcript,
        },
    }


def prompt_tokens_of(metrics: Any) -> int:
    """The prompt's token count an output's metrics report (vLLM names), else 0. Pure."""
    if metrics:
        for key in ("prompt_tokens", "num_prompt_tokens"):
            value = metrics.get(key)
            if isinstance(value, int):
                return value
    return 0


@dataclass
class _Tally:
    """What one request produced so far: text (the transcript), audio, tokens, finish."""

    text: list[str] = field(default_factory=list)
    audio: list[Any] = field(default_factory=list)
    rate: int | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    reason: str | None = None

    def add(self, out: OmniOutput) -> None:
        metrics = out.metrics or {}
        if out.kind == "audio":
            if out.data is not None:
                self.audio.append(out.data)
            if self.rate is None and "sample_rate" in metrics:
                self.rate = sample_rate_of(metrics)
            return
        if out.kind != "text":
            return
        self.text.append(out.text)
        self.tokens += len(out.token_ids)
        self.prompt_tokens = self.prompt_tokens or prompt_tokens_of(out.metrics)
        if out.finished:
            self.reason = out.finish_reason


class AudioChat:
    """The chat endpoint's audio answers for one engine: :meth:`complete` (a JSON body) and
    :meth:`events` (SSE chunks). ``text_stage`` takes the request's sampling params;
    ``audio_stage`` gives the sample rate when the outputs do not; ``chat_model`` renders the
    prompt and maps ``audio.voice`` onto the talker stages."""

    def __init__(
        self,
        engine: Engine,
        model: str,
        text_stage: str,
        audio_stage: str | None,
        chat_model: ChatModel | None = None,
    ) -> None:
        self.engine = engine
        self.model = model
        self.text_stage = text_stage
        self.audio_stage = audio_stage
        self.chat_model = chat_model or ChatModel(engine, text_stage)
        types = {st.output_type for st in engine.config.stages}
        self.produces_text = "text" in types

    async def _stream(self, req: ChatRequest, rid: str) -> RequestStream:
        # before anything runs: a bad voice or a refused template is a 400
        assert req.modalities is not None
        voices = await self.chat_model.voice_params(req.voice)
        prompt = await self.chat_model.prompt(req.messages, req.prompt)
        return self.engine.generate(
            prompt,
            request_id=rid,
            sampling_params={self.text_stage: req.sampling, **voices},
            trace_headers=request_trace_headers(),
            output_modalities=engine_modalities(req.modalities, self.produces_text),
        )

    def _rate(self, tally: _Tally) -> int:
        options = self.engine.config.stage(self.audio_stage).options if self.audio_stage else {}
        return tally.rate or sample_rate_of(None, options)

    async def complete(self, req: ChatRequest, rid: str) -> Computed:
        """Run the request; the ``chat.completion`` body with ``message.audio``. Checkpoints;
        cancelling it aborts the request in every stage. Raises the engine's errors."""
        tally = _Tally()
        async with await self._stream(req, rid) as stream:
            async for out in stream:
                tally.add(out)
        samples = concat_audio(tally.audio)
        if req.audio_format == "pcm16":
            data = pcm16_bytes(samples)
        else:
            data = wav_bytes(samples, self._rate(tally))
        created = now()
        message = audio_message(f"audio_{rid}", data, "".join(tally.text), created)
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": openai_finish_reason(tally.reason),
        }
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(tally.prompt_tokens, tally.tokens),
        }
        return 200, body, None

    async def events(self, req: ChatRequest, rid: str) -> AsyncGenerator[dict[str, Any], None]:
        """The ``chat.completion.chunk`` events of a streamed audio answer. The first is
        yielded once the request is admitted (or the engine's error raised)."""
        created, audio_id, tally = now(), f"audio_{rid}", _Tally()

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return chat_chunk(rid, self.model, created, delta, finish)

        async with await self._stream(req, rid) as stream:
            yield chunk({"role": "assistant", "content": None})
            async for out in stream:
                tally.add(out)
                if out.kind == "text" and out.text:
                    yield chunk({"audio": {"id": audio_id, "transcript": out.text}})
                elif out.kind == "audio" and out.data is not None:
                    pcm = pcm16_bytes(to_float_list(out.data))
                    if pcm:
                        data = base64.b64encode(pcm).decode("ascii")
                        yield chunk({"audio": {"id": audio_id, "data": data}})
        yield chunk({"audio": {"expires_at": created}})
        yield chunk({}, openai_finish_reason(tally.reason))
        if req.include_usage:
            last = chunk({})
            last["choices"] = []
            last["usage"] = usage(tally.prompt_tokens, tally.tokens)
            yield last
