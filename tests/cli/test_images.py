"""``omni-trio run`` on image pipelines: PROMPT arguments, one PNG per image, previews when
asked, the image flags, what is refused; and a diffusers directory as CONFIG. The image
stage is a ``diffusion`` stage on the scripted model (the shipped ``tiny-image`` needs the
``tiny:diffusion`` model: its own test is marked)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import omni_trio
from omni_trio.cli.args import UsageError, build_parser, parse_command_line
from omni_trio.cli.main import main
from omni_trio.cli.model_dir import check_model_dir, model_overrides
from omni_trio.cli.runner import StageTimer, config_source, run_prompts
from omni_trio.config.reading import read_config_file
from omni_trio.errors import ConfigError
from omni_trio.pipelines import pipeline_path
from omni_trio.testing import cancel_at_every_checkpoint

from ..conftest import engine_seconds
from ..diffusion_helpers import (
    NOT_IMAGES,
    describe,
    image_pipeline,
    needs_tiny_diffusion,
    scripted_images,
)
from .test_main import one_line_error, pipeline, write

IMAGE_YAML = """\
name: images
stages:
  - id: image
    backend: diffusion
    options: {{model: scripted{options}}}
    output_type: image
    final_output: true
    default_sampling_params: {{num_inference_steps: 4, guidance_scale: 7.5}}
"""

LLM_IMAGE_YAML = """\
name: llm-image
stages:
  - id: llm
    backend: scripted
    options: {outputs: 3}
    output_type: text
    final_output: true
  - id: image
    backend: diffusion
    inputs: [llm]
    input_processor: "omni_trio.models.diffusion.handoff:image_prompt"
    processor_options: {prompt_source: llm}
    options: {model: scripted}
    output_type: image
    final_output: true
    default_sampling_params: {num_inference_steps: 2, seed: 9}
"""

NOT_IMAGES_YAML = f"""\
name: images
stages:
  - id: image
    backend: "{NOT_IMAGES}"
    output_type: image
    final_output: true
"""


def images_file(tmp_path: Path, options: str = "") -> str:
    """A one-stage image pipeline file; ``options``: more of the stage's options
    (``", preview_every: 1"``)."""
    return write(tmp_path, IMAGE_YAML.format(options=options), "images.yaml")


def png(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image)


def test_run_writes_one_png_per_prompt_from_a_positional_prompt(tmp_path, capsys):
    out_dir = tmp_path / "out"
    argv = ["run", images_file(tmp_path), "a cat", "--seed", "1"]
    assert main([*argv, "--output-dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert np.array_equal(png(out_dir / "prompt-1.png"), scripted_images("a cat", seed=1)[0])
    assert f"[1] wrote {out_dir / 'prompt-1.png'} (32x32)" in out
    assert sorted(p.name for p in out_dir.iterdir()) == ["prompt-1.png"]  # no preview
    assert "[1] image: " not in out  # no text stage: no text line
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("omni-trio run: 1 prompt(s) through 'images' (image); ")
    assert f"1 PNG file(s) in {out_dir}/" in summary


def test_prompts_come_as_arguments_before_and_after_flags_then_each_prompt_flag(tmp_path, capsys):
    out_dir = tmp_path / "out"
    argv = ["run", images_file(tmp_path), "a cat", "--prompt", "a dog", "--seed", "3"]
    assert main([*argv, "a bird", "--output-dir", str(out_dir)]) == 0
    for n, prompt in enumerate(["a cat", "a bird", "a dog"], 1):
        want = scripted_images(prompt, seed=3)[0]
        assert np.array_equal(png(out_dir / f"prompt-{n}.png"), want), prompt
    assert "[3] prompt: a dog" in capsys.readouterr().out


def test_the_image_flags_become_the_image_stages_sampling_params(tmp_path, capsys):
    out_dir = tmp_path / "out"
    flags = ["--size", "32x8", "--steps", "2", "--num-images", "2", "--seed", "0"]
    flags += ["--negative-prompt", "blurry", "--guidance-scale", "3"]
    assert main(["run", images_file(tmp_path), "a cat", *flags, "--output-dir", str(out_dir)]) == 0
    asked = {"seed": 0, "num_inference_steps": 2, "width": 32, "height": 8}
    asked |= {"num_images_per_prompt": 2, "guidance_scale": 3.0}
    want = scripted_images("a cat", negative_prompt="blurry", **asked)
    assert not np.array_equal(want, scripted_images("a cat", **asked))  # the negative counts
    for i in (1, 2):
        assert np.array_equal(png(out_dir / f"prompt-1-{i}.png"), want[i - 1])
    assert "(32x8)" in capsys.readouterr().out and not (out_dir / "prompt-1.png").exists()


def test_previews_are_written_only_when_asked(tmp_path, capsys):
    path = images_file(tmp_path, ", preview_every: 1")
    quiet, loud = tmp_path / "quiet", tmp_path / "loud"
    assert main(["run", path, "a cat", "--output-dir", str(quiet)]) == 0
    assert sorted(p.name for p in quiet.iterdir()) == ["prompt-1.png"]
    argv = ["run", path, "a cat", "--previews", "--seed", "2", "--output-dir", str(loud)]
    assert main(argv) == 0
    names = ["prompt-1-step1.png", "prompt-1-step2.png", "prompt-1-step3.png", "prompt-1.png"]
    assert sorted(p.name for p in loud.iterdir()) == names
    want = scripted_images("a cat", seed=2, steps=2)[0]
    assert np.array_equal(png(loud / "prompt-1-step2.png"), want)
    assert "4 PNG file(s)" in capsys.readouterr().out


def test_an_llm_to_image_pipeline_prints_the_text_and_writes_the_image_of_it(tmp_path, capsys):
    out_dir = tmp_path / "out"
    config = write(tmp_path, LLM_IMAGE_YAML, "llm-image.yaml")
    assert main(["run", config, "a cat", "--max-tokens", "2", "--output-dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("[1] llm: ")]
    text = line.removeprefix("[1] llm: ")
    assert text.count("llm:") == 2  # --max-tokens went to the text stage
    want = scripted_images(text.strip(), seed=9, num_inference_steps=2)[0]
    assert np.array_equal(png(out_dir / "prompt-1.png"), want)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "give a prompt: omni-trio run CONFIG PROMPT"),
        ([""], "a prompt must not be empty"),
        (["x", "--size", "12"], "--size: a size is WIDTHxHEIGHT"),
        (["x", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["x", "--num-images", "0"], "--num-images must be >= 1, got 0"),
        (["x", "--seed", "-1"], "--seed must be >= 0, got -1"),
        (["x", "--guidance-scale", "-1"], "--guidance-scale must be >= 0, got -1.0"),
        (["x", "--max-tokens", "4"], "--max-tokens: pipeline 'images' has no text stage"),
    ],
)
def test_bad_run_arguments_are_one_line_usage_errors(tmp_path, capsys, argv, says):
    assert main(["run", images_file(tmp_path), *argv, "--output-dir", str(tmp_path)]) == 2
    assert says in one_line_error(capsys.readouterr().err)
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("flag", [["--seed", "1"], ["--previews"]])
def test_image_flags_on_a_pipeline_without_an_image_stage_are_refused(tmp_path, capsys, flag):
    assert main(["run", pipeline(tmp_path), "hi", *flag]) == 2
    assert "pipeline 'two' has no image stage" in one_line_error(capsys.readouterr().err)


def test_an_unknown_flag_after_the_prompts_is_still_refused(capsys):
    parser = build_parser()
    args = parse_command_line(parser, ["run", "cfg", "--seed", "3", "a", "b"])
    assert (args.prompts, args.seed) == (["a", "b"], 3)
    with pytest.raises(SystemExit) as exited:
        parse_command_line(parser, ["run", "cfg", "a", "--sead", "3"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --sead 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_command_line(parser, ["validate", "cfg", "extra"])  # only run takes prompts


def test_a_failing_image_stage_is_a_one_line_runtime_error(tmp_path, capsys):
    out_dir = tmp_path / "out"
    config = images_file(tmp_path, ", scripted_fail_at_step: 2")
    assert main(["run", config, "a cat", "--output-dir", str(out_dir)]) == 1
    line = one_line_error(capsys.readouterr().err)
    assert "StageError" in line and "the denoise step 2 failed" in line
    assert not out_dir.exists()


def test_a_stage_whose_images_are_not_images_is_named(tmp_path, capsys):
    out_dir = tmp_path / "out"
    config = write(tmp_path, NOT_IMAGES_YAML, "not-images.yaml")
    assert main(["run", config, "a cat", "--output-dir", str(out_dir)]) == 1
    line = one_line_error(capsys.readouterr().err)
    assert "StageError: stage 'image' (output_type image) emitted an output that is not" in line
    assert "not str" in line and not out_dir.exists()


async def test_run_prompts_cancelled_at_every_checkpoint_leaves_nothing(tmp_path):
    # the real clock: the PNGs are written in worker threads, which an autojump clock would
    # jump over (straight to the harness's run timeout)
    runs = iter(range(10_000))

    async def scenario(engine: omni_trio.Engine) -> None:
        out_dir = tmp_path / str(next(runs))
        written = await run_prompts(
            engine,
            ["a cat"],
            out_dir,
            None,
            StageTimer(),
            image_params={"num_images_per_prompt": 2},
            previews=True,
            out=io.StringIO(),
        )
        assert [p.name for p in written][-2:] == ["prompt-1-1.png", "prompt-1-2.png"]

    config = image_pipeline(preview_every=2)
    async with omni_trio.open_engine(config) as engine:
        report = await cancel_at_every_checkpoint(
            engine, scenario, settle_timeout=engine_seconds(60)
        )
        described = await describe(engine)
    report.raise_if_failed()
    assert report.checkpoints > 5
    assert (described["running"], described["waiting"]) == (0, 0)


def test_a_diffusers_directory_is_a_config_argument(tmp_path, capsys):
    model = tmp_path / "sd"
    model.mkdir()
    with pytest.raises(ConfigError, match="a directory, but no diffusers pipeline"):
        config_source(str(model))
    (model / "model_index.json").write_text("{}")
    source = config_source(str(model))
    assert isinstance(source, dict) and source["name"] == "sd"
    assert source["stages"][0]["options"] == {"model": str(model.resolve())}
    assert config_source("tiny-image") == str(pipeline_path("tiny-image"))
    assert main(["validate", str(model)]) == 0
    assert "pipeline 'sd', 1 stages: image(diffusion)" in capsys.readouterr().out


def test_model_dir_takes_a_diffusers_directory_for_a_diffusion_stage(tmp_path):
    with pytest.raises(UsageError, match="nor the model_index.json of a diffusers pipeline"):
        check_model_dir(str(tmp_path))
    (tmp_path / "model_index.json").write_text("{}")
    assert check_model_dir(str(tmp_path)) == str(tmp_path.resolve())
    raw = read_config_file(pipeline_path("tiny-image"))
    assert model_overrides(raw, "/m/sd") == {"image": {"options": {"model": "/m/sd"}}}
    # the LLM -> image pipeline's model is its first stage's: the LLM's
    raw = read_config_file(pipeline_path("tiny-llm-image"))
    assert model_overrides(raw, "/m/llm") == {"llm": {"engine_args": {"model": "/m/llm"}}}


@needs_tiny_diffusion
@pytest.mark.slow
def test_run_tiny_image_writes_a_png(tmp_path, capsys):
    out_dir = tmp_path / "out"
    argv = ["run", "tiny-image", "a cat", "--steps", "2", "--seed", "1", "--size", "32x32"]
    assert main([*argv, "--output-dir", str(out_dir)]) == 0
    image = png(out_dir / "prompt-1.png")
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    assert f"wrote {out_dir / 'prompt-1.png'} (32x32)" in capsys.readouterr().out


@needs_tiny_diffusion
@pytest.mark.slow
def test_a_diffusers_directory_runs_as_its_own_pipeline(tmp_path, capsys):
    from omni_trio.models.tiny import resolve_model

    model_dir = resolve_model("tiny:diffusion")  # a diffusers pipeline directory
    out_dir = tmp_path / "out"
    argv = ["run", str(model_dir), "a cat", "--steps", "2", "--seed", "1", "--size", "32x32"]
    assert main([*argv, "--output-dir", str(out_dir)]) == 0
    by_dir = png(out_dir / "prompt-1.png")
    # the same image as the shipped tiny-image pipeline on the same checkpoint
    assert main(["run", "tiny-image", *argv[2:], "--output-dir", str(tmp_path / "named")]) == 0
    assert np.array_equal(by_dir, png(tmp_path / "named" / "prompt-1.png"))
    assert "wrote" in capsys.readouterr().out
