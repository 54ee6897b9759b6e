"""The OpenAI wire format of responses: error bodies, usage, stream chunks, the model card.

Pure and synchronous (``now`` reads the wall clock).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..engine.engine import Engine

__all__ = [
    "chat_chunk",
    "completion_chunk",
    "error_body",
    "model_card",
    "now",
    "openai_finish_reason",
    "usage",
]


def error_body(
    message: str, *, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error body: ``{"error": {message, type, param, code}}``. Pure."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _chunk(
    rid: str, kind: str, model: str, created: int, part: dict[str, Any], finish: str | None
) -> dict[str, Any]:
    choice = {"index": 0, **part, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}


def chat_chunk(
    rid: str, model: str, created: int, delta: dict[str, Any], finish: str | None
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` event carrying ``delta``. Pure."""
    return _chunk(rid, "chat.completion.chunk", model, created, {"delta": delta}, finish)


def completion_chunk(
    rid: str, model: str, created: int, text: str, finish: str | None
) -> dict[str, Any]:
    """One ``text_completion`` stream event carrying ``text``. Pure."""
    return _chunk(rid, "text_completion", model, created, {"text": text}, finish)


def openai_finish_reason(reason: str | None) -> str:
    """Our finish reasons -> OpenAI's (``stop``/``length``; an abort reads as ``stop``)."""
    return "length" if reason == "length" else "stop"


def now() -> int:
    """The wall clock in whole seconds (OpenAI's ``created``)."""
    return int(time.time())


def model_card(model: str, engine: Engine) -> dict[str, Any]:
    """The ``/v1/models`` entry of the served pipeline: OpenAI's model object plus
    ``supported_tasks`` and ``stages`` (each stage's :class:`~omni_trio.config.stageinfo.StageInfo`
    as an object; ``replicas`` counts its members now). Synchronous."""
    return {
        "id": model,
        "object": "model",
        "created": 0,
        "owned_by": "omni-trio",
        "supported_tasks": list(engine.supported_tasks),
        "stages": [asdict(st) for st in engine.stages],
    }
