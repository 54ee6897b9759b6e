"""The LLM -> image route: the diffusion handoff picks the text an image stage renders (the
user's prompt or the LLM's text), on its own (pure) and in an engine: a scripted text stage,
then a diffusion stage on the scripted model (MockClock)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import omni_trio
from omni_trio import StageError, StageOutput
from omni_trio.models.diffusion.handoff import PROMPT_SOURCES, image_prompt
from omni_trio.request.companions import Companion
from omni_trio.stages.processors import load_processor
from omni_trio.testing import (
    assert_nothing_in_flight,
    cancel_at_every_checkpoint,
    scripted_backends,
)

from ...diffusion_helpers import describe, scripted_images, text_to_image_pipeline

UPSTREAM = {
    "llm": [StageOutput(text=" a red "), StageOutput(text="cat ", finished=True)],
    "llm:negative": [StageOutput(text="blurry", finished=True)],  # a CFG companion's
}


def context(prompt: object) -> SimpleNamespace:
    return SimpleNamespace(prompt=prompt)


def test_the_original_prompt_by_default_and_the_llms_text_when_asked():
    made = image_prompt(UPSTREAM, final=True, options={}, context=context("a cat"))
    assert made is not None and made.prompt == "a cat" and made.final
    assert made.source == "llm"  # the companion is no source of the prompt
    made = image_prompt(UPSTREAM, final=True, options={"prompt_source": "llm"}, context=None)
    assert made is not None and made.prompt == "a red cat"  # joined, stripped, no companion
    assert PROMPT_SOURCES == ("original", "llm")


def test_nothing_is_sent_before_every_upstream_stage_finished():
    for source in PROMPT_SOURCES:
        options = {"prompt_source": source}
        assert image_prompt(UPSTREAM, final=False, options=options, context=context("x")) is None


@pytest.mark.parametrize(
    ("options", "ctx", "upstream", "says"),
    [
        ({"prompt_source": "both"}, context("x"), UPSTREAM, "prompt_source must be one of"),
        ({}, None, UPSTREAM, "needs the request context"),
        ({}, context([1, 2, 3]), UPSTREAM, "the request's prompt is list"),
        ({"prompt_source": "llm"}, None, {"llm": [StageOutput(text="  ")]}, "produced no text"),
    ],
)
def test_what_cannot_become_an_image_prompt_is_named(options, ctx, upstream, says):
    with pytest.raises(ValueError, match=says):
        image_prompt(upstream, final=True, options=options, context=ctx)


def test_the_engine_hands_it_the_request_context():
    # loaded as a config names it: called with context= (it declares the keyword)
    assert load_processor("omni_trio.models.diffusion.handoff:image_prompt") is image_prompt


@pytest.mark.parametrize("source", PROMPT_SOURCES)
async def test_the_image_stage_renders_the_prompt_or_the_llms_text(autojump_clock, source):
    async with omni_trio.open_engine(text_to_image_pipeline(source)) as engine:
        outs = await engine.generate(
            "a cat", request_id="r", sampling_params={"image": {"seed": 7}}
        ).collect()
        (llm,) = scripted_backends(engine, "llm")
        llm_text = "".join(o.text for o in outs if o.stage_id == "llm")
        rendered = "a cat" if source == "original" else llm_text.strip()
        (final,) = [o for o in outs if o.stage_id == "image"]
        assert final.kind == "image" and final.finished
        assert np.array_equal(final.data, scripted_images(rendered, seed=7))
        assert not np.array_equal(final.data, scripted_images(f"not {rendered}", seed=7))
        assert llm.completed == ["r"]
        assert_nothing_in_flight(engine)


def expand(prompt, sampling_params):
    return [Companion("negative", "blurry")]


async def test_a_cfg_companion_of_the_llm_stage_never_reaches_the_image_prompt(autojump_clock):
    config = text_to_image_pipeline("llm")
    config.stages[0].prompt_expand = "tests.models.diffusion.test_handoff:expand"
    async with omni_trio.open_engine(omni_trio.load_config(config)) as engine:
        outs = await engine.generate(
            "a cat", request_id="r", sampling_params={"image": {"seed": 1}}
        ).collect()
        llm_text = "".join(o.text for o in outs if o.stage_id == "llm")
        (image,) = [o.data for o in outs if o.stage_id == "image"]
        assert np.array_equal(image, scripted_images(llm_text.strip(), seed=1))
        (llm,) = scripted_backends(engine, "llm")
        assert sorted(llm.completed) == ["r", "r:negative"]  # it ran, beside its parent


async def test_a_bad_processor_option_fails_the_request_naming_the_image_stage(autojump_clock):
    async with omni_trio.open_engine(text_to_image_pipeline("rewrite")) as engine:
        with pytest.raises(StageError, match="prompt_source must be one of") as caught:
            await engine.generate("a cat").collect()
        assert caught.value.stage_id == "image"
        assert await engine.generate("a cat", final_stage_id="llm").collect()  # still serving
        assert_nothing_in_flight(engine)


@pytest.mark.parametrize("step", [1, 2, 4])
async def test_a_failure_at_each_denoise_step_fails_only_its_request(autojump_clock, step):
    config = text_to_image_pipeline(scripted_step_s=0.1, scripted_fail_at_step=step)
    async with omni_trio.open_engine(config) as engine:
        with pytest.raises(StageError, match=f"the denoise step {step} failed") as caught:
            await engine.generate("a cat").collect()
        assert caught.value.stage_id == "image"
        assert_nothing_in_flight(engine)


async def test_cancelled_at_every_checkpoint_of_an_llm_to_image_request(autojump_clock):
    config = text_to_image_pipeline("llm", scripted_step_s=0.1, preview_every=1)

    async def scenario(engine: omni_trio.Engine) -> None:
        async with engine.generate("a cat", sampling_params={"image": {"seed": 1}}) as stream:
            kinds = [o.kind async for o in stream]
        assert kinds.count("image") == 4  # three previews and the image

    async with omni_trio.open_engine(config) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario)
        described = await describe(engine)
    report.raise_if_failed()
    assert report.checkpoints > 5
    assert (described["running"], described["waiting"]) == (0, 0)
    # cancelled runs stopped denoising: far fewer steps than four for every run
    assert described["images"] < report.runs
    assert described["request_steps"] < 4 * report.runs
