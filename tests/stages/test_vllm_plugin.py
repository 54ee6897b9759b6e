"""The vLLM general plugin that makes the processes spawned for an engine exit quickly."""

from __future__ import annotations

import multiprocessing
from importlib.metadata import entry_points

import pytest

from omni_trio.stages._vllm_plugin import QUICK_EXIT_ENV, quick_exit_enabled, register


def test_registered_as_a_vllm_general_plugin() -> None:
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins["omni_trio_quick_exit"] == "omni_trio.stages._vllm_plugin:register"


def _child_exits_with(code: int) -> None:
    register()
    register()  # vLLM may load plugins twice in one process
    raise SystemExit(code)


def _enabled() -> bool:
    return quick_exit_enabled()


@pytest.mark.slow  # spawned processes
def test_acts_only_in_spawned_processes_that_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = multiprocessing.get_context("spawn")
    monkeypatch.setenv(QUICK_EXIT_ENV, "1")
    assert not quick_exit_enabled()  # the process that starts engines is left alone
    with ctx.Pool(1) as pool:
        assert pool.apply(_enabled) is True
    monkeypatch.setenv(QUICK_EXIT_ENV, "0")
    with ctx.Pool(1) as pool:
        assert pool.apply(_enabled) is False


@pytest.mark.slow  # a spawned process
def test_a_quick_exit_keeps_the_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(QUICK_EXIT_ENV, "1")
    proc = multiprocessing.get_context("spawn").Process(target=_child_exits_with, args=(3,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 3
