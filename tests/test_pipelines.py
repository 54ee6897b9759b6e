"""The pipelines shipped inside the package: they load, and the scripted twin runs end to end
(scripted thinker and talker, the real tiny torch vocoder); the image pipelines' shape, and the
one-stage pipeline of a diffusers directory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio

import omni_trio
from omni_trio.config import load_config
from omni_trio.config.reading import read_config_file
from omni_trio.errors import ConfigError
from omni_trio.pipelines import default_pipeline_path, pipeline_path
from omni_trio.pipelines.diffusers_dir import diffusion_pipeline, is_diffusers_dir


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


def test_tiny_pd_pipeline_is_one_pair_on_example_connector() -> None:
    from omni_trio.config.pd import pd_pairs

    cfg = load_config(pipeline_path("tiny-pd"))
    assert cfg.stage_ids == ["prefill", "decode"] and cfg.final_output_stages == ["decode"]
    (pair,) = pd_pairs(cfg.stages)
    assert (pair.prefill, pair.decode, pair.connector) == ("prefill", "decode", "ExampleConnector")
    assert not pair.kv_params_required  # ExampleConnector finds the cache by the prompt
    prefill, decode = (s.engine_args for s in cfg.stages)
    # the same engine but for the connector's role, and the decode's counter unambiguous
    assert {k: v for k, v in prefill.items() if k != "kv_transfer_config"} == {
        k: v for k, v in decode.items() if k not in ("kv_transfer_config", "enable_prefix_caching")
    }
    assert prefill["model"] == "tiny:thinker" and prefill["block_size"] == 32
    assert decode["enable_prefix_caching"] is False
    stores = [a["kv_transfer_config"]["kv_connector_extra_config"] for a in (prefill, decode)]
    assert stores[0] == stores[1]
    # the documented override moves both halves' store
    moved = {"kv_transfer_config": {"kv_connector_extra_config": {"shared_storage_path": "/x"}}}
    cfg = load_config(cfg, stage_overrides={s: {"engine_args": moved} for s in cfg.stage_ids})
    for st in cfg.stages:
        kv = st.engine_args["kv_transfer_config"]
        assert kv["kv_connector_extra_config"] == {"shared_storage_path": "/x"}
        assert kv["kv_connector"] == "ExampleConnector"


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


# -- image pipelines ---------------------------------------------------------------------------


def test_tiny_image_is_one_diffusion_stage_stepped_with_default_sampling():
    raw = read_config_file(pipeline_path("tiny-image"))
    assert raw["name"] == "tiny-image"
    (stage,) = raw["stages"]
    assert stage["backend"] == "diffusion" and stage["output_type"] == "image"
    assert stage["final_output"] is True
    assert stage["options"] == {"model": "tiny:diffusion", "execution": "step"}
    assert stage["default_sampling_params"] == {"num_inference_steps": 20, "guidance_scale": 7.5}


def test_tiny_llm_image_renders_the_llms_text():
    raw = read_config_file(pipeline_path("tiny-llm-image"))
    llm, image = raw["stages"]
    assert llm["backend"] == "vllm" and llm["engine_args"]["model"] == "tiny:thinker"
    assert image["inputs"] == ["llm"] and image["backend"] == "diffusion"
    assert image["input_processor"] == "omni_trio.models.diffusion.handoff:image_prompt"
    assert image["processor_options"] == {"prompt_source": "llm"}
    assert image["options"]["model"] == "tiny:diffusion"


@pytest.mark.parametrize("name", ["tiny-image", "tiny-llm-image"])
def test_image_pipelines_load(name: str) -> None:
    cfg = load_config(pipeline_path(name))
    assert cfg.stage("image").output_type == "image"
    assert "image" in cfg.final_output_stages


def test_a_diffusers_directory_is_a_one_stage_diffusion_pipeline(tmp_path: Path) -> None:
    model = tmp_path / "sd-tiny"
    model.mkdir()
    assert not is_diffusers_dir(model)
    (model / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    assert is_diffusers_dir(model) and is_diffusers_dir(str(model))
    assert not is_diffusers_dir(model / "model_index.json")  # a file, not a directory
    assert not is_diffusers_dir(tmp_path / "missing")
    config = diffusion_pipeline(str(model))
    assert config == {
        "name": "sd-tiny",
        "stages": [
            {
                "id": "image",
                "backend": "diffusion",
                "options": {"model": str(model)},
                "output_type": "image",
                "final_output": True,
                "default_sampling_params": {"num_inference_steps": 20, "guidance_scale": 7.5},
            }
        ],
    }
    assert diffusion_pipeline("/models/sd/", name="served")["name"] == "served"
    assert diffusion_pipeline("/models/sd/")["name"] == "sd"
    # each call is its own: changing one config changes no other
    config["stages"][0]["default_sampling_params"]["seed"] = 1
    assert "seed" not in diffusion_pipeline(str(model))["stages"][0]["default_sampling_params"]


def test_a_diffusers_directorys_pipeline_loads(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text("{}")
    cfg = load_config(diffusion_pipeline(str(tmp_path)))
    assert cfg.stage_ids == ["image"] and cfg.stage("image").options["model"] == str(tmp_path)
