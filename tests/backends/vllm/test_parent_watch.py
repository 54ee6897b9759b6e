"""A process that stops when the process that started it dies (``parent_watch``): the
decision, and the watch against a real SIGKILL (``parent_watch_probe.py``)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from omni_trio.backends.vllm.parent_watch import parent_to_watch

PROBE = Path(__file__).with_name("parent_watch_probe.py")


def test_only_a_child_of_the_named_process_watches_it() -> None:
    assert parent_to_watch("100", 100) == 100
    assert parent_to_watch("100", 200) is None  # a grandchild: its own parent is not named
    assert parent_to_watch(None, 100) is None  # nobody asked (a user's own vLLM)
    assert parent_to_watch("100", None) is None  # not started by multiprocessing
    assert parent_to_watch("", 100) is None


@pytest.mark.slow  # spawns processes
@pytest.mark.parametrize(
    ("mode", "ended_by"),
    [("term", signal.SIGTERM), ("stuck", signal.SIGALRM), ("gone", signal.SIGTERM)],
    ids=[
        "sigterm-when-the-parent-is-killed",
        "sigalrm-when-the-clean-stop-hangs",
        "at-once-when-the-parent-is-already-gone",
    ],
)
def test_a_process_whose_parent_is_killed_stops_itself(mode: str, ended_by: int) -> None:
    proc = subprocess.run(
        [sys.executable, str(PROBE), mode], capture_output=True, text=True, timeout=120
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, proc.stderr[-3000:]
    # null: the watcher was still there after the probe's bound (and was killed)
    assert json.loads(lines[0].removeprefix("PROBE ")) == {"signal": ended_by, "exit": None}
