"""The diffusion backend on the scripted (model-free) step model, under MockClock: both
modes, batching by step, cancellation between steps, previews, failures, bad input,
cleanup. The real tiny model's tests are in tests/models/diffusion."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import numpy as np
import pytest
import trio

from omni_trio import ConfigError, InvalidRequestError, StageError, load_config, open_engine
from omni_trio.backends.diffusion.backend import DiffusionBackend
from omni_trio.testing import assert_nothing_in_flight, cancel_at_every_checkpoint

STEP_S = 1.0  # trio-clock seconds a scripted step takes


def image_pipeline(**options: Any) -> dict[str, Any]:
    return {
        "name": "image",
        "stages": [
            {
                "id": "image",
                "backend": "diffusion",
                "output_type": "image",
                "final_output": True,
                "default_sampling_params": {"num_inference_steps": 4, "guidance_scale": 3.0},
                "options": {"model": "scripted", "scripted_step_s": STEP_S, **options},
            }
        ],
    }


async def describe(engine: Any) -> dict[str, Any]:
    (reply,) = await engine.collective_rpc("describe", stage_ids=["image"])
    return reply


async def generate(engine: Any, prompt: str, **params: Any) -> list[Any]:
    async with engine.generate(prompt, sampling_params=params or None) as stream:
        return [out async for out in stream]


async def image_of(engine: Any, prompt: str, **params: Any) -> Any:
    outs = await generate(engine, prompt, **params)
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    return outs[-1].data


async def solo_images(specs: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    async with open_engine(image_pipeline()) as engine:
        return [await image_of(engine, p, **kw) for p, kw in specs]


SPECS = [
    ("a cat", {"seed": 1}),
    ("a dog", {"seed": 2, "negative_prompt": "blurry"}),
    ("a cat", {"seed": 3, "num_inference_steps": 6}),
    ("a bird", {"seed": 4, "height": 16, "width": 48, "num_images_per_prompt": 2}),
]


async def test_an_image_request_gives_its_seeded_image(autojump_clock):
    async with open_engine(image_pipeline()) as engine:
        outs = await generate(engine, "a cat", seed=7)
        (final,) = outs
        assert final.kind == "image" and final.metrics["steps"] == 4
        image = final.data
        assert isinstance(image, np.ndarray) and image.dtype == np.uint8
        assert image.shape == (1, 32, 32, 3)  # the model's default size
        assert np.array_equal(image, await image_of(engine, "a cat", seed=7))
        assert not np.array_equal(image, await image_of(engine, "a cat", seed=8))
        assert not np.array_equal(image, await image_of(engine, "a dog", seed=7))
        wide = await image_of(engine, "a cat", seed=7, height=16, width=64)
        assert wide.shape == (1, 16, 64, 3)
        assert (await describe(engine))["steps"] == 5 * 4  # five images, one at a time
        assert_nothing_in_flight(engine)


@pytest.mark.parametrize("execution", ["step", "request"])
async def test_the_same_seed_gives_the_same_image_alone_or_batched_in_either_mode(
    autojump_clock, execution
):
    solo = await solo_images(SPECS)
    async with open_engine(image_pipeline(execution=execution)) as engine:
        got: dict[int, Any] = {}

        async def one(i: int) -> None:
            prompt, kw = SPECS[i]
            got[i] = await image_of(engine, prompt, **kw)

        async with trio.open_nursery() as nursery:
            for i in range(len(SPECS)):
                nursery.start_soon(one, i)
        for i, image in enumerate(solo):
            assert np.array_equal(got[i], image), SPECS[i]
        stats = await describe(engine)
        assert stats["largest_batch"] >= 1 and (stats["running"], stats["waiting"]) == (0, 0)
        assert_nothing_in_flight(engine)


async def timed(engine: Any, *requests: tuple[str, float, dict[str, Any]]) -> tuple[dict, dict]:
    """Run ``(prompt, delay, params)`` requests concurrently, each after its delay: when
    each ended (from the start) and its image."""
    start = trio.current_time()
    ends: dict[str, float] = {}
    images: dict[str, Any] = {}

    async def one(name: str, delay: float, params: dict[str, Any]) -> None:
        await trio.sleep(delay)
        images[name] = await image_of(engine, name, **params)
        ends[name] = trio.current_time() - start

    async with trio.open_nursery() as nursery:
        for name, delay, params in requests:
            nursery.start_soon(one, name, delay, params)
    return ends, images


TEN = {"seed": 1, "num_inference_steps": 10}


async def test_step_mode_lets_a_request_join_a_running_one_at_the_next_tick(autojump_clock):
    async with open_engine(image_pipeline(execution="step")) as engine:
        ends, images = await timed(engine, ("first", 0, TEN), ("second", 3.5 * STEP_S, TEN))
        # the second joined the first's steps: both done after 14 ticks, not 20
        assert ends == {"first": pytest.approx(10 * STEP_S), "second": pytest.approx(14 * STEP_S)}
        assert (await describe(engine))["largest_batch"] == 2
    solo = await solo_images([("first", TEN), ("second", TEN)])
    assert np.array_equal(images["first"], solo[0])
    assert np.array_equal(images["second"], solo[1])


async def test_request_mode_runs_a_batch_to_its_end_before_the_next(autojump_clock):
    async with open_engine(image_pipeline(execution="request")) as engine:
        ends, _ = await timed(engine, ("first", 0, TEN), ("second", 3.5 * STEP_S, TEN))
        assert ends == {"first": pytest.approx(10 * STEP_S), "second": pytest.approx(20 * STEP_S)}
        assert (await describe(engine))["largest_batch"] == 1


async def test_another_key_waits_for_the_oldest_running_request_in_step_mode(autojump_clock):
    four = {"seed": 1, "num_inference_steps": 4}
    async with open_engine(image_pipeline(execution="step")) as engine:
        ends, _ = await timed(
            engine,
            ("a", 0, four),
            ("wide", 0.5 * STEP_S, {**four, "width": 64}),
            ("b", 1.5 * STEP_S, four),
        )
        # a runs ticks 1-4; b joins at tick 3 (a's key); then the oldest running one is
        # wide (it came before b): ticks 5-8; b's last two steps wait for it
        assert ends == {
            "a": pytest.approx(4 * STEP_S),
            "wide": pytest.approx(8 * STEP_S),
            "b": pytest.approx(10 * STEP_S),
        }


async def test_previews_arrive_every_n_steps_then_the_image(autojump_clock):
    async with open_engine(image_pipeline(preview_every=2)) as engine:
        outs = await generate(engine, "a cat", seed=5, num_inference_steps=7)
        assert [o.metrics.get("step") for o in outs[:-1]] == [2, 4, 6]
        assert all(o.metrics["preview"] and not o.finished for o in outs[:-1])
        assert outs[-1].finished and outs[-1].metrics["steps"] == 7
        # a preview is the image so far: it differs from the final one
        assert outs[0].data.shape == outs[-1].data.shape
        assert not np.array_equal(outs[0].data, outs[-1].data)
        # previews are extra outputs: the image is the one without previews
        async with open_engine(image_pipeline()) as plain:
            assert np.array_equal(
                outs[-1].data, await image_of(plain, "a cat", seed=5, num_inference_steps=7)
            )


@pytest.mark.parametrize("steps_before_abort", range(6))
async def test_an_abort_stops_a_request_at_the_next_step_and_the_other_is_unchanged(
    autojump_clock, steps_before_abort
):
    cfg = image_pipeline(execution="step", preview_every=1)
    async with open_engine(cfg) as engine:
        other: list[Any] = []

        async def neighbour() -> None:
            other.append(await image_of(engine, "neighbour", seed=9, num_inference_steps=8))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(neighbour)
            params = {"num_inference_steps": 8}
            async with engine.generate("victim", sampling_params=params) as stream:
                for _ in range(steps_before_abort):  # a preview after each step
                    await stream.receive()
            # leaving the block aborted it: at most the step running then ends
        stats = await describe(engine)
        victim_steps = stats["request_steps"] - 8
        assert steps_before_abort <= victim_steps <= steps_before_abort + 1
        assert (stats["running"], stats["waiting"], stats["images"]) == (0, 0, 1)
        (solo,) = await solo_images([("neighbour", {"seed": 9, "num_inference_steps": 8})])
        assert np.array_equal(other[0], solo)
        assert_nothing_in_flight(engine)


async def test_a_request_finishing_in_the_tick_its_neighbour_is_cancelled_keeps_its_image(
    autojump_clock,
):
    async with open_engine(image_pipeline(execution="step")) as engine:
        kept: list[Any] = []

        async def finisher() -> None:
            kept.append(await image_of(engine, "kept", seed=2, num_inference_steps=3))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(finisher)
            with trio.move_on_after(2.5 * STEP_S):  # inside the third (last) tick
                await generate(engine, "cancelled", seed=3, num_inference_steps=3)
        (solo,) = await solo_images([("kept", {"seed": 2, "num_inference_steps": 3})])
        assert np.array_equal(kept[0], solo)
        assert (await describe(engine))["images"] == 1
        assert_nothing_in_flight(engine)


async def test_cancel_at_every_checkpoint_of_a_diffusion_request(autojump_clock):
    async def scenario(engine: Any) -> None:
        outs = await generate(engine, "a cat", seed=1, num_inference_steps=3)
        assert [o.finished for o in outs] == [False, False, True]  # 2 previews, the image

    def nothing_held(engine: Any) -> None:
        (replica,) = engine.pools["image"].replicas
        assert isinstance(replica, DiffusionBackend)
        assert "running=0 waiting=0" in repr(replica), replica

    async with open_engine(image_pipeline(preview_every=1)) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario, invariant=nothing_held)
        report.raise_if_failed()
        assert report.runs == report.checkpoints + 1 >= 5


async def test_a_failed_step_fails_the_requests_of_that_step_only(autojump_clock):
    async with open_engine(image_pipeline(scripted_fail_at_step=3)) as engine:
        errors: list[BaseException] = []

        async def failing(name: str) -> None:
            try:
                await generate(engine, name, seed=1, num_inference_steps=5)
            except StageError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(failing, "one")
            nursery.start_soon(failing, "two")
        assert len(errors) == 2
        assert all("denoise step 3 failed" in str(e) for e in errors)
        assert all("scripted failure" in str(e.__cause__ or e) for e in errors)
        # the replica serves on: a request that never reaches step 3
        image = await image_of(engine, "short", seed=1, num_inference_steps=2)
        assert image.shape == (1, 32, 32, 3)
        stats = await describe(engine)
        assert (stats["running"], stats["waiting"]) == (0, 0)
        assert_nothing_in_flight(engine)


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"steps": 3}, "unknown sampling param(s) ['steps']"),
        ({"height": 30}, "multiples of 8"),
        ({"num_inference_steps": 0}, "num_inference_steps must be an integer >= 1"),
        ({"guidance_scale": -1}, "guidance_scale must be a number >= 0"),
        ({"seed": "x"}, "seed must be an integer >= 0"),
        ({"negative_prompt": 3}, "negative_prompt must be text"),
    ],
)
async def test_bad_sampling_params_fail_that_request_naming_the_param(
    autojump_clock, params, named
):
    async with open_engine(image_pipeline()) as engine:
        async with trio.open_nursery() as nursery:
            good: list[Any] = []

            async def bystander() -> None:
                good.append(await image_of(engine, "fine", seed=1))

            nursery.start_soon(bystander)
            with pytest.raises(InvalidRequestError, match="invalid diffusion input") as info:
                await generate(engine, "bad", **params)
            assert named in str(info.value)
        assert good[0].shape == (1, 32, 32, 3)
        assert_nothing_in_flight(engine)


async def test_token_ids_are_refused(autojump_clock):
    async with open_engine(image_pipeline()) as engine:
        with pytest.raises(InvalidRequestError, match="takes a text prompt, not token ids"):
            await generate(engine, [1, 2, 3])


def test_bad_options_are_named_at_load():
    cfg = image_pipeline(execution="sometimes")
    with pytest.raises(ConfigError, match=r"stages\[0\]\.options"):
        load_config(cfg)
    cfg = image_pipeline(steps_per_tick=2)
    with pytest.raises(ConfigError, match="steps_per_tick"):
        load_config(cfg)


async def test_scripted_options_on_a_real_model_are_refused(autojump_clock):
    cfg = image_pipeline(model="tiny:diffusion", scripted_step_s=1.0)
    with pytest.raises(ConfigError, match="scripted_step_s applies to model scripted only"):
        async with open_engine(cfg):
            pass


@pytest.mark.slow  # 1,200 requests: seconds, kept out of the fast suite
async def test_memory_stays_flat_over_a_thousand_aborted_requests(autojump_clock):
    async with open_engine(image_pipeline(execution="step")) as engine:

        async def aborted(i: int) -> None:
            with trio.move_on_after(1.5 * STEP_S):
                await generate(engine, f"r{i}", seed=i, num_inference_steps=50)

        async def batch(n: int) -> None:
            for start in range(0, n, 50):
                async with trio.open_nursery() as nursery:
                    for i in range(start, start + 50):
                        nursery.start_soon(aborted, i)

        await batch(200)  # warm up: caches, free lists
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            await batch(1000)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        stats = await describe(engine)
        assert (stats["running"], stats["waiting"]) == (0, 0)
        # far below a latent per request (4 KiB here): nothing of an aborted request stays
        assert grown < 1000 * 256, f"{grown} bytes kept over 1,000 aborted requests"
        assert_nothing_in_flight(engine)
