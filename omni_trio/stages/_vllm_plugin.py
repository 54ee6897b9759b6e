"""A vLLM general plugin: a quick, clean exit for the processes vLLM spawns for omni-trio.

Stopping a vLLM engine on CPU sends SIGTERM to its EngineCore process, which closes its
worker's death pipe, waits for that ``VLLM::Worker`` process to exit, then tears itself
down. Both processes release everything that outlives a process (the two shared-memory
message queues and the executor's semaphore) in that explicit teardown, well before they
exit. What makes the stop slow is what follows: CPython's finalization of an interpreter
that imported vllm and torch (~5,600 modules, ~660,000 objects) runs several full garbage
collections, 1.5 s per process on an idle 2-core machine and 4-5 s under load, and the
EngineCore's own teardown waits for its worker's. Measured here: a stop took 3.7-4.2 s per
engine, past any short grace, so vLLM SIGKILLed the EngineCore and the resource tracker
then reported the "leaked" shared memory and semaphores that the kill left behind.

The plugin freezes the garbage collector's heap at exit (``atexit``: after the teardown,
before the module cleanup), so those last collections skip every object that existed;
objects are still released by reference counting. A process exits in ~0.5 s instead.
Objects in reference cycles are then never collected, and nanobind (triton's bindings,
which vllm imports) counts its surviving objects at its own teardown and prints each as
"leaked": the hook therefore closes the process's stderr after freezing. Everything the
process had to say (a crash's traceback included) was written before ``atexit`` runs.

vLLM loads general plugins (the ``vllm.general_plugins`` entry point group) in every
process it starts; this one acts only in processes spawned while ``OMNI_TRIO_VLLM_QUICK_EXIT``
is ``1``, which the vllm backend sets (set it to ``0`` to opt out). Registering the hook
twice is harmless: vLLM may load plugins more than once per process.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import sys

__all__ = ["QUICK_EXIT_ENV", "quick_exit_enabled", "register"]

QUICK_EXIT_ENV = "OMNI_TRIO_VLLM_QUICK_EXIT"

_registered = False


def quick_exit_enabled() -> bool:
    """True in a process spawned by another (an EngineCore or a worker) while the
    environment opts in. Pure (reads the environment)."""
    return os.environ.get(QUICK_EXIT_ENV) == "1" and multiprocessing.parent_process() is not None


def register() -> None:
    """The plugin entry point vLLM calls in each of its processes. Does not block."""
    global _registered
    if _registered or not quick_exit_enabled():
        return
    _registered = True
    # atexit runs its handlers last-in first-out: registered this early (plugins load
    # before the engine is built), the freeze runs after every vllm and torch handler.
    atexit.register(_freeze_heap)


def _freeze_heap() -> None:
    gc.freeze()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # the module teardown's leak counts (see the module docstring)
    os.close(devnull)
