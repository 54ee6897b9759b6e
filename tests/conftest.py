"""Shared fixtures. Fast tests run under pytest-trio's ``autojump_clock`` (a MockClock with
autojump_threshold=0): every trio-clock wait in a scripted stage completes instantly."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

import itertools
import sys
import textwrap
import threading
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


# -- a hung test reports its trio tasks -----------------------------------------------------
# pytest-timeout (pyproject: timeout, thread method) ends a hung run with every *thread's*
# stack; a test hung in trio shows only trio's epoll wait there. HANG_REPORT_LEAD_S before it
# fires, this prints where each live trio task is suspended: the await chain that hangs.
HANG_REPORT_LEAD_S = 30.0


def _trio_task_stacks() -> list[str]:
    import gc
    import inspect

    import trio

    lines = []
    # a frozen heap (serve_engine freezes it while serving) hides from gc.get_objects() every
    # task that existed when it froze; the test is about to fail on its timeout anyway
    gc.unfreeze()
    # read from this timer thread while trio's thread waits: a report, never a decision
    for task in [o for o in gc.get_objects() if isinstance(o, trio.lowlevel.Task)]:
        coro = task.coro
        if not inspect.iscoroutine(coro) or inspect.getcoroutinestate(coro) == "CORO_CLOSED":
            continue
        lines.append(f"trio task {task.name!r}:")
        for frame, lineno in task.iter_await_frames():
            lines.append(f"  {frame.f_code.co_filename}:{lineno} in {frame.f_code.co_name}")
    return lines


def _report_hang(item: pytest.Item) -> None:
    capman = item.config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)
    lines = _trio_task_stacks() or ["(no live trio task)"]
    print(f"\n+++ {item.nodeid} still runs: its trio tasks +++", file=sys.stderr)
    print("\n".join(lines), file=sys.stderr, flush=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    try:
        timeout = float(item.config.getini("timeout") or 0)
    except ValueError:  # pytest-timeout is not installed: no timeout, no report
        timeout = 0.0
    if timeout <= HANG_REPORT_LEAD_S:
        return (yield)
    timer = threading.Timer(timeout - HANG_REPORT_LEAD_S, _report_hang, args=(item,))
    timer.daemon = True
    timer.start()
    try:
        return (yield)
    finally:
        timer.cancel()
