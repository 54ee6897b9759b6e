"""The tiny diffusion pipeline, built once per session into a private cache, and the model
the ``diffusion`` backend steps on it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def diffusion_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("diffusion-cache")


@pytest.fixture(scope="session")
def tiny_diffusion(diffusion_cache: Path) -> Path:
    from omni_trio.models.tiny import ensure_tiny_model

    return ensure_tiny_model("diffusion", cache_dir=diffusion_cache, progress=False)


@pytest.fixture(scope="session")
def diffusers_model(tiny_diffusion: Path) -> Any:
    from omni_trio.config.options import DiffusionOptions
    from omni_trio.models.diffusion.diffusers_model import load_denoise_model

    model = load_denoise_model(DiffusionOptions(model=str(tiny_diffusion)))
    model.pipeline.set_progress_bar_config(disable=True)
    return model


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny pipeline's ops are too small for a second thread to pay, and on a loaded
    2-core machine OpenMP threads waiting for each other make a step 10x slower: one thread
    while a test here runs, the process's setting restored after. A test on no model
    (torch not imported by a fixture) does not pay torch's import for it."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
