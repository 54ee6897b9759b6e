"""``tiny:diffusion``: a Stable-Diffusion-shaped text-to-image pipeline, shrunk, with seeded
random weights and a locally trained CLIP tokenizer, saved as a diffusers pipeline directory
(``DiffusionPipeline.from_pretrained(dir)`` loads it).

The parts are the ones diffusers' own fast tests assemble (a ``UNet2DConditionModel`` with
cross-attention, an ``AutoencoderKL``, a ``CLIPTextModel``, a DDIM scheduler), sized so that
a 20-step image at the default 64x64 takes a fraction of a second on one CPU core. The VAE
has four levels (a latent is 1/8 of the image side, as in Stable Diffusion), so requests
take the same sizes a real checkpoint does. The scheduler is DDIM with Stable Diffusion's
settings; the pipeline runs it with ``eta`` 0, so an image depends only on its seed.

The weights come from our own seeded generator (fan-in scaled normals, norms at 1, biases
at 0) over the parameters in name order, not from the libraries' init order or the global
RNG. Blocking; torch, transformers, tokenizers and diffusers are imported when called.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from importlib import import_module
from pathlib import Path
from typing import Any

from ...errors import BackendUnavailableError
from ..building import CORPUS_WORDS, save_quietly
from ..progress import report_step
from ..qwen_omni.recipe import FamilySpec

__all__ = ["DEFAULT_SIZE", "build_clip_tokenizer", "build_tiny_diffusion", "import_diffusers"]

#: (height, width) of an image when a request names none: the UNet's sample size times the
#: VAE's scale factor
DEFAULT_SIZE = (64, 64)
_VAE_LEVELS = 4  # a latent is 1/2**(levels - 1) = 1/8 of the image side
_LATENT = DEFAULT_SIZE[0] // 2 ** (_VAE_LEVELS - 1)
_TEXT_HIDDEN = 32
_MAX_TOKENS = 77  # CLIP's context length, as in Stable Diffusion
_BOS, _EOS = "<|startoftext|>", "<|endoftext|>"
#: CLIP's pre-tokenizer split: contractions, letter runs, single digits, other symbol runs
_CLIP_SPLIT = (
    r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"
)


def _corpus(seed: int, n_lines: int = 2000) -> Iterator[str]:
    rng = random.Random(seed)
    for _ in range(n_lines):
        yield " ".join(rng.choice(CORPUS_WORDS) for _ in range(rng.randint(4, 14)))


def build_clip_tokenizer(*, seed: int = 0, max_merges: int = 1024) -> Any:
    """A ``transformers.CLIPTokenizer`` with CLIP's layout: byte-level BPE with ``</w>``
    word ends, lower-cased, ``<|startoftext|>``/``<|endoftext|>`` (also the padding), 77
    tokens. The vocabulary is every byte symbol, alone and word-final, then the merges
    learned on a local corpus (at most ``max_merges``), then the two specials. Blocking
    (well under a second); deterministic for equal arguments."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    # transformers' classes are untyped: held as Any
    transformers: Any = import_module("transformers")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    # CLIP's own normalizer and pre-tokenizer, so the merges are the ones CLIP would learn
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=2 * len(alphabet) + max_merges,
        initial_alphabet=alphabet,
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    merges = [tuple(m) for m in json.loads(tok.to_str())["model"]["merges"]][:max_merges]
    vocab: dict[str, int] = {}
    for symbol in [*alphabet, *(c + "</w>" for c in alphabet), *(a + b for a, b in merges)]:
        vocab.setdefault(symbol, len(vocab))
    for special in (_BOS, _EOS):
        vocab[special] = len(vocab)
    return transformers.CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=_MAX_TOKENS)


def _seeded_init(module: Any, generator: Any) -> None:
    """Fan-in scaled normal weights, norm scales at 1, other vectors at 0, drawn in
    parameter-name order from ``generator``."""
    import torch

    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if param.ndim >= 2:
                fan_in = param[0].numel()
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
            elif "norm" in name and name.endswith("weight"):
                param.fill_(1.0)
            else:
                param.zero_()


def import_diffusers(purpose: str) -> Any:
    """The ``diffusers`` module (held as Any: its classes are loosely typed). Raises
    :class:`BackendUnavailableError` naming ``purpose`` when it is not installed."""
    try:
        import diffusers
    except ImportError as exc:
        raise BackendUnavailableError(
            f"{purpose} needs diffusers ({exc.name}); install 'omni-trio[diffusion]'"
        ) from exc
    return diffusers


def build_tiny_diffusion(spec: FamilySpec, out: Path, *, label: str, progress: bool) -> None:
    """Build the tiny text-to-image pipeline of ``spec`` (its seed and dtype) into ``out``
    with ``save_pretrained``. Blocking (about a second). Raises
    :class:`BackendUnavailableError` without diffusers."""
    import numpy
    import torch

    diffusers = import_diffusers("building the tiny diffusion pipeline")
    transformers: Any = import_module("transformers")

    report_step(label, 1, 4, "training the CLIP tokenizer", echo=progress)
    tokenizer = build_clip_tokenizer()
    vocab = tokenizer.get_vocab()

    report_step(label, 2, 4, f"initialising weights (seed {spec.seed})", echo=progress)
    text_encoder = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            vocab_size=len(vocab),
            hidden_size=_TEXT_HIDDEN,
            intermediate_size=2 * _TEXT_HIDDEN,
            num_attention_heads=2,
            num_hidden_layers=2,
            max_position_embeddings=_MAX_TOKENS,
            bos_token_id=vocab[_BOS],
            eos_token_id=vocab[_EOS],
            pad_token_id=vocab[_EOS],
        )
    )
    unet = diffusers.UNet2DConditionModel(
        sample_size=_LATENT,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=_TEXT_HIDDEN,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    vae = diffusers.AutoencoderKL(
        sample_size=DEFAULT_SIZE[0],
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(8, 16, 16, 16)[:_VAE_LEVELS],
        down_block_types=("DownEncoderBlock2D",) * _VAE_LEVELS,
        up_block_types=("UpDecoderBlock2D",) * _VAE_LEVELS,
        norm_num_groups=4,
    )
    generator = torch.Generator().manual_seed(spec.seed)
    for part in (text_encoder, unet, vae):
        _seeded_init(part, generator)
    scheduler = diffusers.DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe = diffusers.StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    if spec.dtype != "float32":
        pipe.to(getattr(torch, spec.dtype))
    pipe.set_progress_bar_config(disable=True)

    report_step(label, 3, 4, "checking a two-step image", echo=progress)
    image = pipe(
        "a tiny check",
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images
    if image.shape != (1, *DEFAULT_SIZE, 3) or not numpy.isfinite(image).all():
        raise RuntimeError(f"the tiny diffusion pipeline built a {image.shape} or non-finite image")

    report_step(label, 4, 4, f"saving ({spec.dtype})", echo=progress)
    save_quietly(transformers, pipe, out)  # the text encoder's "Writing model shards" bar
