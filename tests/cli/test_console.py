"""The command line's terminal: chatter into the log file, our output on the terminal, and
an exit that leaves no child process. Real processes and descriptors (subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from omni_trio.cli.console import default_log_path

pytestmark = pytest.mark.slow  # subprocesses

CHATTY = """
import logging, os, subprocess, sys, warnings
from pathlib import Path
from omni_trio.cli.console import chatter_to_log

before = {k: os.environ.get(k) for k in ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL")}
with chatter_to_log(Path(sys.argv[1])):
    print("ours on stdout")
    print("ours on stderr", file=sys.stderr)
    os.write(2, b"C-level chatter\\n")
    child = "import sys; print('child stdout'); print('child stderr', file=sys.stderr)"
    subprocess.run([sys.executable, "-c", child], check=True)
    warnings.warn("a third-party warning")
    logging.getLogger("vllm.engine").warning("a third-party log line")
    logging.getLogger("omni_trio.x").warning("our warning")
    logging.getLogger("omni_trio.x").info("our chit-chat")
    inside = os.environ["VLLM_LOGGING_STREAM"]
print("after, on stdout")
os.write(2, b"after, on descriptor 2\\n")
after = {k: os.environ.get(k) for k in before}
print("ENV", inside, after == before)
"""


def test_chatter_goes_to_the_log_and_our_output_to_the_terminal(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "run.log"
    proc = subprocess.run(
        [sys.executable, "-c", CHATTY, str(log)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "ours on stdout",
        "after, on stdout",
        "ENV ext://sys.__stderr__ True",  # vLLM's logger is pointed at the log, then restored
    ]
    text = log.read_text()
    for chatter in (
        "C-level chatter",
        "child stdout",
        "child stderr",
        "a third-party warning",
        "a third-party log line",
    ):
        assert chatter in text and chatter not in proc.stdout + proc.stderr
    assert "ours on stderr" in proc.stderr and "ours on" not in text
    assert "our warning" in proc.stderr and "our warning" in text  # ours: both places
    assert "our chit-chat" not in proc.stderr + text
    assert "after, on descriptor 2" in proc.stderr and "after" not in text


def test_an_empty_log_is_not_kept(tmp_path: Path) -> None:
    log = tmp_path / "quiet.log"
    code = "import sys; from pathlib import Path\n"
    code += "from omni_trio.cli.console import chatter_to_log\n"
    code += "with chatter_to_log(Path(sys.argv[1])): print('only ours')"
    proc = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True)
    assert proc.stdout == "only ours\n" and not log.exists()


EXITS = """
import json, sys
from multiprocessing import resource_tracker, shared_memory
from omni_trio.cli.console import exit_process

block = shared_memory.SharedMemory(create=True, size=64)  # starts the resource tracker
block.close()
block.unlink()
print(json.dumps({"tracker": resource_tracker._resource_tracker._pid}), flush=True)
exit_process(3)
"""


def test_exit_process_keeps_the_code_and_leaves_no_child() -> None:
    proc = subprocess.run([sys.executable, "-c", EXITS], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    tracker = json.loads(proc.stdout)["tracker"]
    # reaped before the exit: not even a moment later is it still there
    assert isinstance(tracker, int) and not psutil.pid_exists(tracker)
    assert proc.stderr == ""


def test_default_log_path_is_in_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_TRIO_CACHE", str(tmp_path))
    path = default_log_path("demo", now=0.0, pid=42)
    assert path.parent == tmp_path / "logs"
    assert path.name.startswith("demo-") and path.name.endswith("-42.log")
