"""The tiny seeded vocoder: determinism, shapes, 16 kHz, causality, the weights cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from omni_trio.errors import ConfigError
from omni_trio.models.progress import reporting_to
from omni_trio.models.vocoder import TinyVocoder, VocoderSpec, build_vocoder, ensure_tiny_vocoder


def decode(module: torch.nn.Module, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return module(codes)


def test_shapes_rate_and_range() -> None:
    module = build_vocoder({})
    assert module.sample_rate == 16_000 and module.hop_length == 160
    assert module.vocab_size == 512 and module.context_codes == 4
    codes = torch.randint(0, 512, (3, 25), generator=torch.Generator().manual_seed(0))
    audio = decode(module, codes)
    assert audio.shape == (3, 25 * 160) and audio.dtype == torch.float32
    assert float(audio.abs().max()) < 1.0  # tanh output
    assert float(audio.std()) > 0.01  # random weights make noise, not silence


def test_same_seed_same_weights_other_seed_differs() -> None:
    codes = torch.arange(0, 512, 7).unsqueeze(0)
    a, b = build_vocoder({"seed": 11}), build_vocoder({"seed": 11})
    assert torch.equal(decode(a, codes), decode(b, codes))
    assert not torch.equal(decode(a, codes), decode(build_vocoder({"seed": 12}), codes))


def test_causal_and_chunk_with_context_matches_one_shot() -> None:
    module = build_vocoder({})
    codes = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    full = decode(module, codes)
    # a prefix decodes to the prefix of the audio: later codes never change earlier samples
    torch.testing.assert_close(decode(module, codes[:, :17]), full[:, : 17 * 160])
    # span [16, 32) with context_codes of left context gives exactly the one-shot samples
    ctx = module.context_codes
    chunk = decode(module, codes[:, 16 - ctx : 32])[:, ctx * 160 :]
    torch.testing.assert_close(chunk, full[:, 16 * 160 : 32 * 160])


def test_weights_cache_is_built_once_and_atomic(tmp_path: Path) -> None:
    path = ensure_tiny_vocoder(tmp_path, seed=5)
    assert path.is_file() and path.parent == tmp_path / "tiny"
    stamp = path.stat().st_mtime_ns
    assert ensure_tiny_vocoder(tmp_path, seed=5) == path
    assert path.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert os.listdir(path.parent) == [path.name]  # no temporary file left behind
    assert ensure_tiny_vocoder(tmp_path, seed=6) != path
    cached = build_vocoder({"weights": "tiny:code2wav", "cache_dir": str(tmp_path), "seed": 5})
    codes = torch.arange(30).unsqueeze(0)
    torch.testing.assert_close(decode(cached, codes), decode(build_vocoder({"seed": 5}), codes))


def test_env_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_TRIO_CACHE", str(tmp_path))
    assert ensure_tiny_vocoder().parent == tmp_path / "tiny"


def test_load_from_path_and_bare_state_dict(tmp_path: Path) -> None:
    spec = VocoderSpec(seed=3, channels=32, upsample=(8, 20))
    module = TinyVocoder(spec)
    module.reset_parameters_seeded(3)
    bare = tmp_path / "bare.pt"
    torch.save(module.state_dict(), bare)
    loaded = build_vocoder({"weights": str(bare), "channels": 32, "upsample": [8, 20]})
    codes = torch.arange(12).unsqueeze(0)
    torch.testing.assert_close(decode(loaded, codes), decode(module, codes))
    with pytest.raises(ConfigError, match="do not fit"):
        build_vocoder({"weights": str(bare)})  # default shape: 64 channels
    file = ensure_tiny_vocoder(tmp_path, seed=3)
    assert build_vocoder({"weights": str(file)}).spec.seed == 3


def test_bad_options_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown vocoder option\(s\) \['bogus'\]"):
        build_vocoder({"bogus": 1})
    with pytest.raises(ConfigError, match="does not exist"):
        build_vocoder({"weights": str(tmp_path / "missing.pt")})
    with pytest.raises(ConfigError, match="unknown tiny vocoder 'tiny:other'"):
        build_vocoder({"weights": "tiny:other"})


def test_build_reports_its_steps(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    steps: list[tuple[str, int, int, str]] = []

    class Sink:
        def step(self, what: str, index: int, total: int, doing: str) -> None:
            steps.append((what, index, total, doing))

    with reporting_to(Sink()):
        ensure_tiny_vocoder(tmp_path, seed=5)
        ensure_tiny_vocoder(tmp_path, seed=5)  # cached: nothing to report
    assert [(i, n, doing.split()[0]) for _, i, n, doing in steps] == [
        (1, 2, "initialising"),
        (2, 2, "saving"),
        (2, 2, "done"),
    ]
    ensure_tiny_vocoder(tmp_path, seed=6, progress=False)  # no sink, told to be quiet
    assert capfd.readouterr().err == ""
