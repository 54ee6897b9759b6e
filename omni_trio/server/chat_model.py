"""What the served model brings to a chat: its chat template and its voices.

A chat's messages become the text stage's prompt through the model's own chat template when
its tokenizer has one (a ``vllm`` text stage answers ``collective_rpc("chat_template")``), else
through the server's fallback format (:func:`~.protocol.chat_prompt`; the tiny models ship no
template). A Qwen-Omni talker needs the template's assistant turn in the prompt.

OpenAI's ``audio.voice`` (and ``/v1/audio/speech``'s ``voice``) becomes the ``speaker``
sampling param of every ``talker`` stage, checked first against the voices those stages
have (``collective_rpc("speakers")``): an unknown voice is a 400 naming the voices, before
anything runs. A pipeline without a talker stage has no voices to choose: a voice is
accepted and unused there.

:func:`render_chat` and :func:`voice_params` are pure; :class:`ChatModel` asks the engine,
once, and keeps the answers (every replica of a stage serves the same model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import trio

from .protocol import RequestValidationError

if TYPE_CHECKING:
    from ..config.pipeline import PipelineConfig
    from ..engine.engine import Engine

__all__ = ["ChatModel", "render_chat", "talker_stages", "voice_params"]

#: the backend whose stages take the ``speaker`` sampling param
TALKER_BACKEND = "talker"


def talker_stages(config: PipelineConfig) -> tuple[str, ...]:
    """The ids of the stages that speak with a voice (backend ``talker``). Pure."""
    return tuple(st.id for st in config.stages if st.backend == TALKER_BACKEND)


def voice_params(
    voice: str | None, voices: Mapping[str, Sequence[str]], *, param: str = "audio.voice"
) -> dict[str, dict[str, object]]:
    """Per-stage sampling params that make each talker stage in ``voices`` (stage id -> its
    voices) speak with ``voice``: ``{stage: {"speaker": voice}}``; none for no voice. Voices
    match without regard to case, as the talker's do. Pure. Raises RequestValidationError
    (``param``) naming the voices when a stage does not have ``voice``."""
    if voice is None:
        return {}
    for stage, known in voices.items():
        if voice.lower() not in {v.lower() for v in known}:
            raise RequestValidationError(
                f"{param} {voice!r} is not a voice of this model (stage {stage!r}); "
                f"voices are {sorted(known)}",
                param=param,
            )
    return {stage: {"speaker": voice} for stage in voices}


def render_chat(template: str, messages: Sequence[tuple[str, str]]) -> str:
    """The prompt a chat template makes of ``(role, text)`` messages, ending with the
    assistant's generation prompt (as transformers' ``apply_chat_template(...,
    add_generation_prompt=True)`` renders it: a sandboxed Jinja environment with
    ``raise_exception``). Pure. Raises RequestValidationError when the template refuses the
    messages (its ``raise_exception``, e.g. a role it does not take)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    try:
        return compiled.render(
            messages=[{"role": role, "content": text} for role, text in messages],
            add_generation_prompt=True,
        )
    except TemplateError as exc:
        raise RequestValidationError(
            f"the model's chat template refused the messages: {exc}", param="messages"
        ) from exc


class ChatModel:
    """The served model's chat template and voices, asked of the engine on first use and
    kept. Its methods checkpoint; cancelling one leaves nothing cached (the next call asks
    again). They raise what ``engine.collective_rpc`` raises (a dead replica, a closed
    engine)."""

    def __init__(self, engine: Engine, text_stage: str) -> None:
        self._engine = engine
        self._text_stage = text_stage
        self._talkers = talker_stages(engine.config)
        self._lock = trio.Lock()
        self._template: tuple[str | None] | None = None
        self._voices: dict[str, tuple[str, ...]] | None = None

    async def chat_template(self) -> str | None:
        """The text stage's chat template, or None (no template, or not a ``vllm`` stage)."""
        async with self._lock:
            if self._template is None:
                found: str | None = None
                if self._engine.config.stage(self._text_stage).backend == "vllm":
                    answers = await self._engine.collective_rpc(
                        "chat_template", stage_ids=[self._text_stage]
                    )
                    found = next((a for a in answers if isinstance(a, str)), None)
                self._template = (found,)
            return self._template[0]

    async def voices(self) -> dict[str, tuple[str, ...]]:
        """The voices of each talker stage (stage id -> voices); empty without one."""
        async with self._lock:
            if self._voices is None:
                voices: dict[str, tuple[str, ...]] = {}
                for stage in self._talkers:
                    answers = await self._engine.collective_rpc("speakers", stage_ids=[stage])
                    voices[stage] = _names(stage, answers[0])
                self._voices = voices
            return self._voices

    async def prompt(self, messages: Sequence[tuple[str, str]], fallback: str) -> str:
        """The text stage's prompt for a chat: the model's template, else ``fallback``."""
        template = await self.chat_template()
        return fallback if template is None else render_chat(template, messages)

    async def voice_params(
        self, voice: str | None, *, param: str = "audio.voice"
    ) -> dict[str, dict[str, object]]:
        """:func:`voice_params` against the talker stages' voices (asked only for a voice)."""
        if voice is None or not self._talkers:
            return {}
        return voice_params(voice, await self.voices(), param=param)

    def __repr__(self) -> str:
        template = "unknown" if self._template is None else bool(self._template[0])
        return (
            f"<ChatModel text_stage={self._text_stage!r} talkers={list(self._talkers)} "
            f"template={template} voices={self._voices}>"
        )


def _names(stage: str, answer: object) -> tuple[str, ...]:
    if not isinstance(answer, (list, tuple)) or not all(isinstance(v, str) for v in answer):
        raise TypeError(f"stage {stage!r}: speakers() answered {answer!r}, not a list of names")
    return tuple(answer)
