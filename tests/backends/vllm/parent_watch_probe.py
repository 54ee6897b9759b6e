"""The parent watch (``omni_trio.backends.vllm.parent_watch``) against a real SIGKILL.

Run as a script: ``python parent_watch_probe.py <mode>``; prints one line
``PROBE {"signal": <the signal that ended the watcher, or null>, "exit": <its exit code, or
null>}``. This process becomes a child subreaper, spawns a middle process which spawns the
watcher; the watcher watches the middle process, which this one then SIGKILLs: the watcher is
reparented here, and what ended it tells which path of the watch stopped it. Modes:

- ``term``: the watcher stops on SIGTERM's default action once its parent died;
- ``stuck``: the watcher ignores SIGTERM (a clean stop that hangs): SIGALRM ends it;
- ``gone``: the parent is killed before the watcher starts watching: it stops at once.

Everything is bounded: a watcher still there after ``BOUND_S`` is killed and reported.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection

PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 1
BOUND_S = 30


def watcher(mode: str, ready: Connection, go: Connection) -> None:
    from omni_trio.backends.vllm.parent_watch import watch_parent

    if mode == "stuck":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    if mode == "gone":
        ready.send(os.getpid())
        go.recv()  # the parent is dead by now
    watch_parent(parent, GRACE_S)
    if mode != "gone":
        ready.send(os.getpid())
    threading.Event().wait()


def middle(mode: str, ready: Connection, go: Connection) -> None:
    multiprocessing.get_context("spawn").Process(target=watcher, args=(mode, ready, go)).start()
    threading.Event().wait()


class _TooLong(Exception):
    pass


def _too_long(signum: int, frame: object) -> None:
    raise _TooLong


def main(mode: str) -> dict[str, int | None]:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    ctx = multiprocessing.get_context("spawn")
    ready_r, ready_w = ctx.Pipe(duplex=False)
    go_r, go_w = ctx.Pipe(duplex=False)
    mid = ctx.Process(target=middle, args=(mode, ready_w, go_r))
    signal.signal(signal.SIGALRM, _too_long)
    signal.alarm(BOUND_S)
    pid = None
    try:
        mid.start()
        pid = ready_r.recv()
        os.kill(mid.pid, signal.SIGKILL)
        mid.join()
        if mode == "gone":
            go_w.send(None)
        _, status = os.waitpid(pid, 0)  # reparented here when the middle process died
    except _TooLong:
        for left in (mid.pid, pid):
            if left is not None:
                _kill(left)
        mid.join()
        return {"signal": None, "exit": None}
    finally:
        signal.alarm(0)
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status), "exit": None}
    return {"signal": None, "exit": os.WEXITSTATUS(status)}


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    print("PROBE " + json.dumps(main(sys.argv[1])), flush=True)
