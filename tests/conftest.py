"""Shared fixtures. Fast tests run under pytest-trio's ``autojump_clock`` (a MockClock with
autojump_threshold=0): every trio-clock wait in a scripted stage completes instantly."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
