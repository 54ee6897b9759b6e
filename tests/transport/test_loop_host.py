"""The loop host (``omni_trio.transport.loop_host``) on both loop kinds, in real threads:
calls in before, during and after the worker's life, the orderly stop, what the worker
raises, trio-asyncio's differences evened out, both kinds in one process, and a missing
trio-asyncio. Every wait on a thread is bounded (``GUARD_S``, a hang guard, not a timing).

trio-asyncio is imported by the first test that runs a host of its kind, not when this module
is collected: importing it patches asyncio for the rest of the process (``asyncio.run`` then
runs trio-asyncio's loop), which other modules' tests do not expect."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import logging
import sys
import threading
import typing
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from omni_trio.errors import BackendUnavailableError
from omni_trio.transport.loop_host import LOOP_KINDS, LoopHost, LoopKind, require_loop

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("trio_asyncio") is None, reason="trio-asyncio is not installed"
)

GUARD_S = 30.0

Main = Callable[[], Coroutine[Any, Any, None]]


class Hosted:
    """A host running ``main`` in a thread of its own; ``join()`` returns what run() raised."""

    def __init__(self, kind: LoopKind, main: Main, *, start: bool = True) -> None:
        self.host = LoopHost(kind, name=f"test-{kind}")
        self.main = main
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"host-{kind}")
        if start:
            self.thread.start()

    def _run(self) -> None:
        try:
            self.host.run(self.main)
        except BaseException as exc:
            self.error = exc

    def join(self) -> BaseException | None:
        self.thread.join(GUARD_S)
        assert not self.thread.is_alive(), f"{self.host!r} did not end"
        return self.error


def wait(event: threading.Event | concurrent.futures.Future[Any]) -> Any:
    if isinstance(event, threading.Event):
        assert event.wait(GUARD_S), "not set in time"
        return None
    return event.result(GUARD_S)


@pytest.mark.parametrize("kind", LOOP_KINDS)
def test_calls_before_during_and_after_the_worker_run_in_order_or_are_refused(
    kind: LoopKind,
) -> None:
    calls: list[tuple[str, bool]] = []
    running = threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []

    def record(name: str) -> None:
        # on the loop, in the host's thread
        calls.append((name, threading.current_thread().name == f"host-{kind}"))

    async def main() -> None:
        loops.append(hosted.host.loop)
        record("main")
        running.set()
        await hosted.host.wait_for_stop()

    hosted = Hosted(kind, main, start=False)
    with pytest.raises(RuntimeError, match="not running yet"):
        _ = hosted.host.loop
    assert "new" in repr(hosted.host)
    # before the loop runs: queued, then run first, in order
    assert hosted.host.call_soon_threadsafe(record, "early-1")
    assert hosted.host.call_soon_threadsafe(record, "early-2")
    hosted.thread.start()
    wait(running)
    assert "running" in repr(hosted.host)
    done = threading.Event()
    assert hosted.host.call_soon_threadsafe(record, "during")
    assert hosted.host.call_soon_threadsafe(done.set)
    wait(done)
    assert not hosted.host.stop_requested
    hosted.host.stop()
    hosted.host.stop()  # idempotent
    assert hosted.join() is None
    assert hosted.host.stop_requested and "ended stop_requested" in repr(hosted.host)
    # after the worker ended: refused, never called
    assert not hosted.host.call_soon_threadsafe(record, "late")
    assert calls == [("main", True), ("early-1", True), ("early-2", True), ("during", True)]
    # the asyncio kind is asyncio's own loop, whatever trio_asyncio patched (it is imported)
    is_trio_asyncio = type(loops[0]).__module__.startswith("trio_asyncio")
    assert is_trio_asyncio == (kind == "trio-asyncio")
    with pytest.raises(RuntimeError, match="already run"):
        hosted.host.run(main)


@pytest.mark.parametrize("kind", LOOP_KINDS)
def test_a_stop_before_the_loop_runs_is_seen_at_once(kind: LoopKind) -> None:
    seen: list[bool] = []

    async def main() -> None:
        seen.append(hosted.host.stop_requested)
        await hosted.host.wait_for_stop()  # returns: the stop came first

    hosted = Hosted(kind, main, start=False)
    hosted.host.stop()
    hosted.thread.start()
    assert hosted.join() is None and seen == [True]


@pytest.mark.parametrize("kind", LOOP_KINDS)
def test_run_raises_what_the_worker_raised_and_cancels_its_other_tasks(kind: LoopKind) -> None:
    error = OSError("the worker broke")
    cancelled = threading.Event()

    async def background() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(background())
        await asyncio.sleep(0)
        assert not task.done()
        raise error

    hosted = Hosted(kind, main)
    assert hosted.join() is error  # itself, not wrapped in an exception group
    assert cancelled.is_set()
    assert not hosted.host.call_soon_threadsafe(print)


def test_wait_for_stop_runs_on_the_loop_only() -> None:
    host = LoopHost("asyncio", name="x")

    async def elsewhere() -> None:
        await host.wait_for_stop()

    with pytest.raises(RuntimeError, match="runs on its loop"):
        asyncio.run(elsewhere())
    with pytest.raises(ValueError, match="loop kind must be one of asyncio, trio-asyncio"):
        LoopHost("uvloop", name="x")  # type: ignore[arg-type]


def test_trio_asyncio_takes_a_foreign_executor_as_asyncio_does() -> None:
    # vLLM hands loop.run_in_executor its own ThreadPoolExecutor; trio-asyncio's own loop
    # accepts only None or a TrioExecutor
    got: concurrent.futures.Future[list[str]] = concurrent.futures.Future()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="foreign") as pool:
            foreign = await loop.run_in_executor(pool, lambda: threading.current_thread().name)
        default = await loop.run_in_executor(None, lambda: "default")
        got.set_result([foreign, default])

    hosted = Hosted("trio-asyncio", main)
    assert hosted.join() is None
    foreign, default = wait(got)
    assert foreign.startswith("foreign") and default == "default"


@pytest.mark.parametrize("kind", LOOP_KINDS)
def test_an_error_no_task_retrieved_is_logged_and_the_loop_goes_on(
    kind: LoopKind, caplog: pytest.LogCaptureFixture
) -> None:
    # asyncio's loop logs it; trio-asyncio's own would raise it into the loop and end it
    reported = threading.Event()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.call_exception_handler(
            {"message": "Task exception was never retrieved", "exception": KeyError("lost")}
        )
        reported.set()
        await asyncio.sleep(0)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        hosted = Hosted(kind, main)
        assert hosted.join() is None
    wait(reported)
    assert "Task exception was never retrieved" in caplog.text and "KeyError" in caplog.text


def test_both_kinds_in_one_process_call_into_each_other() -> None:
    # the process imported trio_asyncio (the other host): the asyncio host keeps asyncio's
    # loop, and each loop reaches the other through its host
    hosts: dict[str, Hosted] = {}
    ready = {kind: threading.Event() for kind in LOOP_KINDS}
    pings: list[tuple[str, str]] = []
    pinged = threading.Event()

    def make_main(kind: LoopKind) -> Main:
        async def main() -> None:
            ready[kind].set()
            await hosts[kind].host.wait_for_stop()

        return main

    def ping(kind: LoopKind, hops: int) -> None:
        pings.append((kind, type(asyncio.get_running_loop()).__name__))
        if hops:
            other: LoopKind = "asyncio" if kind == "trio-asyncio" else "trio-asyncio"
            assert hosts[other].host.call_soon_threadsafe(ping, other, hops - 1)
        else:
            pinged.set()

    for kind in LOOP_KINDS:
        hosts[kind] = Hosted(kind, make_main(kind), start=False)
    for hosted in hosts.values():
        hosted.thread.start()
    for event in ready.values():
        wait(event)
    assert hosts["asyncio"].host.call_soon_threadsafe(ping, "asyncio", 3)
    wait(pinged)
    for hosted in hosts.values():
        hosted.host.stop()
    assert [hosted.join() for hosted in hosts.values()] == [None, None]
    assert [kind for kind, _ in pings] == ["asyncio", "trio-asyncio"] * 2
    assert pings[0][1] == "_UnixSelectorEventLoop" and pings[1][1] == "TrioEventLoop"


def test_a_missing_trio_asyncio_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "trio_asyncio", None)
    with pytest.raises(BackendUnavailableError, match=r"install 'omni-trio\[trio-asyncio\]'"):
        require_loop("trio-asyncio")
    require_loop("asyncio")  # needs nothing
    # a host of that kind fails its run with the same error, and refuses calls after it
    ran: list[bool] = []

    async def main() -> None:
        ran.append(True)

    hosted = Hosted("trio-asyncio", main)
    assert isinstance(hosted.join(), BackendUnavailableError) and ran == []
    assert not hosted.host.call_soon_threadsafe(print)
    with pytest.raises(ValueError, match="loop kind must be one of"):
        require_loop("uvloop")  # type: ignore[arg-type]


def test_the_config_offers_exactly_the_loop_kinds_the_host_runs() -> None:
    # the config's option (config/ imports nothing of transport/) and the host agree
    from omni_trio.config.options import VllmLoop

    assert typing.get_args(VllmLoop) == LOOP_KINDS


# -- submit: a coroutine's outcome in a future --------------------------------------------------


@pytest.mark.parametrize("kind", LOOP_KINDS)
def test_submit_runs_coroutines_before_and_during_the_worker_and_refuses_after(
    kind: LoopKind,
) -> None:
    forever = threading.Event()  # set once the never-ending task runs
    cancelled: list[str] = []

    async def answer(value: int) -> int:
        await asyncio.sleep(0)
        return value

    async def fail() -> None:
        raise KeyError("on the loop")

    async def never(tag: str) -> None:
        forever.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(tag)
            raise

    async def main() -> None:
        await hosted.host.wait_for_stop()

    hosted = Hosted(kind, main, start=False)
    early = hosted.host.submit(answer(1))  # queued until the loop runs
    hosted.thread.start()
    assert wait(early) == 1
    assert wait(hosted.host.submit(answer(2))) == 2
    with pytest.raises(KeyError, match="on the loop"):
        wait(hosted.host.submit(fail()))
    # the caller cancels: the task is cancelled on the loop
    dropped = hosted.host.submit(never("dropped"))
    wait(forever)
    assert dropped.cancel()
    forever.clear()
    # still running when the worker ends: cancelled by the loop's close, and its future too
    left = hosted.host.submit(never("left"))
    wait(forever)
    hosted.host.stop()
    assert hosted.join() is None
    assert left.cancelled() and sorted(cancelled) == ["dropped", "left"]
    late = answer(3)
    with pytest.raises(RuntimeError, match="has ended"):
        hosted.host.submit(late)
    assert late.cr_frame is None  # closed, never run: no "never awaited" warning


# -- a trio loop in a thread of its own --------------------------------------------------------


def test_a_trio_portal_runs_calls_in_its_own_thread_and_leaving_waits_for_its_tasks() -> None:
    import trio

    from omni_trio.transport.loop_host import open_trio_portal

    finished: list[str] = []

    async def where() -> tuple[str, bool]:
        await trio.lowlevel.checkpoint()
        thread = threading.current_thread()
        return thread.name, thread.daemon

    async def slow() -> None:
        await trio.sleep(0.01)
        finished.append("slow")

    with open_trio_portal(name="test-trio-portal") as portal:
        assert portal.call(where) == ("test-trio-portal", False)
        portal.start_task_soon(slow)
    # leaving waited for the task, and joined the thread
    assert finished == ["slow"]
    assert "test-trio-portal" not in [t.name for t in threading.enumerate()]


def test_leaving_a_trio_portal_by_an_error_cancels_its_tasks() -> None:
    import trio

    from omni_trio.transport.loop_host import open_trio_portal

    seen: list[str] = []

    async def forever() -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            seen.append("cancelled")
            raise

    with pytest.raises(OSError, match="the caller broke"):
        with open_trio_portal(name="test-trio-portal") as portal:
            future = portal.start_task_soon(forever)
            raise OSError("the caller broke")
    assert seen == ["cancelled"] and future.cancelled()
    assert "test-trio-portal" not in [t.name for t in threading.enumerate()]


# -- the interpreter's exit stops what its owner left running -----------------------------------

_LEFT_RUNNING = """
import logging, sys, threading
logging.basicConfig(stream=sys.stdout, format="%(message)s")
from omni_trio.transport.loop_host import LoopHost, open_trio_portal, stop_before_exit

# an asyncio loop in a non-daemon thread whose owner never stops it
host = LoopHost("asyncio", name="left")
threading.Thread(target=host.run, args=(host.wait_for_stop,), name="left-loop").start()
stop_before_exit(lambda: (host.stop(), print("stopped the asyncio loop", flush=True)), name="a")

def broken():
    raise OSError("this stop broke")

stop_before_exit(broken, name="the broken one")
withdraw = stop_before_exit(lambda: print("withdrawn, never called"), name="b")
withdraw()
withdraw()

# a trio portal entered and never left, with a task that runs until it is cancelled
import trio

async def forever():
    try:
        await trio.sleep_forever()
    finally:
        print("the trio task was cancelled", flush=True)

left = open_trio_portal(name="left-trio")  # held: a collected one would be left, so stopped
portal = left.__enter__()
portal.start_task_soon(forever)
print("main ends", flush=True)
"""


def test_the_interpreters_exit_stops_hosted_loops_their_owners_left_running() -> None:
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    # a hang guard: without the stops, the exit would wait for the two threads forever
    done = subprocess.run(
        [sys.executable, "-c", _LEFT_RUNNING],
        env=env,
        capture_output=True,
        text=True,
        timeout=GUARD_S,
    )
    assert done.returncode == 0, done.stderr
    # oldest first; the broken stop is logged and the one after it still runs
    lines = done.stdout.splitlines()
    assert lines[:3] == [
        "main ends",
        "stopped the asyncio loop",
        "stopping the broken one at the interpreter's exit failed",
    ]
    assert "OSError: this stop broke" in done.stdout
    assert lines[-1] == "the trio task was cancelled"
    assert "withdrawn" not in done.stdout
