"""Qwen2.5-Omni's parts as stages run them, on the tiny checkpoint against transformers'
generate(): the preset, the talker (thinker rows recomputed in one pass: the same greedy codes)
and token2wav (a per-utterance seeded generator: generate()'s waveform bit for bit)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_trio.errors import ConfigError
from omni_trio.models.qwen_omni.qwen25_talker import reply_for_talker
from omni_trio.models.qwen_omni.talker import talker_sampling

from .conftest import QWEN25_SEED, QWEN25_TALKER_MAX

# -- pure ----------------------------------------------------------------------------------


def test_the_reply_is_cut_after_its_first_end_of_turn_never_below_two() -> None:
    assert reply_for_talker([5, 6, 7], [9]) == [5, 6, 7]
    assert reply_for_talker([5, 6, 9], [9]) == [5, 6, 9]
    # generate() turns the rows after the first end of turn into text pad: a cut reply
    assert reply_for_talker([5, 9, 7, 9, 8], [9]) == [5, 9]
    # its clamp keeps two rows even when the reply starts with the end of turn
    assert reply_for_talker([9, 7, 8], [9]) == [9, 7]
    assert reply_for_talker([9], [9]) == [9]


# -- the tiny checkpoint --------------------------------------------------------------------


@pytest.fixture(scope="module")
def talker(qwen25_path: Path) -> Any:
    import torch

    from omni_trio.models.qwen_omni.talker import load_talker

    torch.set_num_threads(1)
    return load_talker(qwen25_path)


@pytest.fixture(scope="module")
def token2wav(qwen25_path: Path) -> Any:
    from omni_trio.models.qwen_omni.token2wav import build_token2wav

    return build_token2wav({"model": str(qwen25_path), "seed": QWEN25_SEED})


@pytest.mark.slow
def test_preset_is_the_whole_architecture_with_voices(qwen25_path: Path) -> None:
    import torch

    from omni_trio.models.tiny import ensure_tiny_model

    config = json.loads((qwen25_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5OmniForConditionalGeneration"]
    assert {"thinker_config", "talker_config", "token2wav_config"} <= set(config)
    text = config["thinker_config"]["text_config"]
    # what vLLM's CPU attention runs: head_dim 64, an M-RoPE section summing to half of it
    assert text["hidden_size"] // text["num_attention_heads"] == 64
    assert sum(text["rope_parameters"]["mrope_section"]) == 32
    assert config["thinker_config"]["vision_start_token_id"] == 521
    voices = torch.load(qwen25_path / "spk_dict.pt", weights_only=True)
    assert sorted(voices) == ["Chelsie", "Ethan"]
    assert voices["Ethan"]["ref_mel"].shape == (1, 60, 80)
    built = json.loads((qwen25_path / "omni_trio_build.json").read_text())
    assert built["parameters"] == {"thinker": 543808, "talker": 394496, "token2wav": 429112}
    assert ensure_tiny_model("qwen2.5-omni", progress=False) == qwen25_path  # cached
    with pytest.raises(ConfigError, match="takes only a seed"):
        ensure_tiny_model("qwen2.5-omni", progress=False, vocab_size=10)


@pytest.mark.slow
def test_greedy_codes_equal_generate_codes(talker: Any, reference25: Any) -> None:
    assert talker.family == "qwen2.5-omni" and talker.codes_per_frame == 1
    inputs = talker.prepare(reference25.prompt_ids, reference25.reply_ids, "Chelsie")
    params = {"temperature": 0, "max_tokens": QWEN25_TALKER_MAX}
    frames = talker.frames(inputs, talker_sampling(params))
    codes = []
    with pytest.raises(StopIteration) as stop:
        while True:
            codes.append(next(frames))
    assert all(len(f) == 1 for f in codes)
    assert [f[0] for f in codes] == reference25.codes.tolist()
    # the tiny talker never says codec pad or end: generate() stopped at its max too
    assert stop.value.value == "length" and len(codes) == QWEN25_TALKER_MAX


@pytest.mark.slow
def test_seeded_sampling_repeats_and_seeds_differ(talker: Any, reference25: Any) -> None:
    inputs = talker.prepare(reference25.prompt_ids, reference25.reply_ids, "ethan")

    def run(seed: int) -> list[list[int]]:
        params = {"temperature": 0.9, "top_k": 40, "top_p": 0.8, "max_tokens": 8, "seed": seed}
        return list(talker.frames(inputs, talker_sampling(params)))

    assert run(1) == run(1)
    assert run(1) != run(2)


@pytest.mark.slow
def test_a_closed_decode_stops_between_steps(talker: Any, reference25: Any) -> None:
    inputs = talker.prepare(reference25.prompt_ids, reference25.reply_ids, "chelsie")
    frames = talker.frames(inputs, talker_sampling({"temperature": 0, "max_tokens": 100}))
    first = [next(frames), next(frames)]
    frames.close()
    with pytest.raises(StopIteration):
        next(frames)
    assert [f[0] for f in first] == reference25.codes[:2].tolist()


@pytest.mark.slow
def test_prepare_rejects_what_the_talker_cannot_take(talker: Any, reference25: Any) -> None:
    prompt, reply = reference25.prompt_ids, reference25.reply_ids
    with pytest.raises(ValueError, match=r"unknown speaker 'nobody'.*\['chelsie', 'ethan'\]"):
        talker.prepare(prompt, reply, "nobody")
    with pytest.raises(ValueError, match=r"token id 99999 is outside .*\[0, 539\)"):
        talker.prepare(prompt, [*reply[:-1], 99999], "chelsie")
    with pytest.raises(ValueError, match="empty prompt"):
        talker.prepare([], reply, "chelsie")
    # nothing to say: no talker input (generate() raises there)
    assert talker.prepare(prompt, reply[:1], "chelsie") is None


@pytest.mark.slow
def test_token2wav_is_generates_waveform_with_the_same_seed(
    token2wav: Any, reference25: Any
) -> None:
    import torch

    assert token2wav.hop_length is None and token2wav.sample_rate == 24000
    codes = reference25.codes[None]
    with torch.inference_mode():
        wav = token2wav(codes)[0].numpy()
    # 480 samples a code; the per-utterance generator draws generate()'s noise exactly: the
    # same float32 ops (bit-equal when both run on one torch thread; other thread counts
    # split reductions differently, ~1e-7)
    assert wav.shape == reference25.wav.shape == (480 * codes.shape[1],)
    assert np.abs(wav - reference25.wav).max() < 1e-5
    assert 0.05 < float(np.std(wav)) and float(np.abs(wav).max()) < 1.0  # not at the clamp


@pytest.mark.slow
def test_a_token2wav_batch_row_equals_its_utterance_alone(token2wav: Any) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 320, (2, 6), generator=g)
    with torch.inference_mode():
        both = token2wav(torch.stack((a, b)))
        alone = token2wav(b[None])
    assert torch.equal(both[1], alone[0]) and not torch.equal(both[0], both[1])


@pytest.mark.slow
def test_token2wav_names_bad_options_and_input(qwen25_path: Path, token2wav: Any) -> None:
    import torch

    from omni_trio.models.qwen_omni.token2wav import build_token2wav

    model = str(qwen25_path)
    with pytest.raises(ConfigError, match=r"unknown options \['left_context'\]"):
        build_token2wav({"model": model, "left_context": 3})
    with pytest.raises(ConfigError, match=r"unknown speaker 'nobody'.*\['chelsie', 'ethan'\]"):
        build_token2wav({"model": model, "speaker": "nobody"})
    with pytest.raises(ConfigError, match="seed must be an int >= 0"):
        build_token2wav({"model": model, "seed": -1})
    with pytest.raises(ConfigError, match="options.model"):
        build_token2wav({"seed": 1})
    with pytest.raises(ConfigError, match="not a qwen2_5_omni checkpoint"):
        build_token2wav({"model": "tiny:qwen3-omni"})
    with pytest.raises(ValueError, match="at most 2048 codes an utterance"):
        token2wav(torch.zeros((1, 2049), dtype=torch.long))
