"""The vLLM general plugin that makes the processes spawned for an engine exit quickly."""

from __future__ import annotations

import multiprocessing
from importlib.metadata import entry_points

import pytest

from omni_trio.stages._vllm_plugin import QUICK_EXIT_ENV, quick_exit_enabled, register

from ..conftest import engine_seconds


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
    # a pool that does not answer in time raises TimeoutError; leaving it kills its process
    with ctx.Pool(1) as pool:
        assert pool.apply_async(_enabled).get(engine_seconds(60)) is True
    monkeypatch.setenv(QUICK_EXIT_ENV, "0")
    with ctx.Pool(1) as pool:
        assert pool.apply_async(_enabled).get(engine_seconds(60)) is False


@pytest.mark.slow  # a spawned process
def test_a_quick_exit_keeps_the_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(QUICK_EXIT_ENV, "1")
    proc = multiprocessing.get_context("spawn").Process(target=_child_exits_with, args=(3,))
    proc.start()
    proc.join(engine_seconds(60))
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError(f"the spawned process did not exit in {engine_seconds(60):g} s")
    assert proc.exitcode == 3
