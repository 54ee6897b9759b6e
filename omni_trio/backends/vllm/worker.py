"""The worker-thread side of the vLLM backend: one AsyncLLM on the worker's own event loop.

Everything here runs in the replica's worker thread, on an event loop the worker's
:class:`~omni_trio.transport.loop_host.LoopHost` runs there, never on the orchestrator's trio
loop. The stage option ``loop`` picks it: a plain asyncio loop (the default), or the design
card's ``trio.run`` + ``trio_asyncio.open_loop()``. Why asyncio by default: measured on this
machine (``benchmarks/bench_vllm_pipeline.py``), the same pipeline costs 1.3-1.4x the frontend
CPU per request-stage with its workers on trio-asyncio's loop (a trio scheduler trip, a cancel
scope and a channel receive per asyncio callback). The worker's code is the same on both: the
orchestrator stays trio, and every crossing is loop-agnostic (the host's
``call_soon_threadsafe`` inwards, the bridge's non-blocking sends outwards).

Commands (:class:`Submit`, :class:`Abort`, :class:`Resume`, :class:`Rpc`) arrive through
:meth:`EngineWorker.command` (thread-safe); the worker answers RPCs itself and hands the
others to the started engine's :class:`~._vllm_requests.EngineRequests`. Outputs leave in one
batch per engine step on the replica's output bridge (:mod:`.outputs`); the worker
reports its life (its start outcome, then :class:`Died`) on an event bridge, and closes both
on its loop as its last act.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import anyio
import outcome

from ...errors import ConfigError, ReplicaDeadError, StageError, StageStartError
from ...failures import group_causes
from ...transport.bridge import BridgeSender
from ...transport.loop_host import LoopHost, LoopKind
from .engine_requests import EngineRequests, RequestCommand
from .process import SpawnWindow, engine_core_children, import_vllm, kill, reap
from .process import shutdown_engine as _shutdown
from .protocol import Batch, Died, Ready, Rpc, Submit, chat_template_of, merge_engine_args
from .torchvision_cpu import prepare_for_model

logger = logging.getLogger(__name__)

Command = RequestCommand | Rpc


class EngineWorker:
    """Runs in the worker thread: builds the AsyncLLM, serves commands, shuts it down."""

    def __init__(
        self,
        *,
        name: str,
        replica: int,
        engine_args: dict[str, Any],
        options: dict[str, Any],
        evt_tx: BridgeSender[Any],
        out_tx: BridgeSender[Batch],
        on_exit: Callable[[], None],
        on_phase: Callable[[str], None] = lambda phase: None,
        mm_scope: tuple[str, int] | None = None,
        loop: LoopKind = "asyncio",
    ) -> None:
        self.name = name
        self.replica = replica
        #: (stage id, replica) that prompts' multimodal UUIDs are scoped to (_vllm_mm)
        self.mm_scope = mm_scope
        self.engine_args = engine_args
        self.options = options
        self._evt_tx = evt_tx
        self._out_tx = out_tx
        self._on_exit = on_exit
        self._on_phase = on_phase
        self.core_pids: list[int] = []
        self.engine: Any = None
        self._procs: list[Any] = []
        self.v: SimpleNamespace | None = None
        # command() has a target from the start: the host queues calls until its loop runs
        self._host = LoopHost(loop, name=name)
        self._inbox_lock = threading.Lock()
        self._inbox: list[Command] = []  # commands not yet taken by the loop
        self._inbox_scheduled = False
        self._rpcs: set[asyncio.Task[None]] = set()
        self._requests: EngineRequests | None = None  # once the engine started
        #: why the worker's loop ended with an error (set before both bridges close; the
        #: backend reads it once the event bridge ended or the thread exited)
        self.crash: BaseException | None = None
        # what request tasks raised (the stop fails with them)
        self._task_errors: list[BaseException] = []

    # -- from the backend's thread ----------------------------------------------------------
    @property
    def loop_kind(self) -> LoopKind:
        """The kind of loop the worker runs on (the stage option ``loop``)."""
        return self._host.kind

    def run(self) -> None:
        """The thread's target: run the worker on its loop to its end; both bridges are
        closed by then."""
        try:
            self._host.run(self._life)
        except BaseException as exc:
            if self.crash is None:  # the loop itself failed, not the worker
                self.crash = exc
            logger.exception("vllm worker %s crashed", self.name)
        finally:
            # already closed, unless the loop never ran the worker
            self._out_tx.close()
            self._evt_tx.close()
            self._on_exit()

    def command(self, cmd: Command) -> bool:
        """Hand ``cmd`` to the worker's loop; ``False`` if the worker has ended (its loop is
        closed). Thread-safe, never blocks.

        Commands queue here and the loop takes them all at once: a burst (64 submits, the
        aborts of a closing engine) costs one wake-up of the worker, not one each.
        """
        with self._inbox_lock:
            self._inbox.append(cmd)
            if self._inbox_scheduled:
                return True
            self._inbox_scheduled = True
        if not self._host.call_soon_threadsafe(self._take_commands):
            # the worker has ended: so will every later command find it
            with self._inbox_lock:
                self._inbox_scheduled = False
            return False
        return True

    def _take_commands(self) -> None:
        with self._inbox_lock:
            commands, self._inbox = self._inbox, []
            self._inbox_scheduled = False
        for cmd in commands:
            self._command(cmd)

    def stop(self) -> None:
        """Ask the worker to stop: a start in progress is abandoned (its half-built
        EngineCore killed), a running engine is shut down cleanly. Thread-safe, idempotent."""
        self._host.stop()

    def cancel_start(self) -> None:
        """:meth:`stop`, and kill a half-built EngineCore now. Thread-safe."""
        self.stop()
        if self.engine is None:
            kill(self.core_pids)

    # -- the loop ---------------------------------------------------------------------------
    async def _life(self) -> None:
        try:
            await self._main()
        except BaseException as exc:
            self.crash = exc  # before the bridges close: the backend reads it then
            raise
        finally:
            # on the loop: on trio-asyncio the ends are bound to this thread's trio loop, and
            # an end still open when that loop ends counts as lost (the backend would read
            # BrokenResourceError where the stream ended)
            self._out_tx.close()
            self._evt_tx.close()

    async def _main(self) -> None:
        try:
            self.v = import_vllm()
            self._on_phase("vllm_imported")
            await self._start_engine()
        except Exception as exc:
            self._evt_tx.send_nowait(outcome.Error(exc))
            self._after_failed_start()
            return
        self._requests = EngineRequests(
            name=self.name,
            v=self.v,
            engine=self.engine,
            loop=self._host.loop,
            out_tx=self._out_tx,
            mm_scope=self.mm_scope,
            on_failure=self._request_failed,
        )
        try:
            if self._host.stop_requested:
                return
            self._evt_tx.send_nowait(outcome.Value(Ready(tuple(self.core_pids))))
            for proc in self._procs:
                self._host.loop.add_reader(proc.sentinel, self._core_exited, proc)
            await self._host.wait_for_stop()
        finally:
            errors = await self._end_tasks()
            self._shutdown_engine()
            if errors:
                # a request task's own failure (its abort in vLLM failed): the stop fails
                raise StageError(
                    f"replica {self.name}: {len(errors)} request task(s) failed while the "
                    f"worker stopped"
                ) from group_causes("request tasks that failed", errors)

    def _after_failed_start(self) -> None:
        kill(self.core_pids)
        reap(self.core_pids)

    async def _start_engine(self) -> None:
        v = self.v
        assert v is not None
        args = merge_engine_args(self.engine_args, on_cpu=v.on_cpu)
        known = {f.name for f in dataclasses.fields(v.AsyncEngineArgs)}
        for key in args:
            if key not in known:
                raise ConfigError(f"engine_args key {key!r} is not a vllm AsyncEngineArgs field")
        from ...models.tiny import resolve_model

        for key in ("model", "tokenizer"):
            if key in args:
                args[key] = resolve_model(str(args[key]))
        # the Qwen-VL family's modules import torchvision: here, and in the engine's processes
        # through the plugin (what they need comes in the spawn window's environment)
        spawn_env = prepare_for_model(str(args["model"])) if "model" in args else {}
        self._on_phase("model_ready")
        engine_args = v.AsyncEngineArgs(**args)
        host = self._host
        done = asyncio.Event()
        result: list[Any] = []
        bind = self.options.get("cpu_bind")
        if isinstance(bind, (list, tuple)):
            bind = bind[self.replica % len(bind)] if bind else None
        if bind is not None:
            spawn_env["VLLM_CPU_OMP_THREADS_BIND"] = str(bind)
        window = SpawnWindow(spawn_env)

        def build() -> None:
            # Runs in a helper thread: construction blocks ~20 s and must not stall this
            # loop, which watches for a stop meanwhile.
            try:
                window.open()
                if not host.stop_requested:
                    result.append(v.AsyncLLM.from_engine_args(engine_args))
                else:
                    result.append(StageStartError(self.name, "start was cancelled"))
            except BaseException as exc:
                result.append(exc)
            finally:
                window.close()
                host.call_soon_threadsafe(done.set)

        helper = threading.Thread(target=build, name=f"{self.name}-build")
        helper.start()
        while not done.is_set():
            # Start-up only: a 20 Hz look for the EngineCore child (its pid is what a
            # stopped start must kill, and its appearance ends the spawn window).
            try:
                await asyncio.wait_for(done.wait(), 0.05)
            except TimeoutError:
                pass
            if window.opened.is_set() and not self.core_pids:
                self.core_pids.extend(engine_core_children(window.before))
                if self.core_pids:
                    window.close()
            if host.stop_requested:
                kill(self.core_pids)
        helper.join()
        (built,) = result
        if isinstance(built, BaseException):
            raise built
        self.engine = built
        manager = getattr(built.engine_core.resources, "engine_manager", None)
        self._procs = list(getattr(manager, "processes", []))
        self.core_pids[:] = [p.pid for p in self._procs]

    def _core_exited(self, proc: Any) -> None:
        self._host.loop.remove_reader(proc.sentinel)
        proc.join(0)
        reason = f"EngineCore process {proc.pid} exited (exit code {proc.exitcode})"
        logger.warning("vllm worker %s: %s", self.name, reason)
        try:
            self._evt_tx.send_nowait(Died(reason))
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # nobody listens any more (the backend is stopping)

    def _request_failed(self, request_id: str, error: BaseException) -> None:
        # A request's task raised (only its abort in vLLM can: everything else is posted to
        # the request): vLLM may still run it, so the engine can no longer be trusted and
        # the replica dies of it. The stop fails with it too (_main), unless the replica
        # died of it: nobody may read the death (a stop may already be under way).
        reason = f"request {request_id!r} could not be dropped: {type(error).__name__}: {error}"
        logger.warning("vllm worker %s: %s", self.name, reason)
        self._task_errors.append(error)
        try:
            self._evt_tx.send_nowait(Died(reason, error))
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # nobody listens any more: the stop reports it

    # -- commands ---------------------------------------------------------------------------
    def _command(self, cmd: Command) -> None:
        if isinstance(cmd, Rpc):
            rpc = self._host.loop.create_task(self._rpc(cmd))
            self._rpcs.add(rpc)
            rpc.add_done_callback(self._rpcs.discard)
            return
        requests = self._requests
        if isinstance(cmd, Submit) and (requests is None or self._host.stop_requested):
            # never started, or stopping: the request fails at once
            self._refuse(cmd)
        elif requests is not None:
            requests.command(cmd)

    def _refuse(self, sub: Submit) -> None:
        error = ReplicaDeadError(f"replica {self.name} is stopping")
        try:
            self._out_tx.send_nowait([(sub.request_id, outcome.Error(error))])
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    async def _end_tasks(self) -> list[BaseException]:
        """Cancel every request and RPC task and wait for them: each request posts its END
        after vLLM dropped it, and the last flush sends them. Returns what the tasks raised
        other than their cancellation."""
        requests = self._requests
        request_tasks = list(requests.tasks.values()) if requests is not None else []
        rpcs = list(self._rpcs)
        for task in (*request_tasks, *rpcs):
            task.cancel()
        results = await asyncio.gather(*request_tasks, *rpcs, return_exceptions=True)
        if requests is not None:
            requests.outputs.flush()
        # a request task's error already reached _request_failed (its done callback runs
        # before gather's): only the RPC tasks' results are looked at here
        rpc_errors = [
            r
            for r in results[len(request_tasks) :]
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)
        ]
        return [*self._task_errors, *rpc_errors]

    async def _rpc(self, rpc: Rpc) -> None:
        reply: outcome.Outcome[Any]
        try:
            reply = outcome.Value(await self._control(rpc))
        except asyncio.CancelledError:
            reply = outcome.Error(ReplicaDeadError(f"replica {self.name} stopped"))
        except Exception as exc:
            reply = outcome.Error(exc)
        try:
            rpc.reply.send_nowait(reply)
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the caller stopped waiting
        rpc.reply.close()

    async def _control(self, rpc: Rpc) -> Any:
        engine = self.engine
        if rpc.method == "get_num_unfinished_requests":
            return engine.get_num_unfinished_requests()
        if rpc.method == "get_num_queued_tokens":
            return engine.get_num_queued_tokens()
        if rpc.method == "engine_core_pids":
            return list(self.core_pids)
        if rpc.method == "check_health":
            return await engine.check_health()
        if rpc.method == "reset_prefix_cache":
            return await engine.reset_prefix_cache()
        if rpc.method == "chat_template":
            return chat_template_of(engine.tokenizer)
        return await engine.collective_rpc(
            rpc.method, timeout=None, args=rpc.args, kwargs=rpc.kwargs
        )

    # -- stop -------------------------------------------------------------------------------
    def _shutdown_engine(self) -> None:
        """Blocking (in this thread): stop the AsyncLLM and reap its processes."""
        for proc in self._procs:
            self._host.loop.remove_reader(proc.sentinel)
        if self.engine is None:
            self._after_failed_start()
            return
        grace = float(self.options.get("core_shutdown_grace_s", 1.0))
        try:
            _shutdown(self.engine, self._procs, self.core_pids, grace)
        except Exception:
            logger.exception("vllm worker %s: AsyncLLM.shutdown failed", self.name)
        self.engine = None

    def __repr__(self) -> str:
        requests = len(self._requests) if self._requests is not None else 0
        return (
            f"<EngineWorker {self.name} loop={self._host.kind} "
            f"engine={'up' if self.engine is not None else 'none'} "
            f"requests={requests} rpcs={len(self._rpcs)} core_pids={self.core_pids}>"
        )
