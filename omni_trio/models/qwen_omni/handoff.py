"""The hooks around a Qwen-Omni thinker stage (pure): its ``prompt_transform``, which puts a
plain text prompt in a chat turn, and the input processor between it and its talker stage.

The talker speaks the assistant's turn of a chat: its prompt is built from the
``<|im_start|>assistant`` turn of the thinker's prompt, so the thinker's prompt must be a chat
(ChatML, the family's template for text).

What crosses the stage boundary for a text prompt is token ids only: the thinker's reply
(its output ``token_ids``, end-of-turn token included when it stopped there) and the prompt
as the thinker's engine saw it after templating. A ``vllm`` stage records the latter on its
finished output (``metrics["prompt_token_ids"]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...outputs import StageInput, StageOutput

__all__ = ["chat_turn", "thinker_to_talker"]

_IM_START = "<|im_start|>"


def chat_turn(prompt: object, request_id: str) -> object:
    """A text prompt as one user turn of a ChatML chat, ready for the assistant's answer
    (``<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n``). A text that is
    already a chat (it holds ``<|im_start|>``), token ids and prompt dicts are returned
    unchanged: they are the caller's own formatting."""
    if not isinstance(prompt, str) or _IM_START in prompt:
        return prompt
    return f"{_IM_START}user\n{prompt}<|im_end|>\n{_IM_START}assistant\n"


def thinker_to_talker(
    upstream: Mapping[str, Sequence[StageOutput]],
    *,
    final: bool,
    options: Mapping[str, object] | None = None,
    context: object = None,
) -> StageInput | None:
    """The talker's one input chunk, once the thinker finished: ``token_ids`` = the reply,
    ``data = {"prompt_token_ids": (...)}``. Sends nothing before ``final``. Raises ValueError
    when the thinker's finished output carries no prompt token ids (a thinker that is not a
    ``vllm`` stage must record them in its finished output's metrics)."""
    if not final:
        return None
    if len(upstream) != 1:
        raise ValueError(f"a talker takes one thinker stage as its input, not {sorted(upstream)}")
    ((source, outputs),) = upstream.items()
    reply: list[int] = []
    prompt: object = None
    for out in outputs:
        reply.extend(out.token_ids)
        if out.finished and out.metrics is not None:
            prompt = out.metrics.get("prompt_token_ids")
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(
            f"stage {source!r}'s finished output has no metrics['prompt_token_ids'] "
            "(a vllm thinker stage records them)"
        )
    return StageInput(
        token_ids=tuple(reply),
        data={"prompt_token_ids": tuple(prompt)},
        final=True,
        source=source,
    )
