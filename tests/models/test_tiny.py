"""Tiny local models: deterministic, cached, atomic builds (real torch/tokenizers, no hub)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from omni_trio.errors import ConfigError
from omni_trio.models import TINY_PRESETS, ensure_tiny_model, model_fingerprint, resolve_model
from omni_trio.models.progress import reporting_to

from ..conftest import run_bounded


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-cache")


@pytest.fixture(scope="module")
def thinker(cache: Path) -> Path:
    return ensure_tiny_model("thinker", cache_dir=cache, progress=False)


def test_import_is_light() -> None:
    code = "import sys, omni_trio.models; print('torch' in sys.modules, 'vllm' in sys.modules)"
    out = run_bounded([sys.executable, "-c", code], 60, "an import of omni_trio.models")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_same_seed_builds_identical_files(thinker: Path, tmp_path: Path) -> None:
    again = ensure_tiny_model("thinker", cache_dir=tmp_path, progress=False)
    assert again != thinker
    assert model_fingerprint(again) == model_fingerprint(thinker)


def test_presets_differ_but_share_vocab(cache: Path, thinker: Path) -> None:
    talker = ensure_tiny_model("talker", cache_dir=cache, progress=False)
    assert talker != thinker
    weights = "model.safetensors"
    assert (talker / weights).read_bytes() != (thinker / weights).read_bytes()
    # the talker takes the thinker's token ids: same tokenizer, same vocab size
    assert (talker / "tokenizer.json").read_bytes() == (thinker / "tokenizer.json").read_bytes()
    cfg_t = json.loads((thinker / "config.json").read_text())
    cfg_k = json.loads((talker / "config.json").read_text())
    assert cfg_t["vocab_size"] == cfg_k["vocab_size"] == 512
    assert cfg_t["hidden_size"] // cfg_t["num_attention_heads"] == 64
    assert cfg_t["max_position_embeddings"] >= 256


def test_model_loads_and_tokenizer_covers_vocab(thinker: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(thinker)
    assert len(tok) == TINY_PRESETS["thinker"].vocab_size
    ids = tok("hello tiny world")["input_ids"]
    assert tok.decode(ids) == "hello tiny world"
    model = AutoModelForCausalLM.from_pretrained(thinker)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512)


def test_cache_is_reused_without_rebuilding(
    cache: Path, thinker: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    before = (thinker / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model("thinker", cache_dir=cache) == thinker
    assert "tiny model" not in capfd.readouterr().err  # no build step was printed
    assert (thinker / "model.safetensors").stat().st_mtime_ns == before


def test_seed_override_builds_a_different_model(cache: Path, thinker: Path) -> None:
    other = ensure_tiny_model("thinker", cache_dir=cache, seed=99, progress=False)
    assert other != thinker
    assert model_fingerprint(other) != model_fingerprint(thinker)


def test_concurrent_builders_agree(tmp_path: Path) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(ensure_tiny_model("talker", cache_dir=tmp_path, progress=False))
        except BaseException as exc:  # collected and re-raised by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 2 and results[0] == results[1]
    # exactly one model directory, no temporary leftovers
    assert [p.name for p in (tmp_path / "tiny").iterdir()] == [results[0].name]


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    # the corpus cannot fill 100k tokens: the build fails inside its temporary directory
    with pytest.raises(ConfigError, match="vocab_size"):
        ensure_tiny_model("thinker", cache_dir=tmp_path, vocab_size=100_000, progress=False)
    assert list((tmp_path / "tiny").iterdir()) == []


def test_bad_presets_and_options() -> None:
    with pytest.raises(ConfigError, match="unknown tiny model preset 'nope'"):
        ensure_tiny_model("nope")
    with pytest.raises(ConfigError, match="head_dim 16"):
        ensure_tiny_model("thinker", hidden_size=32)
    with pytest.raises(ConfigError, match="bad tiny model option"):
        ensure_tiny_model("thinker", no_such_field=1)


def test_resolve_model(cache: Path, thinker: Path) -> None:
    assert resolve_model("tiny:thinker", cache_dir=cache) == str(thinker)
    assert resolve_model("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
    assert resolve_model("some/local/path") == "some/local/path"


def test_weights_are_saved_in_the_dtype_they_run_in(thinker: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(thinker / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"BF16"}  # vLLM loads them without a float32 -> bfloat16 cast
    config = json.loads((thinker / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"


class Steps:
    """A build sink that records what it is told."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int, int, str]] = []

    def step(self, what: str, index: int, total: int, doing: str) -> None:
        self.steps.append((what, index, total, doing))


def test_build_steps_go_to_the_context_sink(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    sink = Steps()
    with reporting_to(sink):
        ensure_tiny_model("talker", cache_dir=tmp_path)
    assert [(i, n) for _, i, n, _ in sink.steps] == [(1, 3), (2, 3), (3, 3), (3, 3)]
    assert {what for what, *_ in sink.steps} == {"tiny model 'talker'"}
    assert sink.steps[-1][3] == "done" and "bfloat16" in sink.steps[2][3]
    assert capfd.readouterr().err == ""  # not on stderr, and no bar of transformers' own


def test_fingerprint_covers_subdirectories(tmp_path: Path) -> None:
    (tmp_path / "unet").mkdir()
    (tmp_path / "model_index.json").write_text("{}")
    (tmp_path / "unet" / "weights").write_bytes(b"1")
    before = model_fingerprint(tmp_path)
    (tmp_path / "unet" / "weights").write_bytes(b"2")
    assert model_fingerprint(tmp_path) != before
