"""One asyncio-compatible event loop hosted in the calling thread: :class:`LoopHost`.

A host runs one coroutine function (the hosted worker's main) on a loop of a given kind, in
the thread that calls :meth:`LoopHost.run`, until it returns. Other threads reach the loop
with :meth:`LoopHost.call_soon_threadsafe`, which works from the moment the host exists
(calls made before the loop runs are queued and run first) and answers ``False`` once the
worker has ended. The stop is orderly: :meth:`LoopHost.stop` only tells the worker, which
waits for it with :meth:`LoopHost.wait_for_stop` and ends by returning.

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
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Final, Literal, get_args

from ..errors import BackendUnavailableError

__all__ = ["LOOP_KINDS", "TRIO_ASYNCIO_EXTRA", "LoopHost", "LoopKind", "require_loop"]

LoopKind = Literal["asyncio", "trio-asyncio"]
LOOP_KINDS: Final[tuple[LoopKind, ...]] = get_args(LoopKind)
#: the package extra that installs what the ``trio-asyncio`` kind needs
TRIO_ASYNCIO_EXTRA: Final = "trio-asyncio"

Main = Callable[[], Coroutine[Any, Any, None]]

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


def _trio_asyncio() -> Any:
    try:
        import trio_asyncio
    except ImportError as exc:
        raise BackendUnavailableError(
            f"loop: trio-asyncio needs trio-asyncio ({exc.name or exc}); install "
            f"'omni-trio[{TRIO_ASYNCIO_EXTRA}]'"
        ) from exc
    return trio_asyncio


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
        self._pending: list[tuple[Callable[..., object], tuple[Any, ...]]] = []
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
        for callback, args in pending:
            loop.call_soon(callback, *args)
        try:
            await main()
        finally:
            self._end()

    def _end(self) -> None:
        with self._lock:
            self._state = _ENDED
            self._pending.clear()

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: Any) -> bool:
        """Have the loop call ``callback(*args)`` soon, in order with the other calls; before
        the loop runs, as soon as it does. ``False`` (and nothing is called) once the worker
        has ended. Thread-safe, never blocks, does not wait for the call."""
        with self._lock:
            if self._state == _NEW:
                self._pending.append((callback, args))
                return True
            if self._state == _ENDED:
                return False
            # under the lock: the worker cannot end (and its loop close) meanwhile
            assert self._loop is not None
            self._loop.call_soon_threadsafe(callback, *args)
            return True

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


def _even_out(loop: asyncio.AbstractEventLoop, trio_executor: type[Any]) -> None:
    """Make a trio-asyncio loop take what an asyncio loop takes (the module docstring)."""
    own = loop.run_in_executor

    def run_in_executor(
        executor: concurrent.futures.Executor | None, func: Callable[..., Any], *args: Any
    ) -> asyncio.Future[Any]:
        if executor is None or isinstance(executor, trio_executor):
            return own(executor, func, *args)
        return asyncio.wrap_future(executor.submit(func, *args), loop=loop)

    loop.run_in_executor = run_in_executor  # type: ignore[method-assign,assignment]
    loop.set_exception_handler(_log_like_asyncio)


def _log_like_asyncio(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    # asyncio's own default handler: it logs (trio-asyncio's raises into the loop)
    asyncio.BaseEventLoop.default_exception_handler(loop, context)  # type: ignore[arg-type]
