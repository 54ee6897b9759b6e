"""The tiny diffusion pipeline, built once per session into a private cache."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def diffusion_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("diffusion-cache")


@pytest.fixture(scope="session")
def tiny_diffusion(diffusion_cache: Path) -> Path:
    from omni_trio.models.tiny import ensure_tiny_model

    return ensure_tiny_model("diffusion", cache_dir=diffusion_cache, progress=False)
