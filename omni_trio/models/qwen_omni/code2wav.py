"""Qwen3-Omni's code2wav as a ``torch`` backend module: frames of 16 codec codes in, 24 kHz
audio out, streamed chunk by chunk (:mod:`omni_trio.backends.torch.backend`).

The talker streams its frames flattened (16 codes a frame, code group 0 first), so the
module takes ``codes [B, 16 * T]`` and declares ``frame_size = 16``. A frame is 1920
samples (80 ms at 24 kHz). The decoder is causal, but its transposed convolutions cannot
finish a frame's last 555 samples without the next frame: decoding T frames yields
``1920 T - 555`` samples. The module therefore returns the decode shifted right by 555
samples (``output_delay``, zeros in front), so that frames ``[s, e)`` map to output samples
``[1920 s, 1920 e)``: utterance samples ``[1920 s - 555, 1920 e - 555)``. The backend drops the
555 leading zeros of the first chunk; the last chunk ends where a one-shot decode ends. A
stream decoded in chunks is then the one-shot waveform, sample for sample up to float
rounding, once the left context covers the decoder's receptive field (``left_context``
frames; 25 by default, transformers' own choice in ``chunked_decode``; the golden test
uses the whole utterance).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import BackendUnavailableError, ConfigError
from .checkpoint import load_part, module_checkpoint

try:
    import torch
    from torch import nn
except ImportError as _exc:  # pragma: no cover - exercised only without the torch extra
    raise BackendUnavailableError(
        f"omni_trio.models.qwen_omni.code2wav needs torch ({_exc}); pip install 'omni-trio[torch]'"
    ) from _exc

__all__ = ["Code2WavModule", "build_code2wav"]

_OPTIONS = {"model", "left_context", "dtype", "device"}


def build_code2wav(options: Mapping[str, Any]) -> Code2WavModule:
    """The torch-backend module for the checkpoint ``options["model"]`` (a directory or a
    ``tiny:`` preset); ``left_context`` (frames, default 25), ``dtype`` (default float32),
    ``device`` (default cpu: the module takes and returns tensors on the CPU and runs the
    decoder there).
    Blocking. Raises :class:`ConfigError` for a missing model, an unknown option or a
    checkpoint that is not Qwen3-Omni."""
    from transformers import Qwen3OmniMoeCode2Wav

    left_context = options.get("left_context", 25)
    if isinstance(left_context, bool) or not isinstance(left_context, int) or left_context < 1:
        raise ConfigError(
            f"code2wav: left_context must be an int >= 1 (frames), got {left_context!r}"
        )
    path, config = module_checkpoint("code2wav", options, _OPTIONS, "qwen3_omni_moe")
    dtype = getattr(torch, str(options.get("dtype", "float32")))
    decoder = load_part(Qwen3OmniMoeCode2Wav, config.code2wav_config, path, "code2wav.", dtype)
    return Code2WavModule(decoder.to(str(options.get("device", "cpu"))), left_context)


class Code2WavModule(nn.Module):
    """``forward(codes [B, 16 T]) -> audio [B, 1920 T]`` (see the module docstring)."""

    sample_rate = 24000

    def __init__(self, decoder: Any, left_context: int) -> None:
        super().__init__()
        self.decoder = decoder
        cfg = decoder.config
        self.frame_size = int(cfg.num_quantizers)
        self.hop_length = int(decoder.total_upsample)
        self.vocab_size = int(cfg.codebook_size)
        self.context_codes = left_context * self.frame_size
        self.device = next(decoder.parameters()).device
        with torch.no_grad():
            probe = torch.zeros((1, self.frame_size, 4), dtype=torch.long, device=self.device)
            n = decoder(probe).shape[-1]
        self.output_delay = 4 * self.hop_length - int(n)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        b, n = codes.shape
        frames = codes.reshape(b, n // self.frame_size, self.frame_size).transpose(1, 2)
        wav = self.decoder(frames.to(self.device))[:, 0].float()
        out: torch.Tensor = nn.functional.pad(wav, (self.output_delay, 0)).cpu()
        return out

    def extra_repr(self) -> str:
        return (
            f"frame_size={self.frame_size}, hop_length={self.hop_length}, "
            f"output_delay={self.output_delay}"
        )
