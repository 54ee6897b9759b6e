"""The Qwen2.5-Omni golden test: the shipped ``qwen2.5-omni`` pipeline (thinker on a real vLLM
engine, the talker backend recomputing the thinker's hidden states, token2wav on the torch
backend) against transformers' own end-to-end ``generate()`` on the same tiny checkpoint,
greedy and float32.

The thinker's token ids and the talker's codes are generate()'s; the waveform is within 1e-5
(token2wav draws generate()'s noise from the same seed: the same float32 ops, bit-equal on one
torch thread; the engine's threads may split reductions differently).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
import yaml

import omni_trio
from omni_trio.pipelines import pipeline_path

from .conftest import QWEN25_SEED, QWEN25_TALKER_MAX, THINKER_MAX

pytestmark = pytest.mark.vllm


async def test_pipeline_equals_transformers_generate(reference25: Any) -> None:
    raw = yaml.safe_load(pipeline_path("qwen2.5-omni").read_text())
    token2wav = next(s for s in raw["stages"] if s["id"] == "token2wav")
    token2wav["options"]["seed"] = QWEN25_SEED
    sampling = {
        "thinker": {"max_tokens": THINKER_MAX, "temperature": 0.0},
        "talker": {"temperature": 0.0, "max_tokens": QWEN25_TALKER_MAX, "speaker": "Chelsie"},
    }
    with trio.fail_after(600):
        async with omni_trio.open_engine(raw) as engine:
            outs = await engine.generate(
                {"prompt_token_ids": reference25.prompt_ids},
                sampling_params=sampling,
                output_stages=["thinker", "talker", "token2wav"],
            ).collect()
            stats = engine.statistics()
    thinker = [t for o in outs if o.stage_id == "thinker" for t in o.token_ids]
    codes = [t for o in outs if o.stage_id == "talker" for t in o.token_ids]
    wav = np.concatenate([o.data for o in outs if o.stage_id == "token2wav"])
    assert thinker == reference25.reply_ids
    assert codes == reference25.codes.tolist()
    assert wav.shape == reference25.wav.shape
    assert np.abs(wav - reference25.wav).max() < 1e-5
    assert stats.requests_in_flight == 0 and stats.stage_requests_in_flight == 0
