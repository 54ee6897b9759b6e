"""Qwen2.5-Omni's token2wav as a ``torch`` backend module: a whole utterance of codec codes in,
24 kHz audio out (:mod:`omni_trio.backends.torch.backend`).

token2wav is a DiT that integrates mel frames from noise (10 Runge-Kutta steps, guided by the
codes, a voice's speaker embedding and reference mel), then a BigVGAN vocoder: 480 samples
per code (2 mel frames of 240). The DiT attends to blocks ahead of a frame, so it does not
stream: the module takes the whole utterance (``hop_length = None``; the stage runs with
``stream_input: false``) and batches only utterances of one length.

The noise is the one input that is not a code. transformers draws it from torch's global
generator; here each utterance draws it from its own generator seeded with the ``seed``
option, so the same codes give the same waveform whatever else runs in the process, and a
batch row equals its utterance decoded alone (rows are decoded one by one, as generate()
does). With ``seed`` s this is generate()'s waveform after ``torch.manual_seed(s)``: the
same draw. The voice is the ``speaker`` option (one per stage: the torch backend passes no
per-request parameter to a module).

Options: ``model`` (a checkpoint directory or ``tiny:`` preset; required), ``speaker``
(default ``chelsie``), ``seed`` (default 0), ``num_steps`` (default 10, generate()'s).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from typing import Any

from ...errors import BackendUnavailableError, ConfigError
from .checkpoint import load_part, module_checkpoint
from .qwen25_talker import read_speakers

try:
    import torch
    from torch import nn
except ImportError as _exc:  # pragma: no cover - exercised only without the torch extra
    raise BackendUnavailableError(
        f"omni_trio.models.qwen_omni.token2wav needs torch ({_exc}); pip install 'omni-trio[torch]'"
    ) from _exc

__all__ = ["Token2WavModule", "build_token2wav", "dit_sample"]

_OPTIONS = {"model", "speaker", "seed", "num_steps"}
#: generate()'s token2wav defaults
_GUIDANCE_SCALE = 0.5
_SWAY_COEFFICIENT = -1.0


def _int_option(options: Mapping[str, Any], key: str, default: int, low: int) -> int:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"token2wav: {key} must be an int >= {low}, got {value!r}")
    return value


def build_token2wav(options: Mapping[str, Any]) -> Token2WavModule:
    """The torch-backend module for the checkpoint ``options["model"]``. Blocking. Raises
    :class:`ConfigError` for a missing model, an unknown option or voice, a bad ``seed`` or
    ``num_steps``, or a checkpoint that is not Qwen2.5-Omni."""
    from transformers import Qwen2_5OmniToken2WavModel

    seed = _int_option(options, "seed", 0, 0)
    num_steps = _int_option(options, "num_steps", 10, 2)
    speaker = options.get("speaker", "chelsie")
    if not isinstance(speaker, str):
        raise ConfigError(f"token2wav: speaker must be a string, got {speaker!r}")
    path, config = module_checkpoint("token2wav", options, _OPTIONS, "qwen2_5_omni")
    voices = read_speakers(path)
    voice = voices.get(speaker.lower())
    if voice is None:
        raise ConfigError(f"token2wav: unknown speaker {speaker!r}; speakers are {sorted(voices)}")
    model = load_part(
        Qwen2_5OmniToken2WavModel, config.token2wav_config, path, "token2wav.", torch.float32
    )
    return Token2WavModule(model, voice, seed=seed, num_steps=num_steps)


def dit_sample(
    dit: Any, cond: torch.Tensor, ref_mel: torch.Tensor, codes: torch.Tensor, noise: torch.Tensor,
    num_steps: int,
) -> torch.Tensor:  # fmt: skip
    """``Qwen2_5OmniToken2WavDiTModel.sample`` with its initial noise given (it draws it from
    the global generator): mel frames ``[1, mel, 2 T]`` for ``codes [1, T]``."""
    # transformers' modules are untyped: held as Any
    modeling: Any = import_module("transformers.models.qwen2_5_omni.modeling_qwen2_5_omni")

    cond = cond.unsqueeze(1).repeat(1, noise.shape[1], 1)

    def ode(t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        out = dit(
            hidden_states=h,
            quantized_code=codes,
            speaker_embedding=cond,
            condition_vector=ref_mel,
            time_step=t,
            apply_cfg=True,
        )
        guided, null = torch.chunk(out, 2, dim=0)
        result: torch.Tensor = guided + (guided - null) * _GUIDANCE_SCALE
        return result

    ts = torch.linspace(0, 1, num_steps, dtype=cond.dtype)
    ts += _SWAY_COEFFICIENT * (torch.cos(torch.pi / 2 * ts) - 1 + ts)
    mel: torch.Tensor = modeling.RungeKutta4ODESolver(function=ode, initial_value=noise).integrate(
        ts
    )[-1]
    return mel.permute(0, 2, 1)


class Token2WavModule(nn.Module):
    """``forward(codes [B, T]) -> audio [B, 480 T]`` (see the module docstring)."""

    sample_rate = 24000
    hop_length = None

    def __init__(self, model: Any, voice: Mapping[str, Any], *, seed: int, num_steps: int) -> None:
        super().__init__()
        self.model = model
        self.seed = seed
        self.num_steps = num_steps
        dit = model.code2wav_dit_model
        self.vocab_size = int(dit.config.num_embeds)
        self.max_codes = int(dit.config.max_position_embeddings) // int(dit.repeats)
        self.cond: torch.Tensor = voice["cond"].float().reshape(1, -1)
        self.ref_mel: torch.Tensor = voice["ref_mel"].float()

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.shape[1] > self.max_codes:
            raise ValueError(
                f"token2wav decodes at most {self.max_codes} codes an utterance "
                f"(the DiT's positions), got {codes.shape[1]}"
            )
        dit = self.model.code2wav_dit_model
        wavs = []
        for row in codes:
            gen = torch.Generator().manual_seed(self.seed)
            shape = (1, row.shape[0] * dit.repeats, dit.mel_dim)
            noise = torch.randn(shape, generator=gen, dtype=self.ref_mel.dtype)
            mel = dit_sample(dit, self.cond, self.ref_mel, row[None], noise, self.num_steps)
            wavs.append(self.model.code2wav_bigvgan_model(mel).reshape(-1))
        return torch.stack(wavs)

    def extra_repr(self) -> str:
        return f"seed={self.seed}, num_steps={self.num_steps}, max_codes={self.max_codes}"
