"""The one way this package hosts an event loop in a thread: :class:`LoopHost` for an
asyncio-compatible loop, :func:`open_trio_portal` for a trio loop, and
:func:`stop_before_exit`, which stops either at the interpreter's exit.

A host runs one coroutine function (the hosted worker's main) on a loop of a given kind, in
the thread that calls :meth:`LoopHost.run`, until it returns. Other threads reach the loop
with :meth:`LoopHost.call_soon_threadsafe` and :meth:`LoopHost.submit`, which work from the
moment the host exists (calls made before the loop runs are queued and run first) and refuse
once the worker has ended. The stop is orderly: :meth:`LoopHost.stop` only tells the worker,
which waits for it with :meth:`LoopHost.wait_for_stop` and ends by returning. The owner makes
the thread (what it does there before and after the loop is its own: a Ray connection, a
vLLM engine's build).

A trio loop is hosted by :func:`open_trio_portal`: a thread of its own and anyio's
``BlockingPortal`` into it (anyio's ``start_blocking_portal`` does the same on a daemon
thread).

No hosting thread is a daemon: each ends by an orderly stop, so the interpreter's exit waits
for it. One whose owner never stopped it is stopped by :func:`stop_before_exit`, which runs
before that wait (an ``atexit`` hook runs after it, too late).

Loop kinds (:data:`LOOP_KINDS`):

``asyncio``       a plain ``asyncio.SelectorEventLoop`` under ``asyncio.Runner``. Built by
                  class, not with ``asyncio.new_event_loop()``, which makes trio-asyncio's own
                  loop in a process that has imported it.
``trio-asyncio``  ``trio.run`` with ``trio_asyncio.open_loop()``, the worker run as an asyncio
                  task on it. trio-asyncio is imported on the first use of this kind only
                  (:func:`require_loop`): importing it patches asyncio's loop policy and
                  ``get_running_loop`` for the whole process. Its loop differs from asyncio's
                  in two ways a worker would trip on, which the host evens out:
                  ``run_in_executor`` accepts only ``None`` or a ``TrioExecutor`` (vLLM hands
                  it its own ``ThreadPoolExecutor``): a foreign executor gets the job through
                  its own ``submit``; and an error no task retrieved is raised into the loop,
                  ending it: here it is logged, as asyncio's loop does.

Measured on a 2-core machine (``benchmarks/bench_vllm_pipeline.py``, ``omni_ta`` against
``omni``), vLLM engines hosted on trio-asyncio's loop cost 1.3-1.4x the frontend CPU per
request of the same on asyncio's own (a trio scheduler trip and a channel receive per asyncio
callback), so ``asyncio`` is the default wherever a kind is chosen.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from functools import partial
from types import ModuleType
from typing import Final, Literal, TypeVar, TypeVarTuple, Unpack, cast, get_args

from anyio.from_thread import BlockingPortal

from ..errors import BackendUnavailableError

__all__ = [
    "LOOP_KINDS",
    "TRIO_ASYNCIO_EXTRA",
    "LoopHost",
    "LoopKind",
    "open_trio_portal",
    "require_loop",
    "stop_before_exit",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

LoopKind = Literal["asyncio", "trio-asyncio"]
LOOP_KINDS: Final[tuple[LoopKind, ...]] = get_args(LoopKind)
#: the package extra that installs what the ``trio-asyncio`` kind needs
TRIO_ASYNCIO_EXTRA: Final = "trio-asyncio"

Main = Callable[[], Coroutine[object, object, None]]

_NEW: Final = "new"
_RUNNING: Final = "running"
_ENDED: Final = "ended"


def require_loop(kind: LoopKind) -> None:
    """Import what a loop of ``kind`` needs (trio-asyncio for ``trio-asyncio``, once per
    process). Blocking (an import). Raises :class:`BackendUnavailableError` naming the extra
    to install, ``ValueError`` for an unknown kind."""
    if kind not in LOOP_KINDS:
        raise ValueError(f"loop kind must be one of {', '.join(LOOP_KINDS)}, got {kind!r}")
    if kind == "trio-asyncio":
        _trio_asyncio()


def _trio_asyncio() -> ModuleType:
    try:
        import trio_asyncio
    except ImportError as exc:
        raise BackendUnavailableError(
            f"loop: trio-asyncio needs trio-asyncio ({exc.name or exc}); install "
            f"'omni-trio[{TRIO_ASYNCIO_EXTRA}]'"
        ) from exc
    return cast(ModuleType, trio_asyncio)  # untyped: mypy sees Any


class LoopHost:
    """Runs one worker coroutine on a loop of ``kind`` in the thread that calls :meth:`run`.

    Every method but :meth:`run` and :meth:`wait_for_stop` is thread-safe and never blocks.
    A host runs once.
    """

    def __init__(self, kind: LoopKind, *, name: str) -> None:
        if kind not in LOOP_KINDS:
            raise ValueError(f"loop kind must be one of {', '.join(LOOP_KINDS)}, got {kind!r}")
        self.kind: LoopKind = kind
        self.name = name
        self._lock = threading.Lock()
        self._state: str = _NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[Callable[[], object]] = []
        self._stop_requested = threading.Event()
        self._stopping: asyncio.Event | None = None  # on the loop, once it runs
        self._ran = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop. Raises ``RuntimeError`` before the worker started."""
        loop = self._loop
        if loop is None:
            raise RuntimeError(f"loop host {self.name!r}: its loop is not running yet")
        return loop

    @property
    def stop_requested(self) -> bool:
        """Whether :meth:`stop` was called. Thread-safe."""
        return self._stop_requested.is_set()

    def run(self, main: Main) -> None:
        """Run ``main()`` on a new loop of this host's kind in this thread until it returns,
        then close the loop (its other tasks are cancelled and awaited first). Blocking.

        Returns when ``main`` returned; raises what it raised, or what failed the loop
        (:class:`BackendUnavailableError` when trio-asyncio is missing). Raises
        ``RuntimeError`` on a second call.
        """
        with self._lock:
            if self._ran:
                raise RuntimeError(f"loop host {self.name!r} has already run")
            self._ran = True
        try:
            if self.kind == "asyncio":
                # by class: in a process that imported trio_asyncio, new_event_loop() builds
                # trio-asyncio's synchronous loop
                loop = asyncio.SelectorEventLoop()
                with asyncio.Runner(loop_factory=lambda: loop) as runner:
                    runner.run(self._hosted(main))
            else:
                self._run_trio_asyncio(main)
        finally:
            self._end()

    def _run_trio_asyncio(self, main: Main) -> None:
        import outcome
        import trio

        trio_asyncio = _trio_asyncio()

        async def in_trio() -> outcome.Outcome[None]:
            async with trio_asyncio.open_loop() as loop:
                _even_out(loop, trio_asyncio.TrioExecutor)
                # captured here: open_loop's nurseries would wrap it in exception groups
                ended: outcome.Outcome[None] = await outcome.acapture(
                    loop.run_aio_coroutine, self._hosted(main)
                )
                return ended

        trio.run(in_trio).unwrap()

    async def _hosted(self, main: Main) -> None:
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        with self._lock:
            self._loop = loop
            self._state = _RUNNING
            pending, self._pending = self._pending, []
        if self._stop_requested.is_set():
            self._stopping.set()
        for call in pending:
            loop.call_soon(call)
        try:
            await main()
        finally:
            self._end()

    def _end(self) -> None:
        with self._lock:
            self._state = _ENDED
            self._pending.clear()

    def call_soon_threadsafe(self, callback: Callable[[Unpack[Ts]], object], *args: *Ts) -> bool:
        """Have the loop call ``callback(*args)`` soon, in order with the other calls; before
        the loop runs, as soon as it does. ``False`` (and nothing is called) once the worker
        has ended. Thread-safe, never blocks, does not wait for the call."""
        with self._lock:
            if self._state == _NEW:
                self._pending.append(partial(callback, *args))
                return True
            if self._state == _ENDED:
                return False
            # under the lock: the worker cannot end (and its loop close) meanwhile
            assert self._loop is not None
            self._loop.call_soon_threadsafe(callback, *args)
            return True

    def submit(self, coro: Coroutine[object, object, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` as a task on the loop (before the loop runs, as soon as it does); its
        outcome in the returned future. Cancelling the future cancels the task; a task still
        running when the worker ends is cancelled (the loop's close), and so is its future.
        Thread-safe, never blocks. Raises ``RuntimeError`` (and closes ``coro``) once the
        worker has ended."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self.call_soon_threadsafe(self._start_task, coro, future):
            coro.close()
            raise RuntimeError(f"loop host {self.name!r} has ended: it runs nothing more")
        return future

    def _start_task(
        self, coro: Coroutine[object, object, T], future: concurrent.futures.Future[T]
    ) -> None:
        # on the loop. The future stays pending until the task is done, so that the caller
        # can still cancel it (a running concurrent future cannot be cancelled)
        if future.cancelled():
            coro.close()
            return
        task = asyncio.ensure_future(coro)

        def cancel_task(done: concurrent.futures.Future[T]) -> None:
            if done.cancelled():
                self.call_soon_threadsafe(task.cancel)

        def settle(done: asyncio.Future[T]) -> None:
            if done.cancelled():
                future.cancel()
            elif future.set_running_or_notify_cancel():
                error = done.exception()
                if error is None:
                    future.set_result(done.result())
                else:
                    future.set_exception(error)

        task.add_done_callback(settle)
        future.add_done_callback(cancel_task)

    def stop(self) -> None:
        """Tell the worker to stop: :meth:`wait_for_stop` returns and :attr:`stop_requested`
        is true. The worker decides how it ends. Thread-safe, idempotent, never blocks."""
        if not self._stop_requested.is_set():
            self._stop_requested.set()
            self.call_soon_threadsafe(self._wake_stop)

    def _wake_stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def wait_for_stop(self) -> None:
        """On the loop: return once :meth:`stop` was called. Checkpoints."""
        stopping = self._stopping
        if stopping is None:
            raise RuntimeError(f"loop host {self.name!r}: wait_for_stop() runs on its loop")
        await stopping.wait()

    def __repr__(self) -> str:
        stop = " stop_requested" if self.stop_requested else ""
        return f"<LoopHost {self.name!r} {self.kind} {self._state}{stop}>"


_exit_lock = threading.Lock()
_exit_stops: dict[int, tuple[str, Callable[[], None]]] = {}
_exit_keys = itertools.count()
_exit_hooked = False


def stop_before_exit(stop: Callable[[], None], *, name: str) -> Callable[[], None]:
    """Have ``stop()`` called when the interpreter begins to exit, before it waits for the
    process's non-daemon threads; returns the function that withdraws it (idempotent: call
    it once the thing stopped otherwise). Thread-safe, never blocks.

    A thread that hosts a loop is not a daemon, so the exit waits for it: one whose owner
    never stopped it would hang the exit. ``atexit`` hooks run after that wait, too late;
    these run before it (``threading._register_atexit``, as ``concurrent.futures`` stops its
    own workers), each in turn, oldest first: what a host runs may hold a host made later
    (an engine in a trio portal holds the Ray link), and stopping the older one first lets
    it release what it holds in order. A stop that raises is logged, as there is no caller
    left to raise to, and the others still run. Raises ``RuntimeError`` once the
    exit has begun (no new thread may start then either).
    """
    global _exit_hooked
    key = next(_exit_keys)
    with _exit_lock:
        if not _exit_hooked:
            # not in typeshed: the hook concurrent.futures' workers and anyio's selector
            # thread stop by
            threading._register_atexit(_stop_all_before_exit)  # type: ignore[attr-defined]
            _exit_hooked = True
        _exit_stops[key] = (name, stop)

    def withdraw() -> None:
        with _exit_lock:
            _exit_stops.pop(key, None)

    return withdraw


def _stop_all_before_exit() -> None:
    while True:
        with _exit_lock:
            if not _exit_stops:
                return
            name, stop = _exit_stops.pop(min(_exit_stops))
        try:
            stop()
        except BaseException:
            logger.exception("stopping %s at the interpreter's exit failed", name)


@contextlib.contextmanager
def open_trio_portal(*, name: str) -> Iterator[BlockingPortal]:
    """Run a trio loop in a thread of its own named ``name`` (not a daemon) and yield anyio's
    ``BlockingPortal`` into it: other threads run calls and tasks there through it.

    Blocking: enters once the loop runs, raising what failed its start. Leaving the block
    stops the portal, waiting for the tasks still running there (cancelling them when the
    block raised), and joins the thread; it then raises what failed the loop, if anything
    did. A portal still open when the interpreter exits is stopped then, its tasks cancelled
    (:func:`stop_before_exit`).
    """
    import anyio

    ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()
    failed: list[BaseException] = []

    async def serve() -> None:
        async with BlockingPortal() as portal:
            ready.set_result(portal)
            await portal.sleep_until_stopped()

    def run() -> None:
        try:
            anyio.run(serve, backend="trio")
        except BaseException as exc:
            if ready.done():
                failed.append(exc)
            else:
                ready.set_exception(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    try:
        portal = ready.result()
    except BaseException:
        thread.join()
        raise

    def stop(cancel_remaining: bool) -> None:
        with contextlib.suppress(RuntimeError):  # already stopped: the portal is not running
            portal.call(portal.stop, cancel_remaining)
        thread.join()

    withdraw = stop_before_exit(lambda: stop(True), name=f"the trio loop {name!r}")
    cancel_remaining = False
    try:
        yield portal
    except BaseException:
        cancel_remaining = True
        raise
    finally:
        withdraw()
        stop(cancel_remaining)
        if failed:
            raise failed[0]


def _even_out(loop: asyncio.AbstractEventLoop, trio_executor: type[object]) -> None:
    """Make a trio-asyncio loop take what an asyncio loop takes (the module docstring)."""
    own = loop.run_in_executor

    def run_in_executor(
        executor: concurrent.futures.Executor | None,
        func: Callable[[Unpack[Ts]], T],
        *args: *Ts,
    ) -> asyncio.Future[T]:
        if executor is None or isinstance(executor, trio_executor):
            return own(executor, func, *args)
        return asyncio.wrap_future(executor.submit(func, *args), loop=loop)

    loop.run_in_executor = run_in_executor  # type: ignore[method-assign]
    loop.set_exception_handler(_log_like_asyncio)


def _log_like_asyncio(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
    # asyncio's own default handler: it logs (trio-asyncio's raises into the loop)
    asyncio.BaseEventLoop.default_exception_handler(loop, context)  # type: ignore[arg-type]
