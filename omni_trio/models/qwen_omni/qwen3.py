"""``tiny:qwen3-omni``: the whole Qwen3-Omni architecture (MoE thinker with its audio and
vision towers, MoE talker with its code predictor, code2wav), shrunk, with seeded random
weights and the family's tokenizer, saved as a normal Hugging Face checkpoint.

The sizes keep what the serving path needs: a head size vLLM's CPU attention runs (64), an
M-RoPE section that sums to half of it, a talker vocabulary of codebook + 1024 (generate()
suppresses the top 1024 ids), codec ids at the real model's offsets from the codebook, and a
code predictor as wide as the talker (it reads the talker's hidden state). Two fields the
config classes lack but the modules read are set (``shared_expert_intermediate_size``,
the talker's ``spatial_merge_size``), and two vLLM's vision tower reads
(``image_size``, ``apply_vit_abs_pos_embed``): vLLM builds that tower even when it serves
text only.

Weights are float32: greedy decoding in bfloat16 diverges from float32 at the first token on
this model, and the golden test compares the pipeline with transformers' float32 generate().
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .recipe import FamilySpec, build_checkpoint

__all__ = ["build_qwen3_omni", "make_config"]

_CODEBOOK = 64
_HIDDEN = 128
_MROPE = [12, 10, 10]
_LLM_STD = 0.25
#: the vocoder's last convolution: the residual blocks before it grow the signal ~15x
_LAST_CONV = "code2wav.decoder.6.conv.weight"


def make_config(ids: dict[str, int], vocab_size: int) -> Any:
    """The tiny ``Qwen3OmniMoeConfig`` for a tokenizer with these ids."""
    from transformers import Qwen3OmniMoeConfig

    rope = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": _MROPE,
        "interleaved": True,
        "mrope_interleaved": True,
    }
    moe = {"moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2}
    llm = {
        "hidden_size": _HIDDEN,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": _HIDDEN // 2,
        "initializer_range": _LLM_STD,
        "rms_norm_eps": 1e-6,
    }
    thinker_text = {
        **llm,
        **moe,
        "vocab_size": vocab_size,
        "max_position_embeddings": 1024,
        "rope_parameters": rope,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "tie_word_embeddings": False,
        "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    audio = {
        "num_mel_bins": 128, "encoder_layers": 1, "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64, "d_model": 32, "output_dim": _HIDDEN,
        "downsample_hidden_size": 32, "n_window": 50, "n_window_infer": 100,
        "max_source_positions": 1500, "initializer_range": 0.02,
    }  # fmt: skip
    vision = {
        "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "out_hidden_size": _HIDDEN, "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0], "initializer_range": 0.02,
        # (image_size / patch_size)^2 == num_position_embeddings
        "image_size": 128, "apply_vit_abs_pos_embed": True,
    }  # fmt: skip
    media = {
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "position_id_per_seconds": 13,
    }
    thinker = {
        **media,
        "text_config": thinker_text,
        "audio_config": audio,
        "vision_config": vision,
        "audio_end_token_id": ids["<|audio_end|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "user_token_id": ids["user"],
        "seconds_per_chunk": 2,
        "initializer_range": _LLM_STD,
    }
    c = _CODEBOOK
    talker_text = {
        **llm,
        **moe,
        "vocab_size": c + 1024,
        "max_position_embeddings": 4096,
        "rope_parameters": rope,
        "shared_expert_intermediate_size": 128,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    }
    predictor = {
        **llm,
        "vocab_size": c,
        "num_hidden_layers": 1,
        "num_code_groups": 16,
        "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }
    talker = {
        **media,
        "text_config": talker_text,
        "code_predictor_config": predictor,
        "num_code_groups": 16,
        "thinker_hidden_size": _HIDDEN,
        "accept_hidden_layer": 2,
        "spatial_merge_size": 2,
        "speaker_id": {"chelsie": c + 253, "ethan": c + 254, "aiden": c + 255},
        "initializer_range": _LLM_STD,
        # the real model's offsets from its codebook (2048 + k)
        "codec_pad_id": c + 100,
        "codec_bos_id": c + 101,
        "codec_eos_token_id": c + 102,
        "codec_nothink_id": c + 107,
        "codec_think_bos_id": c + 108,
        "codec_think_eos_id": c + 109,
    }
    code2wav = {
        "codebook_size": c, "hidden_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_quantizers": 16, "sliding_window": 72, "max_position_embeddings": 8000,
        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }  # fmt: skip
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"],
        system_token_id=ids["system"],
        user_token_id=ids["user"],
        assistant_token_id=ids["assistant"],
        architectures=["Qwen3OmniMoeForConditionalGeneration"],
    )


def _seeded_init(model: Any, seed: int) -> None:
    """Our own init from one generator over sorted names, independent of transformers'
    init order: LLM parts N(0, 0.25) (well separated greedy logits); the vocoder
    N(0, 1/sqrt(fan_in)) so its output is not stuck at the clamp; norms 1, biases 0,
    SnakeBeta alpha/beta 0 (log scale), LayerScale 0.01."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and leaf == "weight" and p.dim() == 1:
                p.fill_(1.0)
            elif leaf in ("bias", "alpha", "beta"):
                p.zero_()
            elif leaf == "scale":
                p.fill_(0.01)
            elif name.startswith("code2wav."):
                fan_in = p[0].numel() if p.dim() > 1 else p.numel()
                gain = 0.03 if name == _LAST_CONV else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * (gain / math.sqrt(fan_in)))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * _LLM_STD)


def _check_forward(model: Any, ids: dict[str, int]) -> None:
    """One thinker forward and one vocoder decode, finite: a build that cannot run fails
    here, not in the first request."""
    import torch

    prompt = torch.tensor([[ids["<|im_start|>"], ids["user"], ids["newline"], ids["<|im_end|>"]]])
    with torch.no_grad():
        logits = model.thinker(input_ids=prompt).logits
        wav = model.code2wav(torch.zeros((1, 16, 2), dtype=torch.long))
    if not (torch.isfinite(logits).all() and torch.isfinite(wav).all()):
        raise RuntimeError("the tiny Qwen3-Omni built non-finite outputs")


def build_qwen3_omni(spec: FamilySpec, out: Path, *, label: str, progress: bool) -> None:
    """Write the tiny checkpoint into ``out`` (an empty directory). Blocking, ~2 s."""
    build_checkpoint(
        spec.family,
        spec.seed,
        spec.dtype,
        out,
        label=label,
        progress=progress,
        model_class="Qwen3OmniMoeForConditionalGeneration",
        make_config=make_config,
        init=_seeded_init,
        check=_check_forward,
        parts=("thinker", "talker", "code2wav"),
    )
