"""PNG encoding of image stage outputs (numpy and Pillow, the ``diffusion`` extra, imported
on first use).

An image stage (``output_type: image``) emits outputs whose ``data`` is a ``numpy.uint8``
array of shape ``(num_images, height, width, 3)``: non-final previews (metrics
``{"preview": True, "step": k}``) and the final images (``finished=True``). Stages hand
pixels on, and the edges (the command line, the images endpoint) encode files:
:func:`image_list` splits one output's data into images, :func:`png_bytes` /
:func:`write_png` encode one. Every function here is synchronous and never checkpoints;
encoding a large image takes a while, so async callers run it in a worker thread.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import BackendUnavailableError, StageError

if TYPE_CHECKING:
    import numpy
    import numpy.typing as npt

    from .outputs import OmniOutput

__all__ = ["image_list", "is_preview", "output_images", "parse_size", "png_bytes", "write_png"]

_SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})")
#: channels an image may have: grey, RGB, RGBA
_CHANNELS = (1, 3, 4)


def is_preview(metrics: Mapping[str, object] | None) -> bool:
    """Whether an output with these metrics is an intermediate preview, not the image. Pure."""
    return bool(metrics and metrics.get("preview"))


def image_list(data: object) -> list[npt.NDArray[numpy.uint8]]:
    """The images one output carries, each ``(height, width, channels)``: ``data`` is a
    ``uint8`` array of shape ``(num_images, height, width, channels)`` (the image stage
    contract, ``channels`` 3) or one image ``(height, width, channels)``; ``channels`` is 1,
    3 or 4. Pure (views, no copy). Raises ValueError naming what ``data`` is instead,
    BackendUnavailableError without numpy."""
    try:
        import numpy as np
    except ImportError as exc:
        raise BackendUnavailableError(
            "image outputs need numpy: pip install 'omni-trio[diffusion]'"
        ) from exc
    if not isinstance(data, np.ndarray):
        raise ValueError(
            f"an image output's data must be a numpy uint8 array (num_images, height, width, "
            f"3), not {type(data).__name__}"
        )
    if data.dtype != np.uint8:
        raise ValueError(f"an image output's data must be uint8 pixels, not {data.dtype}")
    if data.ndim == 3:
        data = data[None]
    if data.ndim != 4 or data.shape[-1] not in _CHANNELS or 0 in data.shape[1:3]:
        raise ValueError(
            "an image output's data must have shape (num_images, height, width, 3) "
            f"(1 or 4 channels also do), not {data.shape}"
        )
    return list(data)


def output_images(out: OmniOutput) -> list[npt.NDArray[numpy.uint8]]:
    """:func:`image_list` of a request's output (none for an output without data: an
    aborted stage's terminal one). Pure. Raises StageError naming the stage and the request
    when its data is not images (a stage that broke the image contract),
    BackendUnavailableError without numpy."""
    if out.data is None:
        return []
    try:
        return image_list(out.data)
    except ValueError as exc:
        raise StageError(
            f"stage {out.stage_id!r} (output_type image) emitted an output that is not "
            f"images: {exc}",
            stage_id=out.stage_id,
            request_id=out.request_id,
        ) from exc


def parse_size(size: str) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` (OpenAI's ``size``, e.g. ``"512x768"``) -> ``(width, height)``.
    Pure. Raises ValueError naming the expected form."""
    found = _SIZE.fullmatch(size)
    if found is None or 0 in (int(found[1]), int(found[2])):
        raise ValueError(f"a size is WIDTHxHEIGHT in pixels (e.g. 512x512), not {size!r}")
    return int(found[1]), int(found[2])


def png_bytes(image: npt.NDArray[numpy.uint8]) -> bytes:
    """One image (``(height, width, channels)`` uint8, as :func:`image_list` gives) as a PNG
    file's bytes. Blocking (CPU). Raises BackendUnavailableError without Pillow."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise BackendUnavailableError(
            "writing images as PNG needs Pillow: pip install 'omni-trio[diffusion]'"
        ) from exc
    pixels = image[..., 0] if image.shape[-1] == 1 else image
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def write_png(path: Path, image: npt.NDArray[numpy.uint8]) -> None:
    """Write one image as a PNG file at ``path``, creating its directory. Blocking."""
    data = png_bytes(image)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
