"""Tiny tokenizers of the Qwen-Omni family: a locally trained byte-level BPE plus the
family's special tokens, in the family's own order.

No model hub: the BPE is trained on an in-memory corpus in which the role words and the
newline are frequent, so that ``system``, ``user``, ``assistant`` and ``\\n`` are single tokens
as they are in Qwen's vocabulary (the talkers find a turn by these ids). The special tokens
follow in the order of Qwen's own vocabulary, so a tiny id is ``bpe_size + (real id -
151643)``. The chat template is ChatML, as the real tokenizers use for text.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from ...errors import ConfigError
from ..building import CORPUS_WORDS

__all__ = ["CHATML", "FAMILY_TOKENS", "FamilyTokens", "build_tokenizer", "token_ids"]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class FamilyTokens:
    """A family's special tokens (in vocabulary order) and the named ones transformers'
    processors look up (``extra_special_tokens``)."""

    specials: tuple[str, ...]
    named: Mapping[str, str]


FAMILY_TOKENS: Mapping[str, FamilyTokens] = {
    # Qwen3 tokenizer with the omni additions: ids 151643..151675 in the real model
    "qwen3-omni": FamilyTokens(
        tuple(
            (
                "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> "
                "<|box_start|> <|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> "
                "<|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|> <tool_call> "
                "</tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> "
                "<|repo_name|> <|file_sep|> <tool_response> </tool_response> <think> </think> "
                "<|audio_start|> <|audio_end|> <tts_pad> <tts_text_bos> <tts_text_eod> "
                "<tts_text_bos_single> <|audio_pad|>"
            ).split()
        ),
        {
            "image_token": "<|image_pad|>",
            "audio_token": "<|audio_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
    ),
    # Qwen2.5-Omni: ids 151643..151664 in the real model, then the talker's text specials and
    # the speakers' text bos ids, which lie beyond the real tokenizer (151859..) and follow
    # here so that they decode too
    "qwen2.5-omni": FamilyTokens(
        tuple(
            (
                "<|endoftext|> <|im_start|> <|im_end|> <|AUDIO|> <|audio_bos|> <|audio_eos|> "
                "<|box_end|> <|quad_start|> <|quad_end|> <|vision_bos|> <|vision_eos|> "
                "<|vision_pad|> <|IMAGE|> <|VIDEO|> <tool_call> </tool_call> <|fim_prefix|> "
                "<|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> "
                "<|tts_text_pad|> <|tts_text_bos|> <|tts_text_eod|> "
                "<|spk_bos_chelsie|> <|spk_bos_ethan|>"
            ).split()
        ),
        {
            "image_token": "<|IMAGE|>",
            "audio_token": "<|AUDIO|>",
            "video_token": "<|VIDEO|>",
            "vision_bos_token": "<|vision_bos|>",
            "vision_eos_token": "<|vision_eos|>",
            "audio_bos_token": "<|audio_bos|>",
            "audio_eos_token": "<|audio_eos|>",
        },
    ),
}

#: words that must be one token each (the talkers find turns by their ids)
_SINGLE = ("system", "user", "assistant", "\n")


def _corpus(seed: int, n_lines: int = 4000) -> Iterator[str]:
    rng = random.Random(seed)
    for i in range(n_lines):
        role = ("system", "user", "assistant")[i % 3]
        line = " ".join(rng.choice(CORPUS_WORDS) for _ in range(rng.randint(4, 14)))
        yield f"{role}\n{line.capitalize()}{rng.choice('.?!,')}\n"


def build_tokenizer(family: str, *, bpe_size: int = 512, seed: int = 0, max_len: int = 1024) -> Any:
    """A ``PreTrainedTokenizerFast`` for ``family`` (``"qwen3-omni"``, ``"qwen2.5-omni"``).
    Blocking (trains a BPE: well under a second). Deterministic for equal arguments.

    Raises :class:`ConfigError` for an unknown family or a ``bpe_size`` the corpus cannot
    reach or that splits a role word.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # transformers' classes are untyped: held as Any
    transformers: Any = import_module("transformers")

    try:
        tokens = FAMILY_TOKENS[family]
    except KeyError:
        raise ConfigError(
            f"unknown Qwen-Omni family {family!r}; families are {sorted(FAMILY_TOKENS)}"
        ) from None
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != bpe_size:
        raise ConfigError(
            f"the tiny {family} tokenizer reached {tok.get_vocab_size()} BPE tokens, not "
            f"bpe_size={bpe_size}; lower bpe_size"
        )
    tok.add_special_tokens(list(tokens.specials))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=max_len,
        extra_special_tokens=dict(tokens.named),
        chat_template=CHATML,
    )
    for word in _SINGLE:
        if len(fast.encode(word, add_special_tokens=False)) != 1:
            raise ConfigError(f"the tiny {family} tokenizer splits {word!r}; raise bpe_size")
    return fast


def token_ids(tokenizer: Any, specials: Sequence[str]) -> dict[str, int]:
    """Name -> id of every special token and of the role words (``system``, ``user``,
    ``assistant``, ``newline``). Pure."""
    vocab = tokenizer.get_vocab()
    out = {s: int(vocab[s]) for s in specials}
    for word, name in zip(_SINGLE, ("system", "user", "assistant", "newline"), strict=True):
        out[name] = int(tokenizer.encode(word, add_special_tokens=False)[0])
    return out
