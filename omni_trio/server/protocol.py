"""The OpenAI wire format of requests: validation and sampling-param mapping.

Everything here is pure and synchronous. Request bodies are validated by hand (no pydantic)
so that a 400's message says exactly which field is wrong and why; every problem raises
:class:`RequestValidationError` carrying the OpenAI ``param`` name. :func:`decode_json`
turns raw bytes into JSON values that every later step can handle: strict UTF-8, nesting
the parser can take, no lone surrogates (they cannot be encoded again).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError
from ..images import parse_size

__all__ = [
    "AUDIO_FORMATS",
    "CHAT_MODALITIES",
    "ChatRequest",
    "CompletionRequest",
    "IMAGE_FORMATS",
    "MAX_IMAGES",
    "ImageGenerationRequest",
    "RequestValidationError",
    "RequestTooLargeError",
    "SpeechRequest",
    "chat_prompt",
    "decode_json",
    "parse_chat",
    "parse_completion",
    "parse_images",
    "parse_speech",
]

# OpenAI name -> (vLLM SamplingParams name, checker). Only keys the client sent are passed on,
# so the stage's default_sampling_params fill the rest.
_NUMBER = (int, float)


class RequestValidationError(InvalidRequestError):
    """A request body broke the API's rules; ``param`` names the offending field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)


class RequestTooLargeError(RequestValidationError):
    """The request body is larger than the server accepts (HTTP 413)."""

    def __init__(self, limit: int, *, declared: int | None = None) -> None:
        self.limit = limit
        self.declared = declared
        size = f"declares {declared} bytes" if declared is not None else "has more bytes"
        super().__init__(f"the request body {size}; this server accepts at most {limit} bytes")


# a surrogate escape (paired or not); paired ones decode to one code point
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _find_lone_surrogate(value: Any) -> str | None:
    """The JSON path of the first string (key or value) holding a lone surrogate, or None.
    Iterative: the value may nest as deep as the parser allowed."""
    todo: list[tuple[str, Any]] = [("$", value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            if _has_surrogate(v):
                return path
        elif isinstance(v, dict):
            for key, item in v.items():
                if _has_surrogate(key):
                    return f"{path} (a key)"
                todo.append((f"{path}.{key}", item))
        elif isinstance(v, list):
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def decode_json(raw: bytes) -> Any:
    """Parse a request body. Raises RequestValidationError (400) naming what is wrong: not
    UTF-8, not JSON, nested deeper than the parser can go, or a string with a lone UTF-16
    surrogate (valid JSON, but no valid text: it could not be encoded again). Pure."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestValidationError(
            f"the request body is not valid UTF-8 (byte {exc.start}: {exc.reason})"
        ) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestValidationError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestValidationError(
            "the request body nests JSON arrays/objects too deeply for the parser "
            "(keep nesting under a few hundred levels)"
        ) from None
    if _SURROGATE_ESCAPE.search(text):
        where = _find_lone_surrogate(value)
        if where is not None:
            raise RequestValidationError(
                f"the request body has a lone UTF-16 surrogate escape in the string at {where}; "
                "strings must be valid Unicode (a high surrogate \\uD800-\\uDBFF followed by a "
                "low one \\uDC00-\\uDFFF, or none)"
            )
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, _NUMBER) and not isinstance(v, bool)


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """Map the OpenAI sampling fields of ``body`` to vLLM-style sampling params (pure)."""
    out: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None:
        if not _is_int(max_tokens):
            raise RequestValidationError(
                f"{name} must be an integer, got {type(max_tokens).__name__}", param=name
            )
        if max_tokens < 1:
            raise RequestValidationError(f"{name} must be >= 1, got {max_tokens}", param=name)
        out["max_tokens"] = max_tokens
    ranges = {
        "temperature": (0.0, 2.0),
        "top_p": (0.0, 1.0),
        "presence_penalty": (-2.0, 2.0),
        "frequency_penalty": (-2.0, 2.0),
        "repetition_penalty": (0.0, 2.0),
    }
    for key, (lo, hi) in ranges.items():
        v = body.get(key)
        if v is None:
            continue
        if not _is_number(v):
            raise RequestValidationError(
                f"{key} must be a number, got {type(v).__name__}", param=key
            )
        if not lo <= v <= hi or (key == "top_p" and v == 0):
            bound = "(0, 1]" if key == "top_p" else f"[{lo}, {hi}]"
            raise RequestValidationError(f"{key} must be in {bound}, got {v}", param=key)
        out[key] = float(v)
    for key in ("seed", "top_k", "min_tokens"):
        v = body.get(key)
        if v is None:
            continue
        if not _is_int(v):
            raise RequestValidationError(
                f"{key} must be an integer, got {type(v).__name__}", param=key
            )
        if key != "seed" and v < (-1 if key == "top_k" else 0):
            raise RequestValidationError(f"{key} must not be negative, got {v}", param=key)
        out[key] = v
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RequestValidationError("stop must be a string or a list of strings", param="stop")
        if len(stop) > 4:
            raise RequestValidationError(
                f"stop takes at most 4 sequences, got {len(stop)}", param="stop"
            )
        if stop:
            out["stop"] = stop
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestValidationError(f"only n=1 is supported, got {n!r}", param="n")
    return out


def _common(body: Any, known_model: str) -> tuple[str, bool, bool]:
    if not isinstance(body, dict):
        raise RequestValidationError(
            f"the request body must be a JSON object, got {type(body).__name__}"
        )
    model = body.get("model", known_model)
    if not isinstance(model, str):
        raise RequestValidationError("model must be a string", param="model")
    if model != known_model:
        raise RequestValidationError(
            f"the model {model!r} does not exist; this server serves {known_model!r}",
            param="model",
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestValidationError("stream must be a boolean", param="stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise RequestValidationError("stream_options must be an object", param="stream_options")
        include_usage = bool(opts.get("include_usage", False))
    return model, stream, include_usage


#: OpenAI's chat output modalities, and the audio formats this server encodes
CHAT_MODALITIES = ("text", "audio")
AUDIO_FORMATS = ("wav", "pcm16")


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated chat request. ``prompt``: the messages in the fallback chat format
    (:func:`chat_prompt`), ``messages``: the ``(role, text)`` turns (for the model's own chat
    template); ``modalities``: the OpenAI ``modalities`` field (None when absent);
    ``audio_format``: ``wav`` or ``pcm16`` when audio is requested, else None; ``voice``: the
    ``audio.voice`` asked for (None when absent)."""

    model: str
    prompt: str
    stream: bool
    include_usage: bool
    sampling: dict[str, Any]
    modalities: tuple[str, ...] | None = None
    audio_format: str | None = None
    messages: tuple[tuple[str, str], ...] = ()
    voice: str | None = None


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    stream: bool
    include_usage: bool
    sampling: dict[str, Any]
    echo: bool


@dataclass(frozen=True, slots=True)
class SpeechRequest:
    model: str
    input: str
    voice: str | None
    sampling: dict[str, Any]


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestValidationError(
                    f"messages[{i}].content[{j}]: only text parts are supported",
                    param=f"messages[{i}].content",
                )
            if not isinstance(part.get("text"), str):
                raise RequestValidationError(
                    f"messages[{i}].content[{j}].text must be a string",
                    param=f"messages[{i}].content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestValidationError(
        f"messages[{i}].content must be a string or a list of text parts",
        param=f"messages[{i}].content",
    )


def chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """The chat template (tiny models ship none): one ``<role>: <text>`` line per message,
    then ``assistant:`` for the model to continue. Pure."""
    lines = [f"{role}: {text}" for role, text in messages]
    lines.append("assistant:")
    return "\n".join(lines)


def _chat_output(
    body: Mapping[str, Any], stream: bool
) -> tuple[tuple[str, ...] | None, str | None, str | None]:
    """``modalities``, the audio format and the voice of a chat body (pure). OpenAI's rules:
    modalities are ``text`` and ``audio``; a stream carries audio as ``pcm16``. ``audio`` may
    be left out (format ``wav``, or ``pcm16`` when streaming); its ``voice``, a string, is
    checked against the pipeline's voices by the server (a pipeline without a talker stage
    has none to choose: it is accepted and unused)."""
    value = body.get("modalities")
    if value is None:
        return None, None, None
    if not isinstance(value, list) or not value:
        raise RequestValidationError(
            "modalities must be a non-empty list of 'text' and/or 'audio'", param="modalities"
        )
    for i, m in enumerate(value):
        if m not in CHAT_MODALITIES:
            raise RequestValidationError(
                f"modalities[{i}] must be 'text' or 'audio', got {m!r}", param="modalities"
            )
    modalities = tuple(dict.fromkeys(value))
    audio = body.get("audio")
    if audio is not None and not isinstance(audio, dict):
        raise RequestValidationError("audio must be an object {voice, format}", param="audio")
    if "audio" not in modalities:
        return modalities, None, None
    voice = (audio or {}).get("voice")
    if voice is not None and not isinstance(voice, str):
        raise RequestValidationError(
            f"audio.voice must be a string, got {type(voice).__name__}", param="audio.voice"
        )
    fmt = (audio or {}).get("format", "pcm16" if stream else "wav")
    if fmt not in AUDIO_FORMATS:
        raise RequestValidationError(
            f"audio.format {fmt!r} is not supported; use 'wav' or 'pcm16'", param="audio.format"
        )
    if stream and fmt != "pcm16":
        raise RequestValidationError(
            f"audio.format must be 'pcm16' when stream is true, got {fmt!r}", param="audio.format"
        )
    return modalities, fmt, voice


def parse_chat(body: Any, model: str) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body. Raises RequestValidationError."""
    model, stream, include_usage = _common(body, model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestValidationError(
            "messages must be a non-empty list of {role, content} objects", param="messages"
        )
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestValidationError(f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise RequestValidationError(
                f"messages[{i}].role must be system, user, assistant, developer or tool, "
                f"got {role!r}",
                param=f"messages[{i}].role",
            )
        if m.get("content") is None and m.get("audio") is not None:
            raise RequestValidationError(
                f"messages[{i}] refers to an earlier audio answer, but this server keeps no "
                "audio between turns (its expires_at is the answer's creation time); send "
                "that answer's transcript as the message's content",
                param=f"messages[{i}].content",
            )
        turns.append((role, _message_text(m.get("content"), i)))
    modalities, audio_format, voice = _chat_output(body, stream)
    return ChatRequest(
        model,
        chat_prompt(turns),
        stream,
        include_usage,
        _sampling(body),
        modalities,
        audio_format,
        tuple(turns),
        voice,
    )


def parse_completion(body: Any, model: str) -> CompletionRequest:
    """Validate a ``/v1/completions`` body. Raises RequestValidationError."""
    model, stream, include_usage = _common(body, model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestValidationError("prompt must not be empty", param="prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        prompt = list(prompt)
    else:
        raise RequestValidationError(
            "prompt must be a non-empty string or a list of non-negative token ids "
            "(batches of prompts are not supported)",
            param="prompt",
        )
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise RequestValidationError("echo must be a boolean", param="echo")
    return CompletionRequest(model, prompt, stream, include_usage, _sampling(body), echo)


def parse_speech(body: Any, model: str) -> SpeechRequest:
    """Validate a ``/v1/audio/speech`` body (only ``response_format: wav``)."""
    model, _, _ = _common(body, model)
    text = body.get("input")
    if not isinstance(text, str) or not text:
        raise RequestValidationError("input must be a non-empty string", param="input")
    voice = body.get("voice")
    if voice is not None and not isinstance(voice, str):
        raise RequestValidationError("voice must be a string", param="voice")
    fmt = body.get("response_format", "wav")
    if fmt != "wav":
        raise RequestValidationError(
            f"response_format {fmt!r} is not supported; only 'wav'", param="response_format"
        )
    return SpeechRequest(model, text, voice, _sampling(body))


#: the ``response_format`` values of ``/v1/images/generations`` this server answers
IMAGE_FORMATS = ("b64_json",)
#: most images one request may ask for (``n``; OpenAI's own limit)
MAX_IMAGES = 10


@dataclass(frozen=True, slots=True)
class ImageGenerationRequest:
    """A validated ``/v1/images/generations`` request. ``sampling``: the image stage's
    sampling params (diffusers' names: ``num_images_per_prompt`` from ``n``, ``width`` and
    ``height`` from ``size``, and the extras ``seed``, ``num_inference_steps``,
    ``guidance_scale``, ``negative_prompt``), only those the client sent."""

    model: str
    prompt: str
    n: int
    sampling: dict[str, Any]


def _image_sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    n = body.get("n")
    if n is not None:
        if not _is_int(n) or not 1 <= n <= MAX_IMAGES:
            raise RequestValidationError(
                f"n must be an integer from 1 to {MAX_IMAGES}, got {n!r}", param="n"
            )
        out["num_images_per_prompt"] = n
    size = body.get("size")
    if size is not None and size != "auto":
        if not isinstance(size, str):
            raise RequestValidationError(
                f"size must be a string WIDTHxHEIGHT, got {type(size).__name__}", param="size"
            )
        try:
            out["width"], out["height"] = parse_size(size)
        except ValueError as exc:
            raise RequestValidationError(f"size: {exc}", param="size") from None
    for key, low in (("num_inference_steps", 1), ("seed", 0)):
        v = body.get(key)
        if v is None:
            continue
        if not _is_int(v) or v < low:
            raise RequestValidationError(f"{key} must be an integer >= {low}, got {v!r}", param=key)
        out[key] = v
    guidance = body.get("guidance_scale")
    if guidance is not None:
        if not _is_number(guidance) or not guidance >= 0:
            raise RequestValidationError(
                f"guidance_scale must be a number >= 0, got {guidance!r}", param="guidance_scale"
            )
        out["guidance_scale"] = float(guidance)
    negative = body.get("negative_prompt")
    if negative is not None:
        if not isinstance(negative, str):
            raise RequestValidationError(
                f"negative_prompt must be a string, got {type(negative).__name__}",
                param="negative_prompt",
            )
        out["negative_prompt"] = negative
    return out


def parse_images(body: Any, model: str) -> ImageGenerationRequest:
    """Validate a ``/v1/images/generations`` body: ``prompt`` (a non-empty string), ``n``
    (1 to :data:`MAX_IMAGES`), ``size`` (``"WIDTHxHEIGHT"`` or ``"auto"``: the model's
    default), ``response_format`` (only ``b64_json``: this server keeps no files to link to)
    and the extras ``seed``, ``num_inference_steps``, ``guidance_scale``,
    ``negative_prompt``. Other OpenAI fields (``quality``, ``style``, ``user``) are ignored.
    Raises RequestValidationError naming the field."""
    model, stream, _ = _common(body, model)
    if stream:
        raise RequestValidationError(
            "stream is not supported for images: the answer is the finished images",
            param="stream",
        )
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise RequestValidationError("prompt must be a non-empty string", param="prompt")
    fmt = body.get("response_format")
    if fmt is not None and fmt not in IMAGE_FORMATS:
        reason = (
            "this server answers with the images themselves and keeps no files to link to"
            if fmt == "url"
            else "it is not one of OpenAI's formats"
        )
        raise RequestValidationError(
            f"response_format {fmt!r} is not supported ({reason}); use 'b64_json'",
            param="response_format",
        )
    output_format = body.get("output_format")
    if output_format is not None and output_format != "png":
        raise RequestValidationError(
            f"output_format {output_format!r} is not supported; this server encodes 'png'",
            param="output_format",
        )
    sampling = _image_sampling(body)
    return ImageGenerationRequest(
        model, prompt, int(sampling.get("num_images_per_prompt", 1)), sampling
    )
