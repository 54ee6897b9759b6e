"""The golden test: the shipped ``qwen3-omni`` pipeline (thinker on a real vLLM engine, the
talker backend, code2wav on the torch backend) against transformers' own end-to-end
``generate()`` on the same tiny checkpoint, greedy and float32.

It proves the pipeline is the architecture, not a look-alike: the thinker's token ids, the
talker's codes and the waveform (within 1e-4: float32 rounding of a chunked decode whose left
context covers the utterance) are generate()'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
import yaml

import omni_trio
from omni_trio.pipelines import pipeline_path

pytestmark = pytest.mark.vllm


async def test_pipeline_equals_transformers_generate(reference: Any) -> None:
    import torch

    raw = yaml.safe_load(pipeline_path("qwen3-omni").read_text())
    frames = reference.codes.shape[1]
    code2wav = next(s for s in raw["stages"] if s["id"] == "code2wav")
    code2wav["options"]["left_context"] = frames  # exact: every chunk sees the utterance
    sampling = {
        "thinker": {"max_tokens": 24, "temperature": 0.0},
        "talker": {"temperature": 0.0, "max_tokens": frames + 1, "speaker": "Ethan"},
    }
    with trio.fail_after(600):
        async with omni_trio.open_engine(raw) as engine:
            outs = await engine.generate(
                {"prompt_token_ids": reference.prompt_ids},
                sampling_params=sampling,
                output_stages=["thinker", "talker", "code2wav"],
            ).collect()
    thinker = [t for o in outs if o.stage_id == "thinker" for t in o.token_ids]
    codes = [o.token_ids for o in outs if o.stage_id == "talker" and o.token_ids]
    wav = np.concatenate([o.data for o in outs if o.stage_id == "code2wav"])
    assert thinker == reference.reply_ids
    assert torch.equal(torch.tensor(codes).T, reference.codes)
    assert wav.shape == reference.wav.shape
    assert np.abs(wav - reference.wav).max() < 1e-4
