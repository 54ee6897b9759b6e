"""``omni-trio``'s ``main``: one-line errors and exit codes, ``--debug`` tracebacks, the log file
that takes vLLM's output, Ctrl-C, and the ``python -m omni_trio`` entry point.

The helpers here (a two-stage scripted pipeline file, the one-line error check, the log file
a command names) serve the other ``test_cli_*`` modules too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from omni_trio.cli.main import main

from ..conftest import engine_seconds, kill_processes, process_tree, read_until

TWO_STAGES = """\
name: two
stages:
  - id: a
    backend: scripted
    options: {{outputs: 3{a}}}
  - id: b
    backend: scripted
    inputs: [a]
    final_output: true
    options: {{outputs: 4{b}}}
"""


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def pipeline(tmp_path: Path, a: str = "", b: str = "") -> str:
    return write(tmp_path, TWO_STAGES.format(a=a, b=b))


LOG_NOTE = "omni-trio: vLLM, torch and transformers output goes to "


def one_line_error(err: str) -> str:
    # the log file's note and the start-up lines (commands that start engines) come first
    lines = [
        line for line in err.splitlines() if line.strip() and not line.startswith((LOG_NOTE, "✓ "))
    ]
    assert len(lines) == 1, err
    assert lines[0].startswith("omni-trio: error: ")
    assert "Traceback" not in err
    return lines[0]


def log_file(err: str) -> str:
    """The text of the log file that a command's stderr names."""
    line = next(line for line in err.splitlines() if line.startswith(LOG_NOTE))
    return Path(line.removeprefix(LOG_NOTE).split()[0]).read_text()


def test_verbose_keeps_everything_on_the_terminal(tmp_path, capsys):
    assert main(["run", pipeline(tmp_path), "--prompt", "hi", "--verbose"]) == 0
    assert LOG_NOTE not in capsys.readouterr().err


def test_run_errors(tmp_path, capsys):
    failing = pipeline(tmp_path, b=", fail_at_output: 1")
    assert main(["run", failing, "--prompt", "hi"]) == 1
    line = one_line_error(capsys.readouterr().err)
    assert "StageError" in line and "fail at output 1" in line

    assert main(["run", failing, "--prompt", "hi", "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err

    assert main(["run", pipeline(tmp_path), "--prompt", "hi", "--max-tokens", "0"]) == 2
    assert "--max-tokens must be >= 1" in one_line_error(capsys.readouterr().err)

    broken = write(tmp_path, "name: x\nstages: 3\n", "broken.yaml")
    assert main(["run", broken, "--prompt", "hi"]) == 2
    assert "broken.yaml: $.stages" in one_line_error(capsys.readouterr().err)


def test_python_dash_m_entry_point(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "omni_trio", "validate", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    one_line_error(proc.stderr)


@pytest.mark.slow
def test_ctrl_c_during_run_is_one_line(tmp_path):
    text = TWO_STAGES.format(a="", b=", latency_s: 0.1").replace("outputs: 4,", "outputs: 300,")
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_trio", "run", write(tmp_path, text), "--prompt", "hi"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # a shell runs background jobs (a CI script's, say) with SIGINT ignored, and children
        # inherit that: Ctrl-C must mean what it means at a terminal
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        read_until(proc, "b:", 60)  # the first outputs are streaming: the request is in flight
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(engine_seconds(60))
    finally:
        kill_processes(process_tree(proc.pid))
    err = proc.stderr.read()
    assert rc == 1, err
    assert "omni-trio: interrupted" in err and "Traceback" not in err and "error" not in err


def test_main_leaves_the_vllm_log_level_as_it_found_it(tmp_path, monkeypatch, capsys):
    # main() run in a longer-lived process (tests, an embedding program) must not change the
    # log level that later commands and their engine processes inherit
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert main(["validate", write(tmp_path, TWO_STAGES.format(a="", b=""))]) == 0
    assert "VLLM_LOGGING_LEVEL" not in os.environ
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    assert main(["validate", write(tmp_path, TWO_STAGES.format(a="", b=""))]) == 0
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
