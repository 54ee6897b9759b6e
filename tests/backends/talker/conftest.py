"""What the talker backend's engine tests share: a scripted thinker before a real talker and
vocoder, a chat prompt in a family's ids, an engine bounded by a hang guard, and the talker
replica's state."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

import omni_trio
from omni_trio import Engine


@asynccontextmanager
async def engine_on(cfg: dict) -> AsyncIterator[Engine]:
    with trio.fail_after(180):
        async with omni_trio.open_engine(cfg) as engine:
            yield engine


async def talker_state(engine: Engine) -> dict[str, Any]:
    with trio.fail_after(30):
        (described,) = await engine.collective_rpc("describe", stage_ids=["talker"])
    assert isinstance(described, dict)
    return described


def chat_prompt_ids(path: Path) -> list[int]:
    """``hello world`` as a user turn, ready for the assistant, in the checkpoint's ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "hello world"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [int(t) for t in tok(text).input_ids]


def scripted_thinker_pipeline(
    path: Path,
    vocoder: Mapping[str, Any],
    *,
    max_tokens: int,
    talker: Mapping[str, Any] | None = None,
    thinker: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """thinker (scripted: it records its prompt's ids on its finished output, as a vllm stage
    does) -> the real talker of the checkpoint at ``path`` -> ``vocoder`` (a stage mapping
    without its id and input). The thinker's reply is the prompt's first 5 tokens (offset 0):
    ids the talker can embed."""
    return {
        "name": "scripted-thinker-talker",
        "stages": [
            {
                "id": "thinker",
                "backend": "scripted",
                "options": {"outputs": 5, "token_offset": 0, **(thinker or {})},
                "final_output": True,
                "output_type": "text",
            },
            {
                "id": "talker",
                "backend": "talker",
                "inputs": ["thinker"],
                "input_processor": "omni_trio.models.qwen_omni.handoff:thinker_to_talker",
                "options": {"model": str(path), **(talker or {})},
                "output_type": "tokens",
                "default_sampling_params": {"temperature": 0.0, "max_tokens": max_tokens},
            },
            {**vocoder, "inputs": ["talker"], "final_output": True, "output_type": "audio"},
        ],
    }
