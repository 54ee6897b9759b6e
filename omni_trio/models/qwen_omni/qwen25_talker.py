"""The Qwen2.5-Omni talker as a stage of its own: from the thinker's prompt and reply token ids
to codec codes, one code per decode step, equal to what transformers'
``Qwen2_5OmniForConditionalGeneration.generate()`` produces on the same checkpoint.

Unlike Qwen3-Omni's, this talker reads the thinker's *last hidden states*: every input row is
a thinker token's embedding plus its last-layer hidden state, and each decode step adds the
next reply token's row (generate()'s ``thinker_reply_part``). The stage boundary still
carries token ids only: :meth:`Qwen25Talker.prepare` recomputes the rows with one thinker
forward over the prompt and the reply but its last token (the tokens the thinker was fed), so
this stage loads the thinker's text layers as well as the talker (for the real 7B model, the
thinker's 7B text weights a second time; the tiny one, 0.54 M parameters). The one-pass rows
equal the thinker's own incremental ones up to float rounding.

What generate() does and this module repeats: the talker runs with ``attention_mask=None``
(plain positions, no codec rows added inside its forward); its input ids start with one
codec mask id per prompt token then codec pad and start, and the repetition penalty counts
them; codec start is suppressed; both codec pad and codec end stop it; a reply is cut after
the thinker's first end-of-turn token (later rows are text pad in generate()).

:func:`qwen25_frames` is a generator: each ``next()`` runs one talker forward and yields that
step's code (a one-code frame); closing it is the cancellation point. Everything here is
blocking (torch); call it from a worker thread in async code.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from .checkpoint import load_part, read_config
from .sampling import TalkerSampling, logits_processors, pick

__all__ = [
    "Qwen25Talker",
    "Qwen25TalkerInputs",
    "qwen25_frames",
    "read_speakers",
    "reply_for_talker",
]

SPEAKER_FILE = "spk_dict.pt"


@dataclass(frozen=True, slots=True)
class Qwen25TalkerInputs:
    """What generate() builds between the thinker and the talker for one request."""

    #: [1, P + 2, D] the talker's prompt rows (thinker rows, speaker bos, first reply row)
    prompt_embeds: Any
    #: [1, R, D] one row added to each decode step's code embedding; the last one repeats
    reply_part: Any
    #: [1, P + 2] the codec ids the prompt stands for (mask * P, pad, start)
    codec_ids: Any


def reply_for_talker(reply_ids: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """The reply as generate() hands it to the talker: cut after its first end-of-turn token
    (generate() replaces the rows after it with text pad and the row of that token with the
    text end, which is what a reply ending there gives), but never shorter than 2 tokens (its
    clamp). Pure."""
    first = next((i for i, t in enumerate(reply_ids) if t in eos_ids), len(reply_ids))
    return list(reply_ids[: max(first + 1, 2)])


def read_speakers(path: str | Path) -> dict[str, dict[str, Any]]:
    """The checkpoint's voices (``spk_dict.pt``), keyed by lowercased name. Blocking. Raises
    :class:`ConfigError` when the file is missing or not a dict of voices."""
    import torch

    file = Path(path) / SPEAKER_FILE
    if not file.is_file():
        raise ConfigError(f"{path}: no {SPEAKER_FILE} (the Qwen2.5-Omni voices) in the checkpoint")
    raw = torch.load(file, weights_only=True)
    keys = {"cond", "ref_mel", "bos_token"}
    if not isinstance(raw, dict) or not all(
        isinstance(v, dict) and keys <= set(v) for v in raw.values()
    ):
        raise ConfigError(f"{file}: not a dict of voices with {sorted(keys)}")
    return {str(name).lower(): voice for name, voice in raw.items()}


class Qwen25Decode:
    """One request's decode between two steps: its step generator, and its finish reason once
    it ended. Owned by the request; advanced only by :meth:`Qwen25Talker.step`."""

    __slots__ = ("finished", "frames")

    def __init__(self, frames: Generator[list[int], None, str]) -> None:
        self.frames = frames
        self.finished: str | None = None

    def __repr__(self) -> str:
        return f"<Qwen25Decode finished={self.finished!r}>"


class Qwen25Talker:
    """The talker's weights and the thinker's text model, loaded from a checkpoint.
    Immutable once loaded; safe to use from one thread at a time (each request's state lives
    in its own generator)."""

    codes_per_frame = 1
    family = "qwen2.5-omni"

    def __init__(
        self,
        config: Any,
        thinker: Any,
        talker: Any,
        voices: dict[str, dict[str, Any]],
        device: str = "cpu",
    ) -> None:
        self.config = config
        #: where the weights live and every step runs ("cpu", "cuda", ...)
        self.device = device
        self.thinker = thinker
        self.talker = talker
        self.voices = voices
        self.speakers: tuple[str, ...] = tuple(sorted(voices))
        eos = config.thinker_config.text_config.eos_token_id
        self.eos_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, list) else (eos,)

    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32", device: str = "cpu") -> Qwen25Talker:
        """Blocking: reads the talker's and the thinker's text model's tensors (not the
        audio and vision towers, not token2wav) and the voices, and moves them to
        ``device``."""
        import torch
        from transformers import (
            Qwen2_5OmniTalkerForConditionalGeneration,
            Qwen2_5OmniThinkerTextModel,
        )

        config = read_config(path)
        torch_dtype = getattr(torch, dtype)
        thinker = load_part(
            Qwen2_5OmniThinkerTextModel,
            config.thinker_config.text_config,
            path,
            "thinker.model.",
            torch_dtype,
        )
        talker = load_part(
            Qwen2_5OmniTalkerForConditionalGeneration,
            config.talker_config,
            path,
            "talker.",
            torch_dtype,
        )
        return cls(config, thinker.to(device), talker.to(device), read_speakers(path), device)

    def frames(
        self, inputs: Qwen25TalkerInputs, sampling: TalkerSampling
    ) -> Generator[list[int], None, str]:
        """:func:`qwen25_frames` of this talker: the decode of one request, step by step."""
        return qwen25_frames(self, inputs, sampling)

    def start(self, inputs: Qwen25TalkerInputs, sampling: TalkerSampling) -> Qwen25Decode:
        """A request's decode, for :meth:`step`."""
        return Qwen25Decode(qwen25_frames(self, inputs, sampling))

    def step(self, states: Sequence[Qwen25Decode]) -> list[list[int] | str]:
        """One decode step of each request: its next code, or its finish reason when its
        decode ended. The requests of a step run one after another (this talker's forward
        takes one request: its thinker rows are consumed as it goes)."""
        results: list[list[int] | str] = []
        for i, state in enumerate(states):
            if state.finished is not None:
                raise ValueError(f"request {i} of the step already finished ({state.finished})")
            try:
                results.append(next(state.frames))
            except StopIteration as stop:
                state.finished = str(stop.value)
                results.append(state.finished)
        return results

    def num_parameters(self) -> int:
        thinker = sum(p.numel() for p in self.thinker.parameters())
        return int(thinker + sum(p.numel() for p in self.talker.parameters()))

    def prepare(
        self, prompt_ids: Sequence[int], reply_ids: Sequence[int], speaker: str
    ) -> Qwen25TalkerInputs | None:
        """generate()'s talker input for a text prompt, the thinker rows recomputed by one
        thinker forward. ``None`` when the reply has fewer than 2 tokens: there is nothing to
        say (generate() fails there). Blocking (one thinker forward over prompt + reply).

        Raises ValueError for an empty prompt, a token id outside the thinker's vocabulary,
        or an unknown speaker."""
        import torch

        voice = self.voices.get(speaker.lower())
        if voice is None:
            raise ValueError(f"unknown speaker {speaker!r}; speakers are {list(self.speakers)}")
        if not prompt_ids:
            raise ValueError("the talker needs the thinker's prompt ids; got an empty prompt")
        reply = reply_for_talker(reply_ids, self.eos_ids)
        if len(reply) < 2:
            return None
        embed = self.thinker.get_input_embeddings()
        vocab = embed.num_embeddings
        bad = next((t for t in (*prompt_ids, *reply) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the thinker's vocabulary [0, {vocab})")
        tc = self.talker.config
        n = len(prompt_ids)
        # the thinker's rows of every token *fed* to it: the prompt and the reply but its
        # last token (never fed back)
        dev = self.device
        fed = torch.tensor([[*prompt_ids, *reply[:-1]]], device=dev)
        with torch.no_grad():
            states = self.thinker(input_ids=fed, output_hidden_states=True).hidden_states
            rows = states[-1] + states[0]
            specials = torch.tensor([[voice["bos_token"], tc.tts_text_end_token_id]], device=dev)
            bos, text_end = embed(specials).chunk(2, dim=1)
            text_pad = embed(torch.tensor([[tc.tts_text_pad_token_id]], device=dev))
            prompt = torch.cat((rows[:, :n], bos, rows[:, n : n + 1]), dim=1)
            reply_part = torch.cat((rows[:, n + 1 :], text_end, text_pad), dim=1)
        codec_ids = torch.tensor(
            [
                [tc.tts_codec_mask_token_id] * n
                + [tc.tts_codec_pad_token_id, tc.tts_codec_start_token_id]
            ],
            device=dev,
        )
        return Qwen25TalkerInputs(prompt, reply_part, codec_ids)


def qwen25_frames(
    model: Qwen25Talker, inputs: Qwen25TalkerInputs, sampling: TalkerSampling
) -> Generator[list[int], None, str]:
    """Yield one frame (one code) per decode step as soon as it is known; blocking per step.
    Returns the finish reason: ``"stop"`` (codec pad or codec end, as generate()'s talker
    EOS) or ``"length"`` (``max_new_tokens`` codes). Stop between any two steps by closing
    the generator."""
    import torch
    from transformers import DynamicCache

    talker = model.talker
    tc = talker.config
    eos = (tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id)
    gen = None
    if sampling.seed is not None:
        gen = torch.Generator(device=model.device).manual_seed(sampling.seed)
    procs = logits_processors(sampling, [tc.tts_codec_start_token_id], model.device)
    cache = DynamicCache(config=tc)
    ids = inputs.codec_ids
    part = inputs.reply_part
    with torch.no_grad():
        for step in range(sampling.max_new_tokens):
            # attention_mask=None as generate() calls it: positions follow the cache and
            # the forward adds no codec rows of its own
            out = talker(
                input_ids=ids[:, -1:] if step else None,
                inputs_embeds=inputs.prompt_embeds if step == 0 else None,
                thinker_reply_part=part,
                past_key_values=cache,
                use_cache=True,
                attention_mask=None,
            )
            part = out.thinker_reply_part
            logits = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)
            code = pick(procs(ids, logits), sampling.do_sample, gen)
            ids = torch.cat((ids, code[:, None]), dim=1)
            if int(code.item()) in eos:
                return "stop"
            yield [int(code.item())]
    return "length"
