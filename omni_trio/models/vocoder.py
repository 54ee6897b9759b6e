"""A tiny seeded vocoder: integer codes (the talker's 512-token vocabulary) -> 16 kHz audio.

It is the ``code2wav`` stage of the embedded ``tiny-omni`` pipeline. Its weights are random
(drawn from a seeded generator), so the waveform it makes is noise-like: it is there to give
the torch backend a real module with the right shapes, costs and streaming behaviour, not to
speak. Same seed and spec -> bit-identical weights on every machine.

Architecture (:class:`TinyVocoder`), one frame per code, ``hop_length`` = 160 samples per
frame (10 ms at 16 kHz)::

    codes [B, T] -> embedding -> 2 x causal conv1d(kernel 3) + tanh      frames [B, C, T]
                 -> conv-transpose(stride 10) + tanh -> conv-transpose(stride 16) + tanh
                 -> samples [B, T * 160] in (-1, 1)

The convolutions are causal (frame ``t`` depends on codes ``t - 4 .. t`` only) and every
transposed convolution has ``kernel == stride``, so frames never overlap. Two consequences the
torch backend relies on: right-padding a batch changes nothing in the real frames, and a chunk
of codes decoded with ``context_codes`` (4) codes of left context gives exactly the samples
that a one-shot decode gives for that chunk.

Weights are cached as ``<cache>/tiny/code2wav-<spec hash>.pt`` (``$OMNI_TRIO_CACHE``, default
``~/.cache/omni-trio``), written atomically by :func:`ensure_tiny_vocoder`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailableError, ConfigError
from .progress import report_step
from .tiny import default_cache_dir

try:
    import torch
    from torch import nn
except ImportError as _exc:  # pragma: no cover - exercised only without the torch extra
    raise BackendUnavailableError(
        f"omni_trio.models.vocoder needs torch ({_exc}); pip install 'omni-trio[torch]'"
    ) from _exc

__all__ = [
    "TINY_VOCODER_REF",
    "TinyVocoder",
    "VocoderSpec",
    "build_vocoder",
    "ensure_tiny_vocoder",
]

#: the ``weights:`` value that means "the tiny seeded vocoder, built into the cache"
TINY_VOCODER_REF = "tiny:code2wav"
#: bump when the recipe changes, so stale cache entries are not reused
_RECIPE_VERSION = 1
_DEFAULT_SEED = 2718


@dataclass(frozen=True, slots=True)
class VocoderSpec:
    """What a tiny vocoder is made of. Equal specs build identical weights."""

    seed: int = _DEFAULT_SEED
    vocab_size: int = 512
    channels: int = 64
    sample_rate: int = 16_000
    #: upsampling factors; their product is the hop length (samples per code)
    upsample: tuple[int, ...] = (10, 16)

    @property
    def hop_length(self) -> int:
        return math.prod(self.upsample)

    def digest(self) -> str:
        blob = json.dumps({"recipe": _RECIPE_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


class _CausalConv1d(nn.Conv1d):
    """A conv1d that pads on the left only, so output frame t sees inputs <= t."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = (self.kernel_size[0] - 1) * self.dilation[0]
        return super().forward(nn.functional.pad(x, (pad, 0)))


class TinyVocoder(nn.Module):
    """Codes ``LongTensor[B, T]`` -> samples ``FloatTensor[B, T * hop_length]`` in (-1, 1).

    Implements the torch backend's module protocol (see :mod:`omni_trio.backends.torch.backend`):
    ``forward``, ``sample_rate``, ``hop_length``, ``vocab_size``, ``context_codes``.
    Random weights: the audio is noise-like, which is expected.
    """

    def __init__(self, spec: VocoderSpec | None = None) -> None:
        super().__init__()
        spec = spec or VocoderSpec()
        if spec.vocab_size < 1 or spec.channels < 1 or not spec.upsample:
            raise ConfigError(f"invalid vocoder spec {spec}")
        self.spec = spec
        self.sample_rate = spec.sample_rate
        self.hop_length = spec.hop_length
        self.vocab_size = spec.vocab_size
        c = spec.channels
        self.embed = nn.Embedding(spec.vocab_size, c)
        convs = [_CausalConv1d(c, c, 3), _CausalConv1d(c, c, 3)]
        self.convs = nn.ModuleList(convs)
        #: left context (in codes) a chunk needs to decode exactly as in a one-shot run
        self.context_codes = sum(conv.kernel_size[0] - 1 for conv in convs)
        ups: list[nn.Module] = []
        width = c
        for i, factor in enumerate(spec.upsample):
            out = 1 if i == len(spec.upsample) - 1 else max(width // 2, 1)
            ups.append(nn.ConvTranspose1d(width, out, kernel_size=factor, stride=factor))
            width = out
        self.ups = nn.ModuleList(ups)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        x = self.embed(codes).transpose(1, 2)  # [B, C, T]
        for conv in self.convs:
            x = torch.tanh(conv(x))
        for up in self.ups:
            x = torch.tanh(up(x))
        samples: torch.Tensor = x.squeeze(1)  # [B, T * hop]
        return samples

    def reset_parameters_seeded(self, seed: int) -> None:
        """Draw every weight from ``torch.Generator().manual_seed(seed)`` (independent of the
        global RNG and of module construction order). Does not checkpoint."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(self.named_parameters()):
                if name.endswith("bias"):
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
                    continue
                if name.startswith("embed"):
                    fan_in = 1
                elif name.startswith("ups"):
                    fan_in = param.shape[0]  # kernel == stride: one tap per output sample
                else:
                    fan_in = param.shape[1] * param.shape[2]
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))

    def __repr__(self) -> str:
        return (
            f"TinyVocoder(vocab={self.vocab_size}, channels={self.spec.channels}, "
            f"hop={self.hop_length}, sample_rate={self.sample_rate}, seed={self.spec.seed})"
        )


def _spec_from(options: Mapping[str, Any]) -> VocoderSpec:
    known = {f.name for f in fields(VocoderSpec)}
    unknown = set(options) - known
    if unknown:
        raise ConfigError(
            f"unknown vocoder option(s) {sorted(unknown)}; known: {sorted(known)} "
            f"plus weights, cache_dir"
        )
    values = dict(options)
    if "upsample" in values:
        values["upsample"] = tuple(int(f) for f in values["upsample"])
    return VocoderSpec(**values)


def ensure_tiny_vocoder(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    seed: int = _DEFAULT_SEED,
    progress: bool = True,
    **spec_overrides: Any,
) -> Path:
    """Return the weights file of the tiny vocoder for ``seed``, building it on first use.

    Blocking (a build takes well under a second; call it from a worker thread in async
    code). The file is written to a temporary sibling and renamed into place, so a crash
    never leaves a half-written file and concurrent builders all end with one complete file.
    ``spec_overrides`` replace other :class:`VocoderSpec` fields. A build reports its steps
    like the tiny models' (:mod:`omni_trio.models.progress`; ``progress=False``: no stderr
    lines). Raises :class:`ConfigError` for an unknown field.
    """
    spec = _spec_from({"seed": seed, **spec_overrides})
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / "tiny" / f"code2wav-{spec.digest()}.pt"
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    what = f"tiny vocoder (seed {spec.seed})"
    report_step(what, 1, 2, "initialising weights", echo=progress)
    module = TinyVocoder(spec)
    module.reset_parameters_seeded(spec.seed)
    report_step(what, 2, 2, "saving (float32, the dtype it runs in)", echo=progress)
    payload = {
        "format": "omni-trio-vocoder",
        "recipe": _RECIPE_VERSION,
        "spec": {**asdict(spec), "upsample": list(spec.upsample)},
        "state_dict": module.state_dict(),
    }
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", dir=final.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        tmp.chmod(0o644)  # mkstemp makes it private; the cache is meant to be shared
        os.replace(tmp, final)  # atomic; a racing builder wrote identical bytes
    finally:
        tmp.unlink(missing_ok=True)
    report_step(what, 2, 2, "done", echo=progress)
    return final


def _load(path: Path, options: Mapping[str, Any]) -> TinyVocoder:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise ConfigError(f"cannot load vocoder weights {str(path)!r}: {exc}") from exc
    if isinstance(payload, dict) and payload.get("format") == "omni-trio-vocoder":
        spec = _spec_from(payload["spec"])
        state = payload["state_dict"]
    elif isinstance(payload, dict):
        spec = _spec_from(options)  # a bare state_dict: the options describe the shape
        state = payload
    else:
        raise ConfigError(
            f"vocoder weights {str(path)!r} hold a {type(payload).__name__}, not a state dict"
        )
    module = TinyVocoder(spec)
    try:
        module.load_state_dict(state)
    except RuntimeError as exc:
        raise ConfigError(f"vocoder weights {str(path)!r} do not fit {spec}: {exc}") from exc
    return module


def build_vocoder(options: Mapping[str, Any] | None = None) -> TinyVocoder:
    """The torch backend factory for the tiny vocoder (``factory:
    "omni_trio.models.vocoder:build_vocoder"``). Blocking; returns the module in eval mode.

    ``options``: ``weights`` (``"tiny:code2wav"``: the cached seeded build; a path: a file
    written by :func:`ensure_tiny_vocoder` or a bare state dict; absent: seeded in memory),
    ``cache_dir``, and :class:`VocoderSpec` fields (``seed``, ``vocab_size``, ...).
    Raises :class:`ConfigError` for unknown options or weights that cannot be loaded.
    """
    opts = dict(options or {})
    weights = opts.pop("weights", None)
    cache_dir = opts.pop("cache_dir", None)
    if weights is None:
        module = TinyVocoder(_spec_from(opts))
        module.reset_parameters_seeded(module.spec.seed)
    elif weights == TINY_VOCODER_REF:
        module = _load(ensure_tiny_vocoder(cache_dir, **opts), {})
    elif isinstance(weights, str) and weights.startswith("tiny:"):
        raise ConfigError(f"unknown tiny vocoder {weights!r}; the only one is {TINY_VOCODER_REF!r}")
    else:
        path = Path(weights).expanduser()
        if not path.is_file():
            raise ConfigError(f"vocoder weights file {str(path)!r} does not exist")
        module = _load(path, opts)
    return module.eval()
