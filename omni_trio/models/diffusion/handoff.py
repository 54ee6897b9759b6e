"""The input processor of a diffusion stage behind an LLM stage (pure): which text the image
is rendered from.

vLLM-Omni's LLM -> diffusion route: the image stage renders either what the user asked for
(the request's original prompt) or the LLM's text (a rewrite of the prompt, a caption, a
plan). Configured on the diffusion stage::

    input_processor: "omni_trio.models.diffusion.handoff:image_prompt"
    processor_options: {prompt_source: llm}      # original (the default) | llm

The prompt is text: a diffusion stage's input is ``StageInput.prompt`` (see
:mod:`omni_trio.models.diffusion.contract`). The negative prompt of classifier-free guidance
is not input but a sampling param of the diffusion stage (``negative_prompt``), so it never
passes through here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, get_args

from ...outputs import Prompt, StageInput, StageOutput

__all__ = ["PROMPT_SOURCES", "PromptSource", "image_prompt"]

PromptSource = Literal["original", "llm"]
#: what ``processor_options.prompt_source`` may name
PROMPT_SOURCES: tuple[str, ...] = get_args(PromptSource)


class _Request(Protocol):
    # what the processor reads of omni_trio.stages.processors.StageContext
    @property
    def prompt(self) -> Prompt: ...


def image_prompt(
    upstream: Mapping[str, Sequence[StageOutput]],
    *,
    final: bool,
    options: Mapping[str, object] | None = None,
    context: _Request | None = None,
) -> StageInput | None:
    """The diffusion stage's one input chunk, once every upstream stage finished (a streamed
    delta sends nothing: an image is rendered from a whole prompt): ``prompt`` = the
    request's original prompt (``prompt_source: original``, the default) or the upstream
    stages' text, joined in ``inputs`` order and stripped (``prompt_source: llm``). A CFG
    companion's outputs (``"<stage>:<role>"``) are never part of the prompt.

    Raises ValueError (the engine fails the request with a StageError of the diffusion
    stage) naming what is wrong: an unknown ``prompt_source``, an original prompt that is
    not text or a missing request context, upstream stages that produced no text."""
    source = (options or {}).get("prompt_source", "original")
    if source not in PROMPT_SOURCES:
        raise ValueError(
            f"processor_options.prompt_source must be one of {list(PROMPT_SOURCES)}, not {source!r}"
        )
    if not final:
        return None
    stages = [sid for sid in upstream if not _is_companion(sid, upstream)]
    if source == "llm":
        text = "".join(out.text for sid in stages for out in upstream[sid]).strip()
        if not text:
            raise ValueError(
                f"prompt_source llm: the upstream stage(s) {stages} produced no text to "
                "render an image from"
            )
        return StageInput(prompt=text, final=True, source=",".join(stages) or None)
    if context is None:
        raise ValueError("prompt_source original needs the request context (context=None)")
    if not isinstance(context.prompt, str):
        raise ValueError(
            "prompt_source original: a diffusion stage renders a text prompt; the request's "
            f"prompt is {type(context.prompt).__name__} (use prompt_source: llm)"
        )
    return StageInput(prompt=context.prompt, final=True, source=",".join(stages) or None)


def _is_companion(stage: str, upstream: Mapping[str, object]) -> bool:
    # a CFG companion's outputs arrive as "<stage>:<role>" beside "<stage>"
    return ":" in stage and stage.rpartition(":")[0] in upstream
