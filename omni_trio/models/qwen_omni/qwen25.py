"""``tiny:qwen2.5-omni``: the whole Qwen2.5-Omni architecture (dense thinker with its audio and
vision towers, the talker, token2wav: a DiT to mel frames and a BigVGAN to audio), shrunk,
with seeded random weights, the family's tokenizer and two seeded voices (``spk_dict.pt``:
``cond``, ``ref_mel`` and the text ``bos_token`` of Chelsie and Ethan), saved as a normal
Hugging Face checkpoint.

The sizes keep what the serving path needs: a head size vLLM's CPU attention runs (64), an
M-RoPE section that sums to half of it, codec ids at the real model's offsets from the
codebook, and a DiT code embedding as large as the talker's vocabulary (a random talker may
emit any id). The thinker config carries ``vision_start_token_id``, which the config class
lacks but the rope index reads. The talker's text specials lie outside its own vocabulary,
as in the real model (transformers warns about it; the talker only looks them up in the
thinker's embedding table).

Weights are float32 (the golden test compares with transformers' float32 generate(); in
bfloat16 vLLM and transformers already differ on this model), token2wav too, as
transformers runs it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .recipe import FamilySpec, build_checkpoint

__all__ = ["SPEAKERS", "build_qwen25_omni", "make_config"]

_CODEBOOK = 64
_HIDDEN = 128
_MROPE = [8, 12, 12]
_LLM_STD = 0.25
#: the vocoder's last convolution: the blocks before it grow the signal ~25x, past the clamp
_LAST_CONV = "token2wav.code2wav_bigvgan_model.conv_post.weight"
#: the voices saved in spk_dict.pt (the real checkpoint's names)
SPEAKERS = ("Chelsie", "Ethan")


def make_config(ids: dict[str, int], vocab_size: int) -> Any:
    """The tiny ``Qwen2_5OmniConfig`` for a tokenizer with these ids."""
    from transformers import Qwen2_5OmniConfig

    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": _MROPE}
    media = {
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
        # not a field of the config class, but get_rope_index reads it
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
    }
    text = {
        "vocab_size": vocab_size, "hidden_size": _HIDDEN, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 1024, "rope_parameters": rope,
        "initializer_range": _LLM_STD, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
        "pad_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
    }  # fmt: skip
    audio = {
        "num_mel_bins": 128, "encoder_layers": 1, "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64, "d_model": 32, "output_dim": _HIDDEN, "n_window": 100,
        "max_source_positions": 1500,
    }  # fmt: skip
    vision = {
        "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "out_hidden_size": _HIDDEN, "fullatt_block_indexes": [0], "patch_size": 14,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
    }  # fmt: skip
    thinker = {
        **media,
        "text_config": text,
        "audio_config": audio,
        "vision_config": vision,
        "user_token_id": ids["user"],
        "initializer_range": _LLM_STD,
    }
    c = _CODEBOOK
    talker = {
        **media,
        "vocab_size": c + 256, "embedding_size": _HIDDEN, "hidden_size": _HIDDEN,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": _HIDDEN // 2, "max_position_embeddings": 4096,
        "rope_parameters": rope, "initializer_range": _LLM_STD,
        "tts_text_start_token_id": ids["<|tts_text_bos|>"],
        "tts_text_end_token_id": ids["<|tts_text_eod|>"],
        "tts_text_pad_token_id": ids["<|tts_text_pad|>"],
        # the real model's offsets from its codebook (8192 + k)
        "tts_codec_pad_token_id": c + 100, "tts_codec_start_token_id": c + 101,
        "tts_codec_end_token_id": c + 102, "tts_codec_mask_token_id": c + 104,
    }  # fmt: skip
    dit = {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 32,
        "ff_mult": 2, "emb_dim": 32, "block_size": 24, "look_ahead_layers": [1],
        "look_backward_layers": [0], "repeats": 2, "num_embeds": c + 256, "mel_dim": 80,
        "dropout": 0.0, "enc_emb_dim": 32, "enc_dim": 32,
        "enc_channels": [16, 16, 16, 16, 48], "enc_kernel_sizes": [5, 3, 3, 3, 1],
        "enc_dilations": [1, 2, 3, 4, 1], "enc_attention_channels": 16, "enc_se_channels": 16,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }  # fmt: skip
    bigvgan = {
        "mel_dim": 80, "upsample_initial_channel": 64, "resblock_kernel_sizes": [3, 7, 11],
        "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        "upsample_rates": [5, 3, 2, 2, 2, 2], "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
    }  # fmt: skip
    return Qwen2_5OmniConfig(
        thinker_config=thinker,
        talker_config=talker,
        token2wav_config={"dit_config": dit, "bigvgan_config": bigvgan},
        enable_audio_output=True,
        architectures=["Qwen2_5OmniForConditionalGeneration"],
    )


def _seeded_init(model: Any, seed: int) -> None:
    """Our own init from one generator over sorted names, independent of transformers'
    init order: LLM parts N(0, 0.25) (well separated greedy logits); token2wav
    N(0, 1/sqrt(fan_in)) with a small last convolution, so the waveform is not stuck at the
    +-1 clamp; norms 1, biases 0, SnakeBeta alpha/beta 0 (log scale)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and leaf == "weight" and p.dim() == 1:
                p.fill_(1.0)
            elif leaf in ("bias", "alpha", "beta"):
                p.zero_()
            elif name.startswith("token2wav."):
                fan_in = p[0].numel() if p.dim() > 1 else p.numel()
                gain = 0.03 if name == _LAST_CONV else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * (gain / math.sqrt(fan_in)))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * _LLM_STD)


def _speakers(config: Any, ids: dict[str, int], seed: int) -> dict[str, dict[str, Any]]:
    """``spk_dict.pt``'s content: per voice the DiT's speaker embedding ``cond``, a
    reference mel ``ref_mel [1, 60, mel]`` and the talker's text ``bos_token``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dit = config.token2wav_config.dit_config
    return {
        name: {
            "cond": torch.randn(dit.enc_emb_dim, generator=gen),
            "ref_mel": torch.randn(1, 60, dit.mel_dim, generator=gen) * 0.5,
            "bos_token": ids[f"<|spk_bos_{name.lower()}|>"],
        }
        for name in SPEAKERS
    }


def _check_forward(model: Any, ids: dict[str, int]) -> None:
    """One thinker forward, one talker forward and one vocoder (BigVGAN) decode, finite: a
    build that cannot run fails here, not in the first request."""
    import torch

    prompt = torch.tensor([[ids["<|im_start|>"], ids["user"], ids["newline"], ids["<|im_end|>"]]])
    with torch.no_grad():
        thinker = model.thinker(input_ids=prompt)
        rows = model.thinker.get_input_embeddings()(prompt)
        talker = model.talker(inputs_embeds=rows, thinker_reply_part=rows[:, :1]).logits
        mel = torch.zeros((1, model.config.token2wav_config.dit_config.mel_dim, 4))
        wav = model.token2wav.code2wav_bigvgan_model(mel)
    if not all(torch.isfinite(t).all() for t in (thinker.logits, talker, wav)):
        raise RuntimeError("the tiny Qwen2.5-Omni built non-finite outputs")


def build_qwen25_omni(spec: FamilySpec, out: Path, *, label: str, progress: bool) -> None:
    """Write the tiny checkpoint and its voices into ``out`` (an empty directory). Blocking,
    ~3 s."""
    import torch

    model, ids = build_checkpoint(
        spec.family,
        spec.seed,
        spec.dtype,
        out,
        label=label,
        progress=progress,
        model_class="Qwen2_5OmniForConditionalGeneration",
        make_config=make_config,
        init=_seeded_init,
        check=_check_forward,
        parts=("thinker", "talker", "token2wav"),
        # transformers runs token2wav in float32 whatever the rest is
        float32_parts=("token2wav",),
    )
    torch.save(_speakers(model.config, ids, spec.seed + 1), out / "spk_dict.pt")
