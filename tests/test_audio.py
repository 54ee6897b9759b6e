"""WAV encoding of audio outputs (stdlib wave; numpy and torch inputs)."""

from __future__ import annotations

import io
import math
import wave

import numpy as np
import pytest

from omni_trio.audio import (
    concat_audio,
    pcm16_bytes,
    sample_rate_of,
    to_float_list,
    wav_bytes,
    write_wav,
)


def read(data: bytes) -> tuple[wave._wave_params, list[int]]:
    with wave.open(io.BytesIO(data)) as w:
        params = w.getparams()
        frames = w.readframes(params.nframes)
    return params, [int.from_bytes(frames[i : i + 2], "little", signed=True)
                    for i in range(0, len(frames), 2)]  # fmt: skip


def test_pcm16_scales_clips_and_silences_nan():
    pcm = pcm16_bytes([0.0, 1.0, -1.0, 0.5, 3.0, -7.0, math.nan])
    values = [int.from_bytes(pcm[i : i + 2], "little", signed=True) for i in range(0, 14, 2)]
    assert values == [0, 32767, -32767, 16384, 32767, -32767, 0]


def test_wav_round_trip_is_mono_pcm16_at_the_given_rate():
    samples = [math.sin(2 * math.pi * 440 * t / 16000) for t in range(1600)]
    params, values = read(wav_bytes(samples))
    assert (params.nchannels, params.sampwidth, params.framerate) == (1, 2, 16000)
    assert params.nframes == 1600
    assert values[0] == 0 and max(values) > 32000
    params, _ = read(wav_bytes(samples, sample_rate=24000))
    assert params.framerate == 24000
    with pytest.raises(ValueError, match="sample_rate must be > 0"):
        wav_bytes(samples, sample_rate=0)


def test_concat_joins_numpy_torch_and_lists_and_skips_none():
    torch = pytest.importorskip("torch")
    chunks = [
        np.array([0.1, 0.2], dtype=np.float32),
        None,
        torch.tensor([[0.3], [0.4]]),
        [0.5, [0.6]],
        0.7,
    ]
    got = concat_audio(chunks)
    assert got == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], abs=1e-6)
    with pytest.raises(TypeError, match="numeric samples, not str"):
        to_float_list("abc")


def test_write_wav_writes_a_file(tmp_path):
    path = tmp_path / "a.wav"
    assert write_wav(path, [0.0] * 10, 8000) == 10
    params, _ = read(path.read_bytes())
    assert params.nframes == 10 and params.framerate == 8000


def test_sample_rate_from_metrics_then_options_then_default():
    assert sample_rate_of({"sample_rate": 24000}, {"sample_rate": 8000}) == 24000
    assert sample_rate_of(None, {"sample_rate": 8000}) == 8000
    assert sample_rate_of({"sample_rate": "fast"}, None) == 16000
    assert sample_rate_of(None) == 16000
