"""The suite's own bounds (tests/conftest.py): a real-engine test that hangs fails alone at its
deadline and the run goes on; one stuck where trio cannot cancel it meets pytest-timeout's
backstop, which ends the run and leaves no process behind; a bounded wait names what it
waited for and the replica that died.

The first two run an inner pytest (a subprocess) on this suite's conftest, with the bounds
scaled down to seconds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest
import trio

import omni_trio
from omni_trio.errors import ReplicaDeadError, StageError
from omni_trio.testing import scripted_pipeline

from .conftest import TIME_SCALE_VAR, EngineWaitTimeout, bounded, engine_seconds, run_bounded

CONFTEST = Path(__file__).with_name("conftest.py")
#: the inner run's scale: its deadline is 6 s, pytest-timeout's backstop 9 s
INNER_SCALE = 0.01

INI = """\
[pytest]
trio_mode = true
timeout = 900
timeout_method = thread
markers =
    vllm: real vLLM engines
    slow: real models or subprocesses
    ray: a local Ray
"""

HANGS_THEN_NEXT = """\
import subprocess

import pytest
import trio


@pytest.mark.vllm
async def test_hangs():
    child = subprocess.Popen(["sleep", "600"])  # left behind by the test
    open("child.pid", "w").write(str(child.pid))
    await trio.Event().wait()  # what a dead engine never sets


@pytest.mark.vllm
async def test_next():
    await trio.sleep(0.01)


async def test_on_the_mock_clock(autojump_clock):
    # a real-time deadline on the autojump clock would be jumped to at once
    await trio.sleep(10**6)
"""

STUCK = """\
import subprocess
import time

import pytest


@pytest.mark.slow
async def test_stuck():
    # a child with a child of its own, then a wait trio cannot cancel
    sh = subprocess.Popen(["sh", "-c", "sleep 600 & echo $! > grandchild.pid; wait"])
    open("child.pid", "w").write(str(sh.pid))
    time.sleep(600)


@pytest.mark.slow
def test_never_reached():
    pass
"""


def inner_run(tmp_path: Path, tests: str) -> tuple[int, str]:
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_inner.py").write_text(tests)
    env = {**os.environ, TIME_SCALE_VAR: str(INNER_SCALE)}
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "test_inner.py"]
    proc = run_bounded(args, 120, "the inner pytest run", cwd=tmp_path, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def alive(pid_file: Path) -> bool:
    try:
        proc = psutil.Process(int(pid_file.read_text()))
        return proc.status() != psutil.STATUS_ZOMBIE and "sleep" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


@pytest.mark.slow
def test_a_hung_test_fails_at_its_deadline_and_the_run_goes_on(tmp_path: Path) -> None:
    rc, out = inner_run(tmp_path, HANGS_THEN_NEXT)
    assert rc == 1, out
    assert "FAILED test_inner.py::test_hangs - " in out
    assert "PASSED test_inner.py::test_next" in out
    assert "PASSED test_inner.py::test_on_the_mock_clock" in out
    assert "1 failed, 2 passed" in out
    # it says where the test waited, and which of its processes it killed
    assert "test_inner.py::test_hangs ran past its deadline of 6 s" in out
    assert "test_inner.py:11 in test_hangs" in out  # the Event's wait
    pid = (tmp_path / "child.pid").read_text()
    assert f"killed the processes it left: {pid} sleep 600" in out
    assert not alive(tmp_path / "child.pid")
    assert "Timeout" not in out  # the backstop never fired


@pytest.mark.slow
def test_a_test_trio_cannot_cancel_meets_the_backstop_which_kills_every_process(
    tmp_path: Path,
) -> None:
    rc, out = inner_run(tmp_path, STUCK)
    assert rc == 1, out
    assert "+++ test_inner.py::test_stuck still runs" in out
    assert "Timeout" in out and "test_never_reached" not in out  # the run ended there
    for name in ("child.pid", "grandchild.pid"):
        assert (tmp_path / name).read_text().strip() in out.split("killed before exiting")[1]
        assert not alive(tmp_path / name)


async def test_a_bounded_wait_names_what_it_waited_for_and_the_replica_that_died(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = scripted_pipeline(1, outputs=2, crash_at_request=1)
    async with omni_trio.open_engine(config) as engine:
        with pytest.raises(ReplicaDeadError):
            await engine.generate("hi").collect()
        with pytest.raises(EngineWaitTimeout) as caught:
            with bounded("an event nobody sets", 60, engine):
                await trio.Event().wait()
    message = str(caught.value)
    assert message.startswith(f"waited {engine_seconds(60):g} s")
    # the replica's death itself, chained as the cause
    assert message.endswith(
        "for an event nobody sets; dead replicas: s0[0]: StageError: scripted crash at request 1"
    )
    assert isinstance(caught.value.__cause__, StageError)
