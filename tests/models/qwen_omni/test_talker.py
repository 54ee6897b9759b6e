"""The Qwen3-Omni talker as a stage runs it (:mod:`omni_trio.models.qwen_omni.talker`): pure
sampling and handoff rules, and on the tiny checkpoint, frames equal to generate()'s codes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from omni_trio.errors import ConfigError
from omni_trio.models.qwen_omni.handoff import thinker_to_talker
from omni_trio.models.qwen_omni.talker import TalkerSampling, talker_sampling
from omni_trio.outputs import StageOutput

# -- pure ----------------------------------------------------------------------------------


def test_sampling_maps_vllm_names_and_greedy() -> None:
    s = talker_sampling({"temperature": 0.0, "max_tokens": 7, "seed": 3, "ignore_eos": True})
    assert s == TalkerSampling(
        do_sample=False, temperature=1.0, max_new_tokens=7, seed=3, repetition_penalty=1.05
    )
    s = talker_sampling({"temperature": 0.7, "top_k": 5, "top_p": 0.5})
    assert (s.do_sample, s.temperature, s.top_k, s.top_p) == (True, 0.7, 5, 0.5)
    assert talker_sampling(None) == TalkerSampling()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"seed": True}, "seed must be a number"),
    ],
)
def test_sampling_names_the_bad_param(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        talker_sampling(params)


def test_handoff_carries_reply_and_prompt_ids_once_final() -> None:
    outs = [
        StageOutput(token_ids=(5, 6)),
        StageOutput(token_ids=(7,), finished=True, metrics={"prompt_token_ids": (1, 2), "x": 1}),
    ]
    assert thinker_to_talker({"thinker": outs[:1]}, final=False) is None
    chunk = thinker_to_talker({"thinker": outs}, final=True)
    assert chunk is not None
    assert chunk.token_ids == (5, 6, 7) and chunk.data == {"prompt_token_ids": (1, 2)}
    assert chunk.final and chunk.source == "thinker"


def test_handoff_names_a_thinker_without_prompt_ids() -> None:
    outs = [StageOutput(token_ids=(7,), finished=True, metrics={"num_prompt_tokens": 2})]
    with pytest.raises(ValueError, match=r"'thinker'.*prompt_token_ids.*vllm"):
        thinker_to_talker({"thinker": outs}, final=True)
    with pytest.raises(ValueError, match="one thinker stage"):
        thinker_to_talker({"a": outs, "b": outs}, final=True)


# -- the tiny checkpoint --------------------------------------------------------------------


@pytest.fixture(scope="module")
def talker(qwen3_path: Path) -> Any:
    import torch

    from omni_trio.models.qwen_omni.talker import load_talker

    torch.set_num_threads(1)
    return load_talker(qwen3_path)


@pytest.mark.slow
def test_preset_is_the_whole_architecture_cached_by_recipe(qwen3_path: Path) -> None:
    import json

    from omni_trio.models.tiny import ensure_tiny_model

    config = json.loads((qwen3_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert {"thinker_config", "talker_config", "code2wav_config"} <= set(config)
    # what vLLM's vision tower reads although transformers' config class lacks it
    assert config["thinker_config"]["vision_config"]["image_size"] == 128
    assert config["thinker_config"]["text_config"]["head_dim"] == 64
    assert config["talker_config"]["text_config"]["vocab_size"] == 64 + 1024
    assert (qwen3_path / "omni_trio_tiny.json").is_file()
    assert ensure_tiny_model("qwen3-omni", progress=False) == qwen3_path  # cached
    with pytest.raises(ConfigError, match="takes only a seed"):
        ensure_tiny_model("qwen3-omni", progress=False, vocab_size=10)


@pytest.mark.slow
def test_greedy_frames_equal_generate_codes(talker: Any, reference: Any) -> None:
    import torch

    from omni_trio.models.qwen_omni.talker import talker_frames

    inputs = talker.prepare(reference.prompt_ids, reference.reply_ids, "Ethan")
    n = reference.codes.shape[1]
    gen = talker_frames(talker, inputs, talker_sampling({"temperature": 0, "max_tokens": n + 1}))
    frames = list(gen)
    assert torch.equal(torch.tensor(frames).T, reference.codes)


@pytest.mark.slow
def test_the_generator_reports_why_it_ended(talker: Any, reference: Any) -> None:
    from omni_trio.models.qwen_omni.talker import talker_frames

    inputs = talker.prepare(reference.prompt_ids, reference.reply_ids, "ethan")
    gen = talker_frames(talker, inputs, talker_sampling({"temperature": 0, "max_tokens": 3}))
    frames = []
    with pytest.raises(StopIteration) as stop:
        while True:
            frames.append(next(gen))
    assert len(frames) == 2 and stop.value.value == "length"


@pytest.mark.slow
def test_seeded_sampling_repeats_and_seeds_differ(talker: Any, reference: Any) -> None:
    from omni_trio.models.qwen_omni.talker import talker_frames

    inputs = talker.prepare(reference.prompt_ids, reference.reply_ids, "chelsie")

    def run(seed: int) -> list[list[int]]:
        params = {"temperature": 0.9, "top_k": 50, "max_tokens": 6, "seed": seed}
        return list(talker_frames(talker, inputs, talker_sampling(params)))

    assert run(1) == run(1)
    assert run(1) != run(2)


@pytest.mark.slow
def test_prepare_rejects_what_the_talker_cannot_take(talker: Any, reference: Any) -> None:
    prompt, reply = reference.prompt_ids, reference.reply_ids
    with pytest.raises(ValueError, match=r"unknown speaker 'nobody'.*aiden.*chelsie.*ethan"):
        talker.prepare(prompt, reply, "nobody")
    with pytest.raises(ValueError, match="no '<|im_start|>assistant' turn"):
        talker.prepare(prompt[:-3], reply, "ethan")
    with pytest.raises(ValueError, match=r"token id 99999 is outside .*\[0, 545\)"):
        talker.prepare(prompt, [*reply[:-1], 99999], "ethan")
    # nothing to say: no talker input (generate() raises there)
    assert talker.prepare(prompt, reply[-1:], "ethan") is None


def test_chat_turn_wraps_plain_text_only() -> None:
    from omni_trio.models.qwen_omni.handoff import chat_turn

    assert chat_turn("hi there", "r") == (
        "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    )
    chat = "<|im_start|>system\nx<|im_end|>\n<|im_start|>assistant\n"
    assert chat_turn(chat, "r") == chat
    assert chat_turn([1, 2], "r") == [1, 2]
    assert chat_turn({"prompt_token_ids": [1]}, "r") == {"prompt_token_ids": [1]}


@pytest.mark.slow
def test_a_batched_step_gives_each_request_its_own_frames(talker: Any, reference: Any) -> None:
    from omni_trio.models.qwen_omni.talker import talker_frames

    prompt, reply = reference.prompt_ids, reference.reply_ids
    requests = [
        (talker.prepare(prompt, reply, "ethan"), {"temperature": 0, "max_tokens": 5}),
        (talker.prepare(prompt, reply[:3], "chelsie"), {"temperature": 0, "max_tokens": 3}),
        (talker.prepare(prompt, reply, "aiden"), {"temperature": 0.9, "seed": 7, "max_tokens": 4}),
    ]
    alone = [list(talker_frames(talker, i, talker_sampling(p))) for i, p in requests]
    states = [talker.start(i, talker_sampling(p)) for i, p in requests]
    together: list[list[list[int]]] = [[], [], []]
    reasons: dict[int, str] = {}
    while len(reasons) < len(states):
        going = [k for k in range(len(states)) if k not in reasons]
        for k, result in zip(going, talker.step([states[k] for k in going]), strict=True):
            if isinstance(result, str):
                reasons[k] = result
            else:
                together[k].append(result)
    assert together == alone
    assert [len(f) for f in together] == [4, 2, 3] and set(reasons.values()) == {"length"}
    with pytest.raises(ValueError, match="already finished"):
        talker.step([states[0]])
