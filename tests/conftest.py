"""Shared fixtures and the suite's bounds. Fast tests run under pytest-trio's
``autojump_clock`` (a MockClock with autojump_threshold=0): every trio-clock wait in a
scripted stage completes instantly.

Tests on real engines (marked ``vllm``, ``slow`` or ``ray``) wait on things a dying engine
never does: three bounds make such a test fail alone, with what it waited for, and leave no
engine process behind (see "bounds" below)."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

import functools
import gc
import inspect
import itertools
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import outcome
import psutil
import pytest
import trio
import trio.testing

_module_ids = itertools.count()


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> Callable[[str], str]:
    """Write Python source as an importable module (a user's backend or input processor,
    named in a config as ``"module:Name"``); returns the module's name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(source: str) -> str:
        name = f"omni_user_module_{os.getpid()}_{next(_module_ids)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return make


# -- bounds ---------------------------------------------------------------------------------
# 1. Each wait on a real engine sits in ``bounded(what, seconds)`` (or a subprocess timeout
#    of ``engine_seconds(...)``): a dead engine fails that wait, naming what it waited for
#    and the replica's death.
# 2. A real-engine trio test that runs past TEST_DEADLINE_S is cancelled (its engines stop
#    as on any cancellation), fails with where its tasks waited, and the processes it
#    started and left are killed; the run goes on.
# 3. pytest-timeout (pyproject: thread method) is the last resort, for a test stuck where
#    trio cannot cancel it: it kills every process below this one, then ends the run.
# All three are hang detectors sized to the machine, never speed checks.

#: multiplies every bound below; a slower or busier machine sets it (2, 3) rather than
#: editing numbers
TIME_SCALE_VAR = "OMNI_TRIO_TEST_TIME_SCALE"


def _time_scale() -> float:
    raw = os.environ.get(TIME_SCALE_VAR, "1")
    try:
        scale = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{TIME_SCALE_VAR}={raw!r} is not a number") from None
    if not scale > 0:
        raise pytest.UsageError(f"{TIME_SCALE_VAR}={raw!r} must be above 0")
    return scale


TIME_SCALE = _time_scale()

#: a real-engine trio test running longer than this (scaled) fails alone; the slowest one
#: takes a few minutes on a 2-core machine
TEST_DEADLINE_S = 600.0

REAL_ENGINE_MARKERS = ("vllm", "slow", "ray")


def engine_seconds(seconds: float) -> float:
    """``seconds`` (ample for the wait on a 2-core machine) scaled to this one."""
    return seconds * TIME_SCALE


class EngineWaitTimeout(AssertionError):
    """A bounded wait on a real engine ran out (the engine died or hung)."""


@contextmanager
def bounded(what: str, seconds: float = 60.0, *watched: object) -> Iterator[None]:
    """Fail the test if the block runs past ``engine_seconds(seconds)``: the error names
    ``what`` it waited for and every replica of ``watched`` (backends, engines) that died,
    with the first death as its cause (the engine's own error chain)."""
    limit = engine_seconds(seconds)
    try:
        with trio.fail_after(limit):
            yield
    except trio.TooSlowError as exc:
        try:
            deaths = [d for w in watched for d in _deaths_of(w)]
        except Exception as unreadable:  # a report: it must not hide the timeout
            deaths = [(f"(unreadable: {unreadable!r})", None)]
        message = f"waited {limit:g} s ({TIME_SCALE_VAR}={TIME_SCALE:g}) for {what}"
        if deaths:
            message += "; dead replicas: " + "; ".join(line for line, _ in deaths)
        cause = next((error for _, error in deaths if error is not None), exc)
        raise EngineWaitTimeout(message) from cause


def _deaths_of(thing: object) -> list[tuple[str, BaseException | None]]:
    # a backend (StageBackend), or an engine: its replicas' deaths as (line, error)
    backends = []
    if hasattr(thing, "death") and hasattr(thing, "name"):
        backends.append(thing)
    pools = getattr(thing, "pools", None)
    if isinstance(pools, dict):
        backends.extend(b for pool in pools.values() for b in pool.replicas)
    found = [(b.name, b.death) for b in backends if b.death is not None]
    lines = [(f"{name}: {type(d).__name__}: {d}", d) for name, d in found]
    statistics = getattr(thing, "statistics", None)
    if pools is not None and statistics is not None:
        # a restarted replica's death is only in its statistics
        for stage in statistics().stages:
            for r in stage.replicas:
                if r.last_error and not any(r.last_error in line for line, _ in lines):
                    lines.append((f"{stage.stage_id}[{r.replica}] last: {r.last_error}", None))
    return lines


def _all_replica_deaths() -> list[str]:
    # a report at a deadline: every stage replica still in memory that died
    try:
        from omni_trio.stages.backend import StageBackend
    except ImportError:
        return []
    gc.unfreeze()  # see _trio_task_stacks
    return [
        line for o in gc.get_objects() if isinstance(o, StageBackend) for line, _ in _deaths_of(o)
    ]


def _trio_task_stacks() -> list[str]:
    lines = []
    # a frozen heap (serve_engine freezes it while serving) hides from gc.get_objects() every
    # task that existed when it froze; the test is failing anyway
    gc.unfreeze()
    # also read from pytest-timeout's thread while trio's waits: a report, never a decision
    for task in [o for o in gc.get_objects() if isinstance(o, trio.lowlevel.Task)]:
        coro = task.coro
        if not inspect.iscoroutine(coro) or inspect.getcoroutinestate(coro) == "CORO_CLOSED":
            continue
        frames = [
            f"  {frame.f_code.co_filename}:{lineno} in {frame.f_code.co_name}"
            for frame, lineno in task.iter_await_frames()
            if not any(part in frame.f_code.co_filename for part in _PLUMBING)
        ]
        if frames:
            lines.extend([f"trio task {task.name!r}:", *frames])
    return lines


# frames of trio's own machinery, and of the runners around a test: not where it hangs
_PLUMBING = ("/trio/_core/", "/trio/_sync.py", "/pytest_trio/", "/outcome/")


def descendants() -> list[psutil.Process]:
    """Every live process below this one."""
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def left_behind(before: Collection[int] = ()) -> list[psutil.Process]:
    """The processes below this one that are not in ``before`` (pids), but for
    multiprocessing's resource tracker: it serves the whole run and exits with it."""
    left = []
    for p in descendants():
        try:
            if p.pid not in before and "multiprocessing.resource_tracker" not in " ".join(
                p.cmdline()
            ):
                left.append(p)
        except psutil.Error:
            continue
    return left


def kill_processes(procs: list[psutil.Process]) -> list[str]:
    """SIGKILL ``procs`` and reap those that are this process's children; returns
    ``"pid cmdline"`` of each one that was alive."""
    killed = []
    for p in procs:
        try:
            what = f"{p.pid} {' '.join(p.cmdline())[:120]}"
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue
        killed.append(what)
    psutil.wait_procs(procs, timeout=5)
    return killed


def process_tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and every process below it, deepest last."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


async def kill_tree(process: trio.Process) -> None:
    """A ``deliver_cancel`` for ``trio.run_process``: SIGKILL the process and everything
    below it at once (vLLM's EngineCore outlives a parent that was killed alone)."""
    tree = process_tree(process.pid)
    await trio.to_thread.run_sync(kill_processes, tree)


def run_bounded(
    args: list[str], seconds: float, what: str, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args, capture_output=True, text=True, **kwargs)`` bounded by
    ``engine_seconds(seconds)``: past it, the process and everything below it are killed and
    the test fails naming ``what`` and showing the output so far."""
    limit = engine_seconds(seconds)
    with subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    ) as proc:
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_processes(process_tree(proc.pid))
            out, err = proc.communicate()
            raise EngineWaitTimeout(
                f"waited {limit:g} s ({TIME_SCALE_VAR}={TIME_SCALE:g}) for {what}; "
                f"killed it\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
            ) from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def read_until(proc: subprocess.Popen[str], marker: str, seconds: float) -> str:
    """What ``proc`` writes on stdout up to and including ``marker``, read straight from the
    pipe (never through ``proc.stdout``'s buffer). Fails, with its stderr, if it exits
    first; past ``engine_seconds(seconds)``, fails naming the marker."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    limit = engine_seconds(seconds)
    deadline = time.monotonic() + limit
    seen = b""
    while marker.encode() not in seen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise EngineWaitTimeout(
                f"waited {limit:g} s ({TIME_SCALE_VAR}={TIME_SCALE:g}) for {marker!r} on "
                f"stdout; got {seen.decode(errors='replace')[-1000:]!r}"
            )
        if select.select([fd], [], [], remaining)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                err = proc.stderr.read() if proc.stderr else ""
                raise AssertionError(f"exited before printing {marker!r}\n{err[-3000:]}")
            seen += chunk
    return seen.decode(errors="replace")


class DeadlineExceeded(AssertionError):
    """A real-engine test ran past its deadline."""


def _with_deadline(test: Callable[..., Awaitable[None]], nodeid: str) -> Callable[..., Any]:
    # the test, cancelled at TEST_DEADLINE_S (real time; MockClock tests get none)
    @functools.wraps(test)
    async def guarded(**kwargs: Any) -> None:
        if isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock):
            await test(**kwargs)
            return
        limit = engine_seconds(TEST_DEADLINE_S)
        before = {p.pid for p in descendants()}
        report: list[str] = []
        async with trio.open_nursery() as nursery:

            async def watchdog() -> None:
                await trio.sleep(limit)
                # where it hangs, seen before the cancellation unwinds it
                report.extend(_trio_task_stacks())
                report[:0] = _all_replica_deaths() or ["(no replica died)"]
                nursery.cancel_scope.cancel()

            nursery.start_soon(watchdog, name=f"deadline of {nodeid}")
            # the test's own outcome, never wrapped in this nursery's group
            result = await outcome.acapture(test, **kwargs)
            nursery.cancel_scope.cancel()
        if not report:
            result.unwrap()
            return
        left = kill_processes(left_behind(before))
        message = (
            f"{nodeid} ran past its deadline of {limit:g} s ({TIME_SCALE_VAR}={TIME_SCALE:g}) "
            f"and was cancelled\n" + "\n".join(report)
        )
        if left:
            message += "\nkilled the processes it left: " + "; ".join(left)
        error = result.error if isinstance(result, outcome.Error) else None
        if isinstance(error, trio.Cancelled):
            error = None  # the deadline's own cancellation
        raise DeadlineExceeded(message) from error

    return guarded


def _real_engine_test(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(m) for m in REAL_ENGINE_MARKERS)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    # outside pytest-trio's wrapper: it runs what this leaves in item.obj
    if (
        isinstance(item, pytest.Function)
        and item.get_closest_marker("trio") is not None
        and _real_engine_test(item)
        and inspect.iscoroutinefunction(item.obj)
    ):
        item.obj = _with_deadline(item.obj, item.nodeid)
    return (yield)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's thread method, scaled, which first reports the trio tasks and kills
    every process below this one: its ``os._exit`` must leave no engine running."""
    if settings.method != "thread":
        return None
    import pytest_timeout

    def expire() -> None:
        capman = item.config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            capman.suspend_global_capture(in_=True)
        print(f"\n+++ {item.nodeid} still runs: its trio tasks +++", file=sys.stderr)
        print("\n".join(_trio_task_stacks() or ["(no live trio task)"]), file=sys.stderr)
        killed = kill_processes(descendants())
        print(f"+++ killed before exiting: {killed or 'nothing'} +++", file=sys.stderr, flush=True)
        pytest_timeout.timeout_timer(item, settings)  # dumps every thread, then os._exit

    timer = threading.Timer(engine_seconds(settings.timeout), expire)
    timer.name = f"backstop {item.nodeid}"
    timer.daemon = True

    def cancel() -> None:
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel  # type: ignore[attr-defined]
    timer.start()
    return True


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    # whatever a test left running dies with the run, and is named: a leak stays visible
    killed = kill_processes(left_behind())
    if killed:
        print(f"\nkilled the processes left at the end of the run: {killed}", file=sys.stderr)
