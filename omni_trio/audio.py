"""WAV encoding of audio stage outputs (stdlib ``wave``; numpy used when it is installed).

An audio stage streams chunks of float samples in ``[-1, 1]`` (numpy arrays, torch tensors
or plain sequences) in ``OmniOutput.data``. :func:`concat_audio` joins one request's chunks,
:func:`wav_bytes` / :func:`write_wav` encode them as mono 16-bit PCM WAV. Every function
here is pure and synchronous (no checkpoints).
"""

from __future__ import annotations

import io
import math
import os
import sys
import wave
from array import array
from collections.abc import Iterable, Sequence
from typing import cast

__all__ = [
    "DEFAULT_SAMPLE_RATE",
    "concat_audio",
    "pcm16_bytes",
    "sample_rate_of",
    "to_float_list",
    "wav_bytes",
    "write_wav",
]

DEFAULT_SAMPLE_RATE = 16_000


def to_float_list(chunk: object) -> list[float]:
    """Flatten one audio chunk (array, tensor, nested sequence, scalar) to a list of floats.

    Raises TypeError for values that are not numeric audio (str, bytes, dict)."""
    if chunk is None:
        return []
    if isinstance(chunk, (str, bytes, bytearray, dict)):
        raise TypeError(f"an audio chunk must be numeric samples, not {type(chunk).__name__}")
    if hasattr(chunk, "detach"):  # a torch tensor: no torch import needed
        chunk = chunk.detach().cpu().float().numpy()
    if hasattr(chunk, "ravel") and hasattr(chunk, "tolist"):  # numpy
        return [float(x) for x in chunk.ravel().tolist()]
    if isinstance(chunk, (int, float)):
        return [float(chunk)]
    out: list[float] = []
    for item in cast("Iterable[object]", chunk):  # not iterable: its TypeError
        out.extend(to_float_list(item))
    return out


def concat_audio(chunks: Iterable[object]) -> list[float]:
    """Join audio chunks (``None`` chunks, e.g. a final marker output, are skipped)."""
    samples: list[float] = []
    for chunk in chunks:
        samples.extend(to_float_list(chunk))
    return samples


def pcm16_bytes(samples: Sequence[float]) -> bytes:
    """Float samples in ``[-1, 1]`` -> little-endian signed 16-bit PCM. Out-of-range values
    are clipped; NaN becomes silence (a random-weight vocoder can emit anything)."""
    pcm = array("h")
    for x in samples:
        if math.isnan(x):
            x = 0.0
        x = -1.0 if x < -1.0 else 1.0 if x > 1.0 else x
        pcm.append(int(round(x * 32767.0)))
    if sys.byteorder != "little":
        pcm.byteswap()
    return pcm.tobytes()


def wav_bytes(samples: Sequence[float], sample_rate: int = DEFAULT_SAMPLE_RATE) -> bytes:
    """A complete mono PCM16 WAV file holding ``samples``. Raises ValueError for a
    non-positive sample rate."""
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be > 0, got {sample_rate}")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(pcm16_bytes(samples))
    return buf.getvalue()


def write_wav(
    path: str | os.PathLike[str], samples: Sequence[float], sample_rate: int = DEFAULT_SAMPLE_RATE
) -> int:
    """Write ``samples`` as a mono PCM16 WAV file; returns the number of frames written.
    Raises OSError if the file cannot be written."""
    data = wav_bytes(samples, sample_rate)
    with open(path, "wb") as f:
        f.write(data)
    return len(samples)


def sample_rate_of(metrics: object, options: object = None) -> int:
    """The sample rate an audio stage reports (its output ``metrics`` or stage ``options``
    key ``sample_rate``), else :data:`DEFAULT_SAMPLE_RATE`."""
    for source in (metrics, options):
        if isinstance(source, dict) or hasattr(source, "get"):
            value = source.get("sample_rate") if source is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return DEFAULT_SAMPLE_RATE
