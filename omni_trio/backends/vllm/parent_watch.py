"""A process that ends when the process that started it dies without stopping it.

vLLM's EngineCore serves one frontend (the process that holds its ``AsyncLLM``) and nothing
else, but it never learns that its frontend was killed (SIGKILL, the OOM killer,
``os._exit``): its sockets do not fail, it waits for requests forever and its workers
(which follow the EngineCore through vLLM's death pipe) with it, holding their memory.

:func:`watch_parent` makes such a process watch its parent: a daemon thread waits on a pidfd
of the parent (``os.pidfd_open``; where that is missing, the parent's multiprocessing
sentinel, a pipe whose write end only the parent holds), which becomes readable when the
parent exits; no polling. Then the process stops itself the way its parent would have: a
SIGTERM to itself (vLLM's EngineCore aborts its requests, stops its workers, releases its
shared memory and exits), and, should that not end it within a grace period, SIGALRM's
default action ends it (the kernel's timer: it fires whatever the interpreter is doing).

Not PR_SET_PDEATHSIG: Linux fires it when the parent *thread* that forked the child exits,
and an EngineCore is spawned from a short-lived helper thread of its frontend.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import threading
from collections.abc import Callable

__all__ = ["ORPHAN_GRACE_S", "parent_to_watch", "watch_parent"]

#: seconds a process whose parent died gets to stop cleanly after its SIGTERM (vLLM's
#: EngineCore takes ~1-2 s with this package's plugin, up to ~5 s on a loaded machine)
ORPHAN_GRACE_S = 5


def parent_to_watch(frontend_pid: str | None, parent_pid: int | None) -> int | None:
    """The pid this process must watch: its parent, when that is the process named by
    ``frontend_pid`` (the environment's word for "my direct children must not outlive me");
    ``None`` otherwise. Pure."""
    if frontend_pid is None or parent_pid is None or frontend_pid != str(parent_pid):
        return None
    return parent_pid


def watch_parent(
    pid: int, grace_s: int = ORPHAN_GRACE_S, *, on_death: Callable[[int], None] | None = None
) -> threading.Thread | None:
    """Stop this process when its parent ``pid`` exits (see the module docstring): at once
    if it is already gone (then returns ``None``), else from a daemon thread that waits for
    it (returned, started). ``on_death(pid)`` runs first (a log line). Does not block.

    The thread is a daemon: it waits for the life of the process and ends with it.
    """
    fd = _parent_handle(pid)
    if fd is None:
        _stop_self(pid, grace_s, on_death)
        return None

    def wait() -> None:
        select.select([fd], [], [])  # readable once the parent has exited
        _stop_self(pid, grace_s, on_death)

    thread = threading.Thread(target=wait, name=f"omni-trio-watch-parent-{pid}", daemon=True)
    thread.start()
    return thread


def _parent_handle(pid: int) -> int | None:
    """A file descriptor that becomes readable when parent ``pid`` exits; ``None`` when it
    is already gone. Raises OSError when there is no way to watch it."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError) as exc:  # no pidfds here (not Linux, or before 5.3)
        parent = multiprocessing.parent_process()
        if parent is None or parent.pid != pid or parent.sentinel is None:
            raise OSError(f"cannot watch process {pid}: no pidfd ({exc})") from exc
        return parent.sentinel
    if os.getppid() != pid:
        # it died before the pidfd was opened, and the pid may already name another process
        os.close(fd)
        return None
    return fd


def _stop_self(pid: int, grace_s: int, on_death: Callable[[int], None] | None) -> None:
    if on_death is not None:
        on_death(pid)
    signal.alarm(grace_s)  # the backstop: SIGALRM's default action ends the process
    os.kill(os.getpid(), signal.SIGTERM)
