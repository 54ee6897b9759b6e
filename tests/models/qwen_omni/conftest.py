"""The tiny Qwen3-Omni checkpoint and transformers' own end-to-end generate() on it: the
reference every Qwen-Omni test compares with (greedy, float32)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: the golden prompt: its greedy thinker reply has 5 tokens (enough for the talker)
MESSAGES = [
    {"role": "system", "content": "You are a tiny omni model."},
    {"role": "user", "content": "Hello world, tell me a story about the river."},
]
THINKER_MAX = 24
TALKER_MAX = 40


@dataclass(frozen=True)
class Reference:
    """What generate() produced: prompt and thinker ids, the talker's codes [16, T] (captured
    where generate() hands them to code2wav) and the waveform."""

    prompt_ids: list[int]
    reply_ids: list[int]
    codes: Any
    wav: Any


@pytest.fixture(scope="session")
def qwen3_path() -> Path:
    from omni_trio.models.tiny import ensure_tiny_model

    return ensure_tiny_model("qwen3-omni", progress=False)


def generate_reference(path: Path, *, talker_max: int = TALKER_MAX) -> Reference:
    """transformers' ``Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)``,
    greedy (thinker and talker), speaker Ethan. Blocking."""
    import torch
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    input_ids = tok(text, return_tensors="pt").input_ids
    captured = []
    decode = model.code2wav.chunked_decode

    def spy(codes: Any, **kwargs: Any) -> Any:
        captured.append(codes.clone())
        return decode(codes, **kwargs)

    model.code2wav.chunked_decode = spy
    with torch.no_grad():
        seq, wav = model.generate(
            input_ids,
            return_audio=True,
            speaker="Ethan",
            thinker_max_new_tokens=THINKER_MAX,
            thinker_do_sample=False,
            talker_max_new_tokens=talker_max,
            talker_do_sample=False,
            talker_repetition_penalty=1.05,
            # generate() hard-codes the real model's end-of-turn id otherwise
            thinker_eos_token_id=model.config.im_end_token_id,
        )
    n = input_ids.shape[1]
    return Reference(
        prompt_ids=input_ids[0].tolist(),
        reply_ids=seq[0, n:].tolist(),
        codes=captured[0][0],
        wav=wav.reshape(-1).float().numpy(),
    )


@pytest.fixture(scope="session")
def reference(qwen3_path: Path) -> Reference:
    return generate_reference(qwen3_path)


# -- Qwen2.5-Omni ------------------------------------------------------------------------

#: the global seed before generate(): its token2wav draws the DiT's noise from it
QWEN25_SEED = 7
QWEN25_TALKER_MAX = 48


@pytest.fixture(scope="session")
def qwen25_path() -> Path:
    from omni_trio.models.tiny import ensure_tiny_model

    return ensure_tiny_model("qwen2.5-omni", progress=False)


def generate_reference_25(path: Path) -> Reference:
    """transformers' ``Qwen2_5OmniForConditionalGeneration.generate()``, greedy (thinker and
    talker), speaker Chelsie, after ``torch.manual_seed(QWEN25_SEED)``; ``codes`` [T] as
    generate() hands them to token2wav. Blocking."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    input_ids = tok(text, return_tensors="pt").input_ids
    tc = model.config.talker_config
    captured = []
    token2wav = model.token2wav.forward

    def spy(code: Any, *args: Any, **kwargs: Any) -> Any:
        captured.append(code.clone())
        return token2wav(code, *args, **kwargs)

    model.token2wav.forward = spy
    torch.manual_seed(QWEN25_SEED)
    with torch.no_grad():
        seq, wav = model.generate(
            input_ids,
            speaker="Chelsie",
            thinker_max_new_tokens=THINKER_MAX,
            thinker_do_sample=False,
            # generate() would stop at the real model's end-of-turn id otherwise
            thinker_eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
            talker_max_new_tokens=QWEN25_TALKER_MAX,
            talker_do_sample=False,
            # the real model's codec pad and end otherwise (8292, 8294)
            talker_eos_token_id=[tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id],
        )
    n = input_ids.shape[1]
    return Reference(
        prompt_ids=input_ids[0].tolist(),
        reply_ids=seq[0, n:].tolist(),
        codes=captured[0][0],
        wav=wav.reshape(-1).float().numpy(),
    )


@pytest.fixture(scope="session")
def reference25(qwen25_path: Path) -> Reference:
    return generate_reference_25(qwen25_path)
