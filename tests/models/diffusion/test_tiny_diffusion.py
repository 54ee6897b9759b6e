"""The ``tiny:diffusion`` preset: a diffusers pipeline directory built locally, once per
cache, the same files on every build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_trio.models.tiny import ensure_tiny_model, model_fingerprint, resolve_model

pytestmark = pytest.mark.slow


def test_resolves_to_a_pipeline_directory(tiny_diffusion: Path, diffusion_cache: Path) -> None:
    assert resolve_model("tiny:diffusion", cache_dir=diffusion_cache) == str(tiny_diffusion)
    index = json.loads((tiny_diffusion / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"]
    assert index["scheduler"] == ["diffusers", "DDIMScheduler"]
    assert index["tokenizer"] == ["transformers", "CLIPTokenizer"]


def test_built_once_then_reused(tiny_diffusion: Path, diffusion_cache: Path) -> None:
    weights = tiny_diffusion / "unet" / "diffusion_pytorch_model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ensure_tiny_model("diffusion", cache_dir=diffusion_cache) == tiny_diffusion
    assert weights.stat().st_mtime_ns == stamp
    assert [p.name for p in (diffusion_cache / "tiny").iterdir()] == [tiny_diffusion.name]


def test_rebuild_gives_the_same_files_another_seed_other_weights(
    tiny_diffusion: Path, tmp_path: Path
) -> None:
    again = ensure_tiny_model("diffusion", cache_dir=tmp_path / "a", progress=False)
    assert again.name == tiny_diffusion.name
    assert model_fingerprint(again) == model_fingerprint(tiny_diffusion)
    other = ensure_tiny_model("diffusion", cache_dir=tmp_path / "b", seed=7, progress=False)
    assert model_fingerprint(other) != model_fingerprint(tiny_diffusion)
    unet = Path("unet") / "diffusion_pytorch_model.safetensors"
    assert (other / unet).read_bytes() != (tiny_diffusion / unet).read_bytes()
    tokenizer = Path("tokenizer") / "tokenizer.json"
    assert (other / tokenizer).read_bytes() == (tiny_diffusion / tokenizer).read_bytes()


def test_clip_tokenizer_and_encoder_agree(tiny_diffusion: Path) -> None:
    from transformers import CLIPTextConfig, CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(tiny_diffusion / "tokenizer")
    config = CLIPTextConfig.from_pretrained(tiny_diffusion / "text_encoder")
    assert tok.model_max_length == config.max_position_embeddings == 77
    assert len(tok) == config.vocab_size
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|startoftext|>",
        "<|endoftext|>",
        "<|endoftext|>",
    )
    assert config.eos_token_id == tok.eos_token_id and config.bos_token_id == tok.bos_token_id
    ids = tok("A Tiny cat, on the river!").input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert len(ids) < 20  # merges learned: words are few tokens, not one per byte
    assert tok.decode(ids, skip_special_tokens=True) == "a tiny cat , on the river !"


def test_weights_are_float32(tiny_diffusion: Path) -> None:
    from safetensors import safe_open

    for part in ("unet", "vae"):
        with safe_open(
            str(tiny_diffusion / part / "diffusion_pytorch_model.safetensors"), "pt"
        ) as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
