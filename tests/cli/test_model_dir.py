"""``--model DIR`` of ``run`` and ``serve``: which stages it points at the checkpoint, which it
leaves alone, and the errors it gives before any engine starts."""

from __future__ import annotations

import subprocess
import sys
import wave
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_trio.cli.args import UsageError
from omni_trio.cli.main import main
from omni_trio.cli.model_dir import (
    check_model_dir,
    load_config_with_model,
    model_overrides,
    pipeline_model,
)
from omni_trio.pipelines import pipeline_path

from ..conftest import engine_seconds
from .test_main import one_line_error, pipeline


def shipped(name: str) -> dict[str, Any]:
    raw = yaml.safe_load(pipeline_path(name).read_text())
    assert isinstance(raw, dict)
    return raw


@pytest.fixture
def checkpoint(tmp_path: Path) -> str:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


def test_qwen3_omni_points_all_three_stages_at_the_directory():
    raw = shipped("qwen3-omni")
    assert pipeline_model(raw) == "tiny:qwen3-omni"
    assert model_overrides(raw, "/m") == {
        "thinker": {"engine_args": {"model": "/m"}},
        "talker": {"options": {"model": "/m"}},
        "code2wav": {"options": {"model": "/m"}},
    }


@pytest.mark.slow  # loading checks the vllm stage's engine_args against vLLM (imports it)
def test_loaded_with_the_overrides_only_the_model_changes(checkpoint):
    cfg = load_config_with_model("qwen3-omni", checkpoint)
    default = load_config_with_model("qwen3-omni", None)
    thinker, talker, code2wav = cfg.stages
    assert thinker.engine_args == {**default.stages[0].engine_args, "model": checkpoint}
    assert thinker.engine_args["language_model_only"] is True  # deep-merged, not replaced
    assert talker.options == {**default.stages[1].options, "model": checkpoint}
    assert code2wav.options == {**default.stages[2].options, "model": checkpoint}
    assert [s.default_sampling_params for s in cfg.stages] == [
        s.default_sampling_params for s in default.stages
    ]
    assert cfg.source == default.source  # errors still name the pipeline's file


def test_only_stages_naming_the_pipelines_model_change():
    # tiny-omni: the thinker's model is the pipeline's; the talker loads another one and
    # code2wav names its weights, not a model
    assert model_overrides(shipped("tiny-omni"), "/m") == {
        "thinker": {"engine_args": {"model": "/m"}}
    }


def test_a_tokenizer_naming_the_model_follows_it_and_another_stays():
    raw = {
        "name": "p",
        "stages": [
            {"id": "a", "backend": "vllm", "engine_args": {"model": "m", "tokenizer": "m"}},
            {"id": "b", "backend": "vllm", "engine_args": {"model": "m", "tokenizer": "t"}},
            {"id": "c", "backend": "scripted", "options": {"model": "m"}},
        ],
    }
    assert model_overrides(raw, "/d") == {
        "a": {"engine_args": {"model": "/d", "tokenizer": "/d"}},
        "b": {"engine_args": {"model": "/d"}},
    }


@pytest.mark.parametrize(
    "raw",
    [
        {"name": "p", "stages": [{"id": "a", "backend": "scripted"}]},
        {"name": "p", "stages": [{"id": "a", "backend": "vllm", "engine_args": {}}]},
        {"name": "p"},
    ],
)
def test_a_pipeline_naming_no_model_is_a_usage_error(raw):
    with pytest.raises(UsageError, match="pipeline 'p' has no stage naming a model"):
        model_overrides(raw, "/d")


def test_the_directory_must_be_a_checkpoint(tmp_path, checkpoint):
    assert check_model_dir(checkpoint) == str(Path(checkpoint).resolve())
    with pytest.raises(UsageError, match="--model .*nope: no such directory"):
        check_model_dir(str(tmp_path / "nope"))
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="not a directory"):
        check_model_dir(str(tmp_path / "file"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="not a model checkpoint directory .*no config.json"):
        check_model_dir(str(tmp_path / "empty"))


@pytest.mark.parametrize("command", [["run", "--prompt", "hi"], ["serve"]])
def test_a_missing_directory_fails_before_any_engine_starts(tmp_path, capsys, command):
    name, *rest = command
    missing = str(tmp_path / "nope")
    assert main([name, "qwen3-omni", *rest, "--model", missing]) == 2
    err = capsys.readouterr().err
    assert one_line_error(err) == f"omni-trio: error: --model {missing}: no such directory"
    assert "ready in" not in err  # no stage started


def test_a_pipeline_without_a_model_fails_naming_it(tmp_path, capsys, checkpoint):
    assert main(["run", pipeline(tmp_path), "--prompt", "hi", "--model", checkpoint]) == 2
    assert "pipeline 'two' has no stage naming a model" in one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("command", ["run", "serve"])
def test_help_shows_the_flag(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--model DIR" in out and "checkpoint directory" in out


@pytest.mark.vllm
@pytest.mark.slow
def test_run_qwen3_omni_on_a_checkpoint_directory(tmp_path):
    from omni_trio.models.tiny import resolve_model

    # the tiny preset's files are a checkpoint directory like any other
    model = resolve_model("tiny:qwen3-omni")
    out = tmp_path / "out"
    argv = ["run", "qwen3-omni", "--model", model, "--prompt", "Hi", "--output-dir", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "omni_trio", *argv],
        capture_output=True,
        text=True,
        timeout=engine_seconds(600),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with wave.open(str(out / "prompt-1.wav")) as w:
        samples = w.getnframes()
        assert w.getframerate() == 24_000
    # whole talker frames (1920 samples each, the last 555 short), through code2wav
    assert samples > 0 and (samples + 555) % 1920 == 0
    assert "thinker (vllm) ready in" in proc.stderr and "Traceback" not in proc.stderr
