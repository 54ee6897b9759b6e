"""The command line's terminal: third-party chatter into a log file, and a quick, clean exit.

vLLM, torch and transformers write a lot while an engine starts and stops: vLLM's log lines
(on stdout, in every process it spawns), C++ warnings, deprecation warnings, progress bars of
their own. :func:`chatter_to_log` sends all of it to a log file and keeps the terminal for
omni-trio's own output. It works at two levels:

- file descriptors 1 and 2 of the process point at the log file, so whatever is written to
  them, by C code here or by any process started from now on (vLLM's EngineCore and
  workers, the resource tracker), lands in the log;
- ``sys.stdout`` and ``sys.stderr`` are replaced by streams on duplicates of the original
  descriptors, so Python code of this process (omni-trio's prints, the progress display)
  still reaches the terminal. Python-level chatter of this process is routed explicitly:
  vLLM's logger (``VLLM_LOGGING_STREAM``), the root logger and warnings go to the log.

:func:`exit_process` ends the command: it stops multiprocessing's resource tracker (so no
child process outlives the command), runs the ``atexit`` handlers, and exits without
CPython's finalization, which would spend seconds collecting vllm's and torch's objects.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TextIO

__all__ = [
    "ChatterLog",
    "chatter_to_log",
    "default_log_path",
    "exit_process",
    "stop_resource_tracker",
]

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def default_log_path(command: str, *, now: float | None = None, pid: int | None = None) -> Path:
    """``$OMNI_TRIO_CACHE/logs/<command>-<date>-<time>-<pid>.log`` (cache default
    ``~/.cache/omni-trio``). Pure (reads the environment)."""
    from ..models.tiny import default_cache_dir

    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return default_cache_dir() / "logs" / f"{command}-{stamp}-{pid or os.getpid()}.log"


@dataclass(frozen=True)
class ChatterLog:
    """Where the chatter goes while :func:`chatter_to_log` is active."""

    path: Path


@contextmanager
def chatter_to_log(path: Path, *, debug: bool = False) -> Iterator[ChatterLog]:
    """Send vLLM/torch/transformers output of this process and of every process started
    inside the block to ``path`` (appended); omni-trio's own output stays on the terminal.

    Restores descriptors, streams, logging and the environment on exit. Blocking (opens a
    file); for the command line only: it changes process-wide state.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    streams = (sys.stdout, sys.stderr)
    env = {k: os.environ.get(k) for k in ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL")}
    root = logging.getLogger()
    root_state = (list(root.handlers), root.level)
    handler = logging.StreamHandler(sys.__stderr__)
    try:
        for fd in (1, 2):
            os.dup2(log_fd, fd)
        sys.stdout = _terminal(streams[0], saved[1])
        sys.stderr = _terminal(streams[1], saved[2])
        # vLLM configures its logger from these when it is first imported, here and in each
        # process it spawns; sys.__stderr__ writes to descriptor 2, the log, in all of them.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.__stderr__")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG" if debug else "INFO")
        handler.setFormatter(logging.Formatter(_FORMAT))
        root.handlers = [handler]
        root.setLevel(logging.DEBUG if debug else logging.INFO)
        logging.captureWarnings(True)
        # omni-trio's own warnings still reach the terminal (and the log, through the root)
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        ours = logging.getLogger("omni_trio")
        ours_level = ours.level
        ours.addHandler(console)
        if not debug:
            ours.setLevel(logging.WARNING)  # modules set their own level to say more
        try:
            yield ChatterLog(path)
        finally:
            ours.removeHandler(console)
            ours.setLevel(ours_level)
    finally:
        logging.captureWarnings(False)
        root.handlers, level = root_state
        root.setLevel(level)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        terminals = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = streams
        for terminal in terminals:
            if terminal not in streams:
                terminal.close()  # closes its own duplicate descriptor only
        for fd, dup in saved.items():
            os.dup2(dup, fd)
            os.close(dup)
        os.close(log_fd)
        if path.stat().st_size == 0:
            path.unlink()  # nothing was said: no file to keep
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _terminal(stream: TextIO, saved_fd: int) -> TextIO:
    """A stream on the terminal for ``stream``: a new one on a duplicate of the saved
    descriptor when ``stream`` writes to descriptor 1 or 2, else ``stream`` itself (a test's
    capture, say)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return stream
    if fd not in (1, 2):
        return stream
    raw = io.FileIO(os.dup(saved_fd), "w", closefd=True)
    return io.TextIOWrapper(
        raw, encoding=stream.encoding, errors=stream.errors, line_buffering=True
    )


def exit_process(code: int) -> NoReturn:
    """End the command with ``code``: stop the resource tracker, run the ``atexit``
    handlers, flush, and leave without the interpreter's finalization.

    Every engine has stopped and every child process has been reaped when this runs, so:
    multiprocessing's resource tracker (a child process started with the first spawned
    process) is stopped and reaped here rather than left to notice the exit on its own;
    and what finalization would still do is collect the ~660,000 objects of vllm and torch
    (1.5-5 s on 2 cores) and let extension modules count what survived.
    """
    stop_resource_tracker()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed pipe: nothing more to say
    os._exit(code)


def stop_resource_tracker() -> None:
    """Stop and reap multiprocessing's resource tracker process, if this process started
    one; call it when no child process is left. Blocking (briefly). Idempotent.

    The tracker ends when the last holder of its pipe closes it, which is this process:
    left alone, it outlives the command by the time it takes to notice. (``_stop`` is
    private, in Python 3.11-3.13 alike; without it the tracker ends on its own.)
    """
    module = sys.modules.get("multiprocessing.resource_tracker")
    stop = getattr(getattr(module, "_resource_tracker", None), "_stop", None)
    if stop is not None:
        stop()
