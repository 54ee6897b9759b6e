"""``POST /v1/images/generations`` end to end: a real Hypercorn, the stock ``openai`` client and
httpx, a ``diffusion`` stage on the scripted model (the shipped ``tiny-image`` on
``tiny:diffusion`` is marked)."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import trio
from PIL import Image

from omni_trio.pipelines import pipeline_path
from omni_trio.server.protocol import MAX_IMAGES, RequestValidationError, parse_images
from omni_trio.testing import assert_nothing_in_flight, scripted_backends, scripted_pipeline

from ..conftest import engine_seconds
from ..diffusion_helpers import (
    describe,
    image_pipeline,
    needs_tiny_diffusion,
    not_images_pipeline,
    scripted_images,
    text_to_image_pipeline,
)
from .conftest import admission_event, client_for, running_server, wait_until_idle

URL = "/v1/images/generations"


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def decoded(b64: str | None) -> np.ndarray:
    assert b64 is not None
    raw = base64.b64decode(b64)
    assert raw.startswith(b"\x89PNG\r\n\x1a\n")
    with Image.open(io.BytesIO(raw)) as image:
        return np.asarray(image)


async def test_the_openai_client_gets_b64_pngs_of_the_images():
    async with running_server(image_pipeline()) as (engine, base):
        oai = client(base)
        resp = await oai.images.generate(model="images", prompt="a cat", extra_body={"seed": 1})
        (only,) = resp.data
        assert np.array_equal(decoded(only.b64_json), scripted_images("a cat", seed=1)[0])
        assert only.url is None
        assert isinstance(resp.created, int) and resp.created > 0
        resp = await oai.images.generate(model="images", prompt="a cat")  # no seed: any noise
        assert decoded(resp.data[0].b64_json).shape == (32, 32, 3)

        extras = {"seed": 5, "num_inference_steps": 2, "guidance_scale": 3, "negative_prompt": "x"}
        resp = await oai.images.generate(
            model="images",
            prompt="a dog",
            n=2,
            size="32x8",  # any WIDTHxHEIGHT, not only DALL-E's
            response_format="b64_json",
            extra_body=extras,
        )
        await oai.close()
        asked = {"num_images_per_prompt": 2, "width": 32, "height": 8, **extras}
        want = scripted_images("a dog", **asked)
        assert [decoded(d.b64_json).tolist() for d in resp.data] == want.tolist()
        # every extra counts: without the negative prompt the images differ
        assert not np.array_equal(
            want, scripted_images("a dog", **{**asked, "negative_prompt": None})
        )
        assert engine.statistics().requests_finished == 3
        assert_nothing_in_flight(engine)


async def test_previews_are_not_the_answer():
    async with running_server(image_pipeline(preview_every=1)) as (engine, base):
        async with client_for(base) as http:
            r = await http.post(URL, json={"prompt": "a cat", "n": 3, "seed": 4})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        want = scripted_images("a cat", seed=4, num_images_per_prompt=3)
        assert [decoded(d["b64_json"]).tolist() for d in data] == want.tolist()


async def test_an_llm_to_image_pipeline_renders_the_users_prompt():
    async with running_server(text_to_image_pipeline("original")) as (engine, base):
        oai = client(base)
        resp = await oai.images.generate(model="text-image", prompt="a cat", extra_body={"seed": 2})
        await oai.close()
        want = scripted_images("a cat", seed=2)[0]
        assert np.array_equal(decoded(resp.data[0].b64_json), want)
        (llm,) = scripted_backends(engine, "llm")
        assert len(llm.completed) == 1  # the LLM ran before the image stage


async def test_the_models_card_lists_the_image_task():
    async with running_server(text_to_image_pipeline()) as (_, base), client_for(base) as http:
        (card,) = (await http.get("/v1/models")).json()["data"]
        assert card["supported_tasks"] == ["generate", "image"]


BAD = [
    ({"prompt": "x", "size": "big"}, "size", "WIDTHxHEIGHT"),
    ({"prompt": "x", "size": "0x8"}, "size", "WIDTHxHEIGHT"),
    ({"prompt": "x", "size": 512}, "size", "a string WIDTHxHEIGHT"),
    ({"prompt": "x", "n": 0}, "n", f"n must be an integer from 1 to {MAX_IMAGES}, got 0"),
    ({"prompt": "x", "n": MAX_IMAGES + 1}, "n", "from 1 to"),
    ({"prompt": "x", "n": "2"}, "n", "got '2'"),
    ({"prompt": "x", "n": True}, "n", "got True"),
    ({"prompt": "x", "response_format": "url"}, "response_format", "'url' is not supported"),
    ({"prompt": "x", "response_format": "png"}, "response_format", "use 'b64_json'"),
    ({"prompt": "x", "output_format": "webp"}, "output_format", "encodes 'png'"),
    ({"prompt": "x", "stream": True}, "stream", "not supported for images"),
    ({}, "prompt", "prompt must be a non-empty string"),
    ({"prompt": ""}, "prompt", "non-empty"),
    ({"prompt": ["a", "b"]}, "prompt", "non-empty string"),
    ({"prompt": "x", "seed": -1}, "seed", "seed must be an integer >= 0"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps", ">= 1"),
    ({"prompt": "x", "guidance_scale": "high"}, "guidance_scale", "a number >= 0"),
    ({"prompt": "x", "guidance_scale": float("nan")}, "guidance_scale", "a number >= 0"),
    ({"prompt": "x", "negative_prompt": 3}, "negative_prompt", "must be a string"),
    ({"prompt": "x", "model": "dall-e-3"}, "model", "'dall-e-3' does not exist"),
]


@pytest.mark.parametrize(("body", "param", "says"), BAD)
def test_bad_bodies_are_refused_naming_the_field(body, param, says):
    with pytest.raises(RequestValidationError, match=says) as caught:
        parse_images(body, "images")
    assert caught.value.param == param


def test_a_good_body_maps_onto_the_image_stages_sampling_params():
    body = {"prompt": "a cat", "n": 2, "size": "64x32", "quality": "hd", "user": "u"}
    req = parse_images({**body, "response_format": "b64_json", "output_format": "png"}, "m")
    assert (req.model, req.prompt, req.n) == ("m", "a cat", 2)
    assert req.sampling == {"num_images_per_prompt": 2, "width": 64, "height": 32}
    assert parse_images({"prompt": "a", "size": "auto"}, "m").sampling == {}


async def test_bad_requests_are_400s_and_reach_no_stage():
    async with running_server(image_pipeline()) as (engine, base), client_for(base) as http:
        for body, param, says in [*BAD[:3], BAD[7], BAD[11]]:
            r = await http.post(URL, json={"model": "images", **body})
            assert r.status_code == 400, body
            error = r.json()["error"]
            assert error["param"] == param and says in error["message"]
            assert error["type"] == "invalid_request_error"
        oai = client(base)
        with pytest.raises(openai.BadRequestError, match="'url' is not supported"):
            await oai.images.generate(model="images", prompt="x", response_format="url")
        await oai.close()
        assert engine.statistics().requests_total == 0
        assert_nothing_in_flight(engine)


async def test_a_size_the_model_cannot_make_is_a_400_from_the_stage():
    async with running_server(image_pipeline()) as (engine, base), client_for(base) as http:
        r = await http.post(URL, json={"model": "images", "prompt": "x", "size": "12x12"})
        assert r.status_code == 400, r.text
        assert "multiples of 8" in r.json()["error"]["message"]
        assert engine.statistics().requests_failed == 1
        assert_nothing_in_flight(engine)


async def test_a_pipeline_without_an_image_stage_says_so():
    async with running_server(scripted_pipeline(["llm"], name="text")) as (engine, base):
        async with client_for(base) as http:
            r = await http.post(URL, json={"model": "text", "prompt": "a cat"})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "model"
        assert error["message"] == (
            "the pipeline 'text' has no image output stage (no stage with output_type: image)"
        )
        assert engine.statistics().requests_total == 0


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (image_pipeline(scripted_fail_at_step=3), "the denoise step 3 failed"),
        (not_images_pipeline(), "stage 'image' (output_type image) emitted an output that is not"),
    ],
)
async def test_a_failing_image_stage_is_a_500_naming_it(config, says):
    async with running_server(config) as (engine, base):
        async with client_for(base) as http:
            r = await http.post(URL, json={"prompt": "a cat"})
            assert r.status_code == 500
            error = r.json()["error"]
            assert error["type"] == "server_error" and says in error["message"]
            assert (await http.get("/health")).status_code == 200  # still serving
        assert_nothing_in_flight(engine)


async def test_a_client_that_gives_up_aborts_the_image_request():
    async with running_server(image_pipeline(scripted_step_s=3600)) as (engine, base):
        admitted = admission_event(engine)
        async with client_for(base) as http, trio.open_nursery() as nursery:
            nursery.start_soon(lambda: http.post(URL, json={"prompt": "a cat"}))
            await admitted.wait()
            nursery.cancel_scope.cancel()  # the client goes away while the image denoises
        await wait_until_idle(engine)
        stats = engine.statistics()
        assert stats.requests_aborted == 1 and stats.requests_finished == 0
        described = await describe(engine)
        assert (described["running"], described["waiting"], described["images"]) == (0, 0, 0)
        assert_nothing_in_flight(engine)


@needs_tiny_diffusion
@pytest.mark.slow
async def test_tiny_image_answers_with_pngs():
    async with running_server(str(pipeline_path("tiny-image"))) as (engine, base):
        oai = client(base)
        with trio.fail_after(engine_seconds(120)):
            resp = await oai.images.generate(
                model="tiny-image",
                prompt="a cat",
                n=2,
                size="32x32",
                extra_body={"num_inference_steps": 2, "seed": 1},
            )
        await oai.close()
        images = [decoded(d.b64_json) for d in resp.data]
        assert [i.shape for i in images] == [(32, 32, 3)] * 2
        assert_nothing_in_flight(engine)
