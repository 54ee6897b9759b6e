"""PNG encoding of image outputs: what an output's data may be, the size syntax, the files."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from omni_trio.errors import StageError
from omni_trio.images import (
    image_list,
    is_preview,
    output_images,
    parse_size,
    png_bytes,
    write_png,
)
from omni_trio.outputs import OmniOutput


def pixels(*shape: int) -> np.ndarray:
    return np.arange(np.prod(shape), dtype=np.uint64).reshape(shape).astype(np.uint8)


def test_a_batch_splits_into_its_images_and_one_image_is_a_batch_of_one():
    batch = pixels(2, 4, 6, 3)
    images = image_list(batch)
    assert len(images) == 2 and all(i.shape == (4, 6, 3) for i in images)
    assert np.array_equal(images[1], batch[1])
    (one,) = image_list(batch[0])
    assert np.array_equal(one, batch[0])
    assert [i.shape for i in image_list(pixels(1, 2, 2, 4))] == [(2, 2, 4)]  # RGBA
    assert [i.shape for i in image_list(pixels(1, 2, 2, 1))] == [(2, 2, 1)]  # grey


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ([[[[0, 0, 0]]]], "numpy uint8 array"),
        ("a picture", "not str"),
        (np.zeros((1, 2, 2, 3), np.float32), "uint8 pixels, not float32"),
        (np.zeros((2, 3), np.uint8), "not (2, 3)"),
        (np.zeros((1, 2, 2, 2), np.uint8), "not (1, 2, 2, 2)"),
        (np.zeros((1, 0, 2, 3), np.uint8), "not (1, 0, 2, 3)"),
        (np.zeros((1, 1, 2, 2, 3), np.uint8), "not (1, 1, 2, 2, 3)"),
    ],
)
def test_data_that_is_not_images_is_named(data, says):
    with pytest.raises(ValueError, match="an image output's data must") as caught:
        image_list(data)
    assert says in str(caught.value)


def test_an_outputs_images_or_a_stage_error_naming_stage_and_request():
    good = OmniOutput("r1", "image", 1, "image", data=pixels(1, 2, 2, 3), finished=True)
    assert len(output_images(good)) == 1
    aborted = OmniOutput("r1", "image", 1, "image", finished=True, finish_reason="abort")
    assert output_images(aborted) == []
    bad = OmniOutput("r1", "painter", 1, "image", data=b"png?")
    with pytest.raises(StageError, match="stage 'painter' .* not images") as caught:
        output_images(bad)
    assert caught.value.stage_id == "painter" and caught.value.request_id == "r1"
    assert isinstance(caught.value.__cause__, ValueError)


def test_previews_are_told_by_their_metrics():
    assert is_preview({"preview": True, "step": 3})
    assert not is_preview({"steps": 20, "compute_s": 0.1})
    assert not is_preview(None) and not is_preview({})


@pytest.mark.parametrize(("text", "size"), [("512x768", (512, 768)), ("8x16", (8, 16))])
def test_sizes_are_width_x_height(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "text",
    [
        "512",
        "512*512",
        "0x512",
        "512x0",
        "-8x8",
        "x8",
        "8x",
        "²x8",
        "1e3x8",
        " 8x8",
        "8X8",
        "123456x8",
    ],
)
def test_a_size_not_width_x_height_is_refused(text):
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        parse_size(text)


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_png_round_trips_the_pixels(channels, tmp_path):
    image = pixels(5, 7, channels)
    decoded = np.asarray(Image.open(io.BytesIO(png_bytes(image))))
    assert decoded.shape[:2] == (5, 7)
    assert np.array_equal(decoded.reshape(image.shape), image)
    path = tmp_path / "deep" / "one.png"
    write_png(path, image)  # its directory made
    assert path.read_bytes() == png_bytes(image)
