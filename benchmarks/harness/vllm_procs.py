"""The processes of a ``bench_vllm_pipeline.py`` run: what it spawned and what outlived it,
each engine's processes (EngineCore and workers) and when they exit (pidfds), where a close's
time went (each engine's own stop against the close), and the CPU they use while idle."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import psutil

from omni_trio.transport.loop_host import stop_before_exit

#: how long the parent watches leftover processes go away after a subprocess exited
LEFTOVER_GRACE_S = 5.0

#: idle CPU is measured from this long after the last batch: vLLM's shared-memory readers
#: (EngineCore and worker) busy-poll their queue for 1 s after their last read
IDLE_SETTLE_S = 2.0

#: the logger whose debug records mark where each omni-trio engine's stop begins and ends
STOP_LOGGER = "omni_trio.backends.vllm.process"


def descendants() -> list[list[Any]]:
    """[pid, create_time, what] of every process this one spawned (recursively); ``what`` is
    the process name, or the start of its command line for a bare ``python`` (multiprocessing's
    resource tracker is one)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            what = p.name()
            if what.startswith("python"):
                exe, *args = p.cmdline()
                what = " ".join([os.path.basename(exe), *args])[:100]
            found.append([p.pid, p.create_time(), what])
    return found


def still_there(procs: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    """Which of ``procs`` ([pid, create_time, what]) still exist, with their status; a pid
    reused by a newer process does not count."""
    found = []
    for pid, created, what in procs:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created:
                found.append({"pid": pid, "what": what, "status": p.status()})
        except psutil.NoSuchProcess:
            pass
    return found


def leftover(children: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """Which of ``children`` ([pid, create_time, what], what a subprocess spawned) are still
    there once it exited (``at_exit``), and which of those after ``LEFTOVER_GRACE_S``
    (``after_grace``)."""
    at_exit = still_there(children)
    watched = []
    for p in at_exit:
        with contextlib.suppress(psutil.NoSuchProcess):
            watched.append(psutil.Process(p["pid"]))
    _, alive = psutil.wait_procs(watched, timeout=LEFTOVER_GRACE_S)
    return {
        "at_exit": at_exit,
        "grace_s": LEFTOVER_GRACE_S,
        "after_grace": [{"pid": p.pid, "status": _status(p)} for p in alive],
    }


def _status(p: psutil.Process) -> str:
    try:
        return str(p.status())
    except psutil.NoSuchProcess:
        return "gone"


def engine_groups() -> dict[int, list[int]]:
    """EngineCore pid -> the pids of it and every process it spawned (its workers). An
    EngineCore is a child of this process titled ``VLLM::EngineCore`` (vLLM sets the title;
    before that, its command line is multiprocessing's ``spawn_main``)."""
    groups: dict[int, list[int]] = {}
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            line = child.cmdline()
            if line[:1] == ["VLLM::EngineCore"] or any("spawn_main" in p for p in line):
                groups[child.pid] = [child.pid] + [g.pid for g in child.children(recursive=True)]
    return groups


class ExitWatch:
    """When each watched process exits (``time.monotonic()``), seen by a thread polling their
    pidfds: a pidfd turns readable the moment its process ends (zombie or reaped), whoever
    its parent is. Costs nothing while the processes live."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.exited: dict[int, float] = {}
        self._fds: dict[int, int] = {}  # pidfd -> pid
        for pid in pids:
            try:
                self._fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                self.exited[pid] = time.monotonic()  # gone before the watch began
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="exit-watch")
        self._thread.start()
        # not a daemon: a watch never closed (its owner failed) stops at the interpreter's
        # exit, which would otherwise wait for the watched processes to end
        self._withdraw = stop_before_exit(self._stop_watching, name="exit-watch")

    def _stop_watching(self) -> None:
        os.write(self._wake_w, b"x")

    def _run(self) -> None:
        poller = select.poll()
        for fd in [*self._fds, self._wake_r]:
            poller.register(fd, select.POLLIN)
        pending = set(self._fds)
        while pending:
            ready = poller.poll()
            now = time.monotonic()
            for fd, _ in ready:
                if fd == self._wake_r:
                    return
                self.exited[self._fds[fd]] = now
                poller.unregister(fd)
                pending.discard(fd)

    def close(self, wait: float = 0.0) -> dict[int, float]:
        """Stop watching, after up to ``wait`` seconds for the processes still alive; pid ->
        exit time of every watched process that exited."""
        self._thread.join(wait)
        self._withdraw()
        self._stop_watching()
        self._thread.join()
        for fd in [*self._fds, self._wake_r, self._wake_w]:
            os.close(fd)
        return dict(self.exited)


class StopLog(logging.Handler):
    """Collects the stop phases omni-trio's vllm backend logs at debug level:
    (phase, EngineCore pids, monotonic time)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.phases: list[tuple[str, tuple[int, ...], float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        phase = getattr(record, "stop_phase", None)
        if phase is not None:
            pids, t = getattr(record, "core_pids", ()), getattr(record, "t", None)
            if t is not None:
                self.phases.append((phase, tuple(pids), float(t)))


@contextlib.contextmanager
def stop_log() -> Iterator[StopLog]:
    handler = StopLog()
    log = logging.getLogger(STOP_LOGGER)
    level = log.level
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def engine_stops(
    groups: dict[int, list[int]],
    phases: Sequence[tuple[str, Sequence[int], float]],
    exited: dict[int, float],
) -> list[dict[str, Any]]:
    """One record per engine (EngineCore pid -> its processes): when its stop began and its
    stop call returned (from ``phases``: (``begin``/``end``, EngineCore pids, time)), and
    when the last of its processes exited (``gone``, None if one never did)."""
    marks: dict[tuple[str, int], float] = {}
    for phase, pids, t in phases:
        for pid in pids:
            marks.setdefault((phase, pid), t)
    stops = []
    for core, pids in groups.items():
        exits = [exited.get(pid) for pid in pids]
        gone = None if None in exits else max(e for e in exits if e is not None)
        stops.append(
            {
                "core_pid": core,
                "processes": len(pids),
                "begin": marks.get(("begin", core)),
                "end": marks.get(("end", core)),
                "gone": gone,
            }
        )
    return stops


def stop_breakdown(
    t_close: float, t_closed: float, stops: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """Where a close's time went, in seconds. Per engine: ``began`` (its stop began, from the
    start of close), ``own_stop`` (from that moment until its EngineCore and workers were
    gone), ``call`` (the stop call itself, reaping included), ``gone`` (from the start of
    close). For the close: ``close`` (start to return), ``slowest_own_stop``, ``gap``
    (close minus the slowest own stop: the target is at most 1 s), ``before_first_stop`` and
    ``after_last_gone``. Figures that cannot be computed (a stop never logged, a process
    never seen to exit) are None."""

    def since(t: float | None, origin: float | None) -> float | None:
        return None if t is None or origin is None else t - origin

    engines = [
        {
            "core_pid": s["core_pid"],
            "processes": s["processes"],
            "began": since(s["begin"], t_close),
            "own_stop": since(s["gone"], s["begin"]),
            "call": since(s["end"], s["begin"]),
            "gone": since(s["gone"], t_close),
        }
        for s in stops
    ]
    own = [e["own_stop"] for e in engines]
    slowest = None if not own or None in own else max(own)
    begins = [s["begin"] for s in stops]
    gones = [s["gone"] for s in stops]
    close = t_closed - t_close
    return {
        "close": close,
        "slowest_own_stop": slowest,
        "gap": None if slowest is None else close - slowest,
        "before_first_stop": None if not begins or None in begins else min(begins) - t_close,
        "after_last_gone": None if not gones or None in gones else t_closed - max(gones),
        "engines": engines,
    }


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time of ``pids`` (each process alone, not its children)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def thread_cpu() -> dict[str, float]:
    """This process's CPU seconds so far, by thread: ``loop`` (the main thread, whose trio or
    asyncio loop drives the requests: omni-trio's orchestrator, or the hand-driven program
    with its AsyncLLMs), ``engine_threads`` (omni-trio's vllm stage threads, an asyncio loop
    and an AsyncLLM each) and ``other`` (every other thread, ended ones included)."""
    from omni_trio.backends.vllm.backend import THREAD_PREFIX

    total = time.process_time()
    loop = engines = 0.0
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        try:
            seconds = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except OSError:
            continue  # it ended meanwhile: its time is in "other"
        if thread is threading.main_thread():
            loop += seconds
        elif thread.name.startswith(THREAD_PREFIX):
            engines += seconds
    return {"loop": loop, "engine_threads": engines, "other": max(0.0, total - loop - engines)}


def idle_snapshot(groups: dict[int, list[int]]) -> dict[str, Any]:
    """CPU seconds so far of this process (the frontend) and of each engine's processes."""
    return {
        "frontend": time.process_time(),
        "engines": {core: cpu_seconds(pids) for core, pids in groups.items()},
    }


async def measure_idle(
    groups: dict[int, list[int]], sleep: Callable[[float], Awaitable[None]], seconds: float
) -> dict[str, Any]:
    """:func:`idle_cpu` over ``seconds`` from ``IDLE_SETTLE_S`` on, and the settling time
    before (as ``settle``). Awaits ``sleep`` only, so it runs on asyncio and on trio alike."""
    after_work = idle_snapshot(groups)
    await sleep(IDLE_SETTLE_S)
    settled = idle_snapshot(groups)
    await sleep(seconds)
    idle = idle_cpu(settled, idle_snapshot(groups), seconds)
    idle["settle"] = idle_cpu(after_work, settled, IDLE_SETTLE_S)
    return idle


def idle_cpu(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, Any]:
    """CPU seconds used between two :func:`idle_snapshot` s taken ``seconds`` apart."""
    return {
        "seconds": seconds,
        "frontend_cpu_s": after["frontend"] - before["frontend"],
        "engines_cpu_s": {
            str(core): after["engines"][core] - cpu for core, cpu in before["engines"].items()
        },
    }


def stop_one_by_one(
    engines: Sequence[tuple[tuple[int, ...], Callable[[], object]]],
) -> tuple[float, dict[str, Any]]:
    """Stop engines one after the other, as a plain program does: each is (its EngineCore
    pids, a blocking call that stops it). Returns the close's seconds and its
    :func:`stop_breakdown`."""
    groups = engine_groups()
    watch = ExitWatch([pid for group in groups.values() for pid in group])
    phases: list[tuple[str, tuple[int, ...], float]] = []
    t_close, m_close = time.perf_counter(), time.monotonic()
    for cores, stop in engines:
        phases.append(("begin", cores, time.monotonic()))
        stop()
        phases.append(("end", cores, time.monotonic()))
    shutdown_s = time.perf_counter() - t_close
    m_closed = time.monotonic()
    # vLLM's own stop may leave the worker of a killed EngineCore behind: its exit still ends
    # the engine's own stop (not part of close, which has returned)
    stops = engine_stops(groups, phases, watch.close(wait=LEFTOVER_GRACE_S))
    return shutdown_s, stop_breakdown(m_close, m_closed, stops)
