"""Shared fixtures. Fast tests run under pytest-trio's ``autojump_clock`` (a MockClock with
autojump_threshold=0): every trio-clock wait in a scripted stage completes instantly."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

import itertools
import textwrap
from collections.abc import Callable

import pytest

_module_ids = itertools.count()


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> Callable[[str], str]:
    """Write Python source as an importable module (a user's backend or input processor,
    named in a config as ``"module:Name"``); returns the module's name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(source: str) -> str:
        name = f"omni_user_module_{os.getpid()}_{next(_module_ids)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return make
