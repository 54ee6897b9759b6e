"""DiffusersModel against diffusers' own pipeline call on the tiny checkpoint: the same image
from prepare / step x N / decode, in a batch or alone, at any step offset."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_trio.config.options import DiffusionOptions
from omni_trio.errors import ConfigError, InvalidRequestError
from omni_trio.models.diffusion.contract import ImageRequest, image_request
from omni_trio.models.diffusion.diffusers_model import (
    DiffusersModel,
    encode_text,
    load_denoise_model,
)

WHERE = "$.stages[1].options"


def request(model: Any, prompt: str = "a tiny cat", **params: object) -> ImageRequest:
    return image_request(prompt, params, default_size=model.default_size)


def run(model: Any, req: ImageRequest) -> np.ndarray:
    state = model.prepare(req)
    while model.steps_done(state) < req.num_inference_steps:
        model.step([state])
    (image,) = model.decode([state])
    return image


def reference(model: Any, req: ImageRequest) -> np.ndarray:
    """diffusers' own pipeline call for ``req``, rounded to uint8 as ``numpy_to_pil`` does."""
    import torch

    out = model.pipeline(
        req.prompt,
        negative_prompt=req.negative_prompt,
        num_inference_steps=req.num_inference_steps,
        guidance_scale=req.guidance_scale,
        generator=torch.Generator().manual_seed(req.seed),
        height=req.height,
        width=req.width,
        num_images_per_prompt=req.num_images,
        output_type="np",
    ).images
    return (out * 255).round().astype(np.uint8)


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape and a.dtype == b.dtype == np.uint8
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is not None, reason="accelerate here")
def test_offload_without_accelerate_is_named_before_anything_loads() -> None:
    options = DiffusionOptions(model="x", device="cuda", enable_model_cpu_offload=True)
    with pytest.raises(ConfigError, match="needs accelerate") as info:
        load_denoise_model(options, where=WHERE)
    assert info.value.path == "$.stages[1].options.enable_model_cpu_offload"


# -- the real tiny pipeline ----------------------------------------------------------------------

slow = pytest.mark.slow


@slow
@pytest.mark.parametrize(
    "params",
    [
        {"num_inference_steps": 20, "guidance_scale": 1.0, "seed": 0},  # no guidance
        {"num_inference_steps": 20, "guidance_scale": 7.5, "seed": 1},  # CFG, empty negative
        {"num_inference_steps": 8, "guidance_scale": 5.0, "seed": 2, "negative_prompt": "a dog"},
        {"num_inference_steps": 6, "seed": 3, "height": 48, "width": 80},
        {"num_inference_steps": 5, "seed": 4, "num_images_per_prompt": 2},
    ],
    ids=["plain", "cfg", "negative", "48x80", "two-images"],
)
def test_same_image_as_the_pipeline_call(diffusers_model: Any, params: dict[str, object]) -> None:
    req = request(diffusers_model, "the river at night", **params)
    ours, theirs = run(diffusers_model, req), reference(diffusers_model, req)
    assert ours.shape == (req.num_images, req.height, req.width, 3)
    assert ours.std() > 20  # an image with contrast: the comparison can fail
    assert max_diff(ours, theirs) <= 1


@slow
def test_guidance_and_negative_prompt_change_the_image(diffusers_model: Any) -> None:
    base = run(diffusers_model, request(diffusers_model, num_inference_steps=6, seed=5))
    neg = request(diffusers_model, num_inference_steps=6, seed=5, negative_prompt="a dog")
    assert max_diff(base, run(diffusers_model, neg)) > 10
    plain = request(diffusers_model, num_inference_steps=6, seed=5, guidance_scale=1.0)
    assert max_diff(base, run(diffusers_model, plain)) > 10


@slow
def test_batched_at_different_steps_equals_alone(diffusers_model: Any) -> None:
    a = request(diffusers_model, "a tiny cat", num_inference_steps=12, seed=7)
    b = request(diffusers_model, "the moon over the city", num_inference_steps=12, seed=8)
    c = request(diffusers_model, "a song", num_inference_steps=12, seed=9, negative_prompt="noise")
    alone = [run(diffusers_model, r) for r in (a, b, c)]
    states = [diffusers_model.prepare(r) for r in (a, b, c)]
    for _ in range(3):  # a starts 3 steps ahead of b and c
        diffusers_model.step(states[:1])
    while diffusers_model.steps_done(states[-1]) < 12:
        diffusers_model.step([s for s in states if diffusers_model.steps_done(s) < 12])
    together = diffusers_model.decode(states)
    for mine, solo in zip(together, alone, strict=True):
        assert max_diff(mine, solo) <= 2


@slow
def test_a_preview_does_not_change_the_result(diffusers_model: Any) -> None:
    req = request(diffusers_model, num_inference_steps=6, seed=11)
    state = diffusers_model.prepare(req)
    previews = []
    for _ in range(6):
        diffusers_model.step([state])
        previews.extend(diffusers_model.decode([state]))
    assert previews[-1].shape == (1, 64, 64, 3)
    assert max_diff(previews[0], previews[-1]) > 10  # a preview is an earlier image
    assert np.array_equal(previews[-1], run(diffusers_model, req))


@slow
def test_same_seed_same_image_random_seed_recorded(diffusers_model: Any) -> None:
    req = request(diffusers_model, num_inference_steps=4, seed=21)
    first = run(diffusers_model, req)
    assert np.array_equal(first, run(diffusers_model, req))
    other = request(diffusers_model, num_inference_steps=4, seed=22)
    assert max_diff(first, run(diffusers_model, other)) > 10
    unseeded = request(diffusers_model, num_inference_steps=4)
    a, b = diffusers_model.prepare(unseeded), diffusers_model.prepare(unseeded)
    assert a.seed != b.seed  # a random seed each, recorded on the state
    for _ in range(4):
        diffusers_model.step([a])
    again = request(diffusers_model, num_inference_steps=4, seed=a.seed)
    assert np.array_equal(diffusers_model.decode([a])[0], run(diffusers_model, again))


@slow
def test_requests_the_model_cannot_take(diffusers_model: Any) -> None:
    base = request(diffusers_model, num_inference_steps=2, seed=1)
    # image_request checks multiples of 8; a model whose VAE scales by more checks its own
    bad = ImageRequest(**{**_fields(base), "height": 60})
    with pytest.raises(InvalidRequestError, match="multiples of 8 .*not 60x64"):
        diffusers_model.prepare(bad)
    with pytest.raises(InvalidRequestError, match="at most 1000 .*num_train_timesteps"):
        diffusers_model.prepare(request(diffusers_model, num_inference_steps=1001))
    done = diffusers_model.prepare(base)
    diffusers_model.step([done])
    diffusers_model.step([done])
    with pytest.raises(ValueError, match="no denoise step left"):
        diffusers_model.step([done])
    wide = diffusers_model.prepare(request(diffusers_model, width=128, num_inference_steps=2))
    fresh = diffusers_model.prepare(base)
    with pytest.raises(ValueError, match="different latent shapes"):
        diffusers_model.step([fresh, wide])
    assert diffusers_model.steps_done(fresh) == diffusers_model.steps_done(wide) == 0
    diffusers_model.step([])  # nothing to do
    assert diffusers_model.decode([]) == []


def _fields(req: ImageRequest) -> dict[str, Any]:
    return {name: getattr(req, name) for name in ImageRequest.__slots__}


@slow
def test_states_of_different_sizes_decode_together(diffusers_model: Any) -> None:
    small = request(diffusers_model, num_inference_steps=3, seed=5, height=32, width=32)
    large = request(diffusers_model, num_inference_steps=3, seed=6, width=96)
    states = [diffusers_model.prepare(r) for r in (small, large)]
    for s in states:
        for _ in range(3):
            diffusers_model.step([s])
    images = diffusers_model.decode(states)
    assert [i.shape for i in images] == [(1, 32, 32, 3), (1, 64, 96, 3)]
    assert max_diff(images[1], run(diffusers_model, large)) <= 1


@slow
def test_own_encoding_matches_encode_prompt(diffusers_model: Any) -> None:
    import torch

    pipe = diffusers_model.pipeline
    with torch.inference_mode():
        ours = encode_text(pipe, "the sun and the moon", torch.device("cpu"))
        theirs, _ = pipe.encode_prompt("the sun and the moon", "cpu", 1, False)
    assert ours.shape == theirs.shape == (1, 77, 32)
    assert torch.equal(ours, theirs)


@slow
def test_describe_and_repr(diffusers_model: Any, tiny_diffusion: Path) -> None:
    info = diffusers_model.describe()
    assert info["pipeline"] == "StableDiffusionPipeline"
    assert info["denoiser"] == "UNet2DConditionModel" and info["scheduler"] == "DDIMScheduler"
    assert info["default_size"] == [64, 64] and info["vae_scale_factor"] == 8
    assert info["dtype"] == "float32" and info["device"] == "cpu"
    assert info["model"] == str(tiny_diffusion)
    assert diffusers_model.inline is False and diffusers_model.default_size == (64, 64)
    before = repr(diffusers_model)
    run(diffusers_model, request(diffusers_model, num_inference_steps=1, seed=0))
    assert repr(diffusers_model) != before and "forwards=" in before


@slow
def test_memory_flags_are_applied_and_keep_the_image(
    tiny_diffusion: Path, diffusers_model: Any
) -> None:
    flagged = load_denoise_model(
        DiffusionOptions(
            model=str(tiny_diffusion),
            enable_attention_slicing=True,
            enable_vae_slicing=True,
            enable_vae_tiling=True,
        )
    )
    vae = flagged.pipeline.vae
    assert vae.use_slicing and vae.use_tiling
    processors = {type(p).__name__ for p in flagged.pipeline.unet.attn_processors.values()}
    assert processors == {"SlicedAttnProcessor"}
    req = request(diffusers_model, num_inference_steps=4, seed=3)
    assert max_diff(run(flagged, req), run(diffusers_model, req)) <= 1


@slow
def test_load_errors_name_the_option(tmp_path: Path, tiny_diffusion: Path) -> None:
    with pytest.raises(ConfigError, match=r"no model_index\.json") as info:
        load_denoise_model(DiffusionOptions(model=str(tmp_path)), where="$.s")
    assert info.value.path == "$.s.model"
    with pytest.raises(ConfigError, match="cannot move to device 'nowhere'") as info:
        load_denoise_model(DiffusionOptions(model=str(tiny_diffusion), device="nowhere"))
    assert info.value.path == "$.device"


@slow
def test_pipelines_it_cannot_step_are_refused(diffusers_model: Any) -> None:
    from diffusers import (
        DDPMPipeline,
        DDPMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
        UNet2DModel,
    )

    unconditional = DDPMPipeline(
        unet=UNet2DModel(
            sample_size=8,
            block_out_channels=(8, 16),
            norm_num_groups=4,
            down_block_types=("DownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "UpBlock2D"),
        ),
        scheduler=DDPMScheduler(),
    )
    with pytest.raises(ConfigError, match=r"DDPMPipeline without \['tokenizer', 'text_encoder', "):
        DiffusersModel(unconditional)
    parts = diffusers_model.pipeline.components
    distilled = UNet2DConditionModel.from_config({**parts["unet"].config, "time_cond_proj_dim": 8})
    lcm_like = StableDiffusionPipeline(**{**parts, "unet": distilled})
    with pytest.raises(ConfigError, match="time_cond_proj_dim=8"):
        DiffusersModel(lcm_like, source="lcm")
