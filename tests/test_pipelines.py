"""The pipelines shipped inside the package: they load, and the scripted twin runs end to end
(scripted thinker and talker, the real tiny torch vocoder)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio

import omni_trio
from omni_trio.config import load_config
from omni_trio.errors import ConfigError
from omni_trio.pipelines import default_pipeline_path, pipeline_path


@pytest.mark.parametrize("name", ["tiny-omni", "tiny-omni-scripted"])
def test_shipped_pipelines_load(name: str) -> None:
    cfg = load_config(pipeline_path(name))
    assert cfg.name == name and cfg.stage_ids == ["thinker", "talker", "code2wav"]
    assert cfg.final_output_stages == ["thinker", "code2wav"]
    code2wav = cfg.stage("code2wav")
    assert code2wav.backend == "torch" and code2wav.stream_input
    assert code2wav.output_type == "audio" and code2wav.inputs == ["talker"]
    assert code2wav.options["weights"] == "tiny:code2wav"
    assert cfg.stage("talker").default_sampling_params["max_tokens"] == 64


def test_qwen3_omni_pipeline_loads() -> None:
    cfg = load_config(pipeline_path("qwen3-omni"))
    assert cfg.stage_ids == ["thinker", "talker", "code2wav"]
    assert cfg.final_output_stages == ["thinker", "code2wav"]
    assert [s.backend for s in cfg.stages] == ["vllm", "talker", "torch"]
    thinker, talker, code2wav = cfg.stages
    assert thinker.engine_args["model"] == "tiny:qwen3-omni"
    assert thinker.engine_args["language_model_only"] is True
    assert thinker.engine_args["dtype"] == "float32"
    assert thinker.prompt_transform == "omni_trio.models.qwen_omni.handoff:chat_turn"
    assert talker.options["model"] == code2wav.options["model"] == "tiny:qwen3-omni"
    assert talker.input_processor == "omni_trio.models.qwen_omni.handoff:thinker_to_talker"
    assert code2wav.stream_input and code2wav.options["chunk_size"] % 16 == 0


def test_qwen25_omni_pipeline_loads() -> None:
    cfg = load_config(pipeline_path("qwen2.5-omni"))
    assert cfg.stage_ids == ["thinker", "talker", "token2wav"]
    assert cfg.final_output_stages == ["thinker", "token2wav"]
    assert [s.backend for s in cfg.stages] == ["vllm", "talker", "torch"]
    thinker, talker, token2wav = cfg.stages
    assert thinker.engine_args["model"] == "tiny:qwen2.5-omni"
    assert thinker.engine_args["language_model_only"] is True
    assert thinker.engine_args["dtype"] == "float32"
    assert talker.options["model"] == token2wav.options["model"] == "tiny:qwen2.5-omni"
    assert talker.input_processor == "omni_trio.models.qwen_omni.handoff:thinker_to_talker"
    # the DiT looks ahead: one whole utterance, its noise from a fixed seed
    assert not token2wav.stream_input and isinstance(token2wav.options["seed"], int)
    assert token2wav.options["factory"] == "omni_trio.models.qwen_omni.token2wav:build_token2wav"


def test_default_pipeline_is_tiny_omni_on_vllm() -> None:
    path = default_pipeline_path()
    assert path.name == "tiny-omni.yaml" and path.is_file()
    cfg = load_config(path)
    assert [s.backend for s in cfg.stages] == ["vllm", "vllm", "torch"]
    assert cfg.stage("thinker").engine_args["model"] == "tiny:thinker"
    assert cfg.stage("talker").engine_args["model"] == "tiny:talker"
    assert cfg.stage("talker").default_sampling_params["ignore_eos"] is True


def test_unknown_pipeline_name() -> None:
    with pytest.raises(ConfigError, match="no shipped pipeline 'nope'"):
        pipeline_path("nope")


async def test_scripted_twin_streams_audio(tmp_path: Path) -> None:
    cfg = load_config(
        pipeline_path("tiny-omni-scripted"),
        stage_overrides={"code2wav": {"options": {"cache_dir": str(tmp_path)}}},
    )
    audio: list[np.ndarray] = []
    kinds: list[str] = []
    with trio.fail_after(120):  # hang guard only (real worker threads)
        async with omni_trio.open_engine(cfg) as engine:
            async with engine.generate("hello world") as stream:
                async for out in stream:
                    kinds.append(out.kind)
                    if out.stage_id == "code2wav":
                        audio.append(out.data)
            rate = await engine.collective_rpc("sample_rate", stage_ids=["code2wav"])
            stats = engine.statistics()
    assert "text" in kinds and kinds[-1] == "audio"
    # the scripted talker makes 64 codes: 64 * 160 samples at 16 kHz, in several chunks
    assert sum(len(a) for a in audio) == 64 * 160 and len(audio) >= 4
    assert all(a.dtype == np.float32 for a in audio)
    assert rate == [16_000]
    assert stats.requests_in_flight == 0 and stats.stage_requests_in_flight == 0
