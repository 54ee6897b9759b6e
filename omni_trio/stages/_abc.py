"""The stage backend contract: one replica of one stage.

A backend is started with ``await nursery.start(backend.serve)``: ``serve`` does whatever
start-up the backend needs, calls ``task_status.started()`` when it can take requests, then
runs until cancelled (which is how it is shut down) or until the replica dies.

Requests run as ``await backend.run_request(request_id, inputs, sampling_params, emit)``:
``inputs`` is a receive channel of :class:`~omni_trio.outputs.StageInput` chunks (one chunk
unless the stage has ``stream_input``), and the backend calls ``await emit(output)`` for each
:class:`~omni_trio.outputs.StageOutput` delta, the last one with ``finished=True``.
``emit`` may block: that is backpressure, and the backend must let it. Cancelling the task
that runs ``run_request`` aborts the request in the backend before ``run_request`` returns.

Subclasses implement ``_start``, ``_run`` and optionally ``_stop``, ``_rpc``; this base class
gives every backend the same bookkeeping: per-request cancel scopes (for ``abort``), partial
outputs, replica death (``_die``) failing exactly the requests bound to this replica, and
``statistics()``.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from ..errors import (
    InvalidRequestError,
    NoLiveReplicaError,
    OmniTrioError,
    ReplicaDeadError,
    StageError,
)
from ..outputs import ReplicaStatistics, StageInput, StageOutput

if TYPE_CHECKING:
    from ..config import StageConfig

__all__ = ["Emit", "InputStream", "StageAborted", "StageBackend", "collect_input"]


class StageAborted(OmniTrioError):
    """Raised by ``run_request`` when the request was aborted through ``abort()``."""


Emit = Callable[[StageOutput], Awaitable[None]]
InputStream = trio.MemoryReceiveChannel[StageInput]


async def collect_input(inputs: InputStream) -> StageInput:
    """Merge every chunk of a (possibly streamed) input into one final ``StageInput``.

    For backends that cannot start on partial input. Checkpoints; returns when the
    upstream sends its final chunk or closes.
    """
    prompt: str | None = None
    tokens: list[int] = []
    datas: list[Any] = []
    source: str | None = None
    async for chunk in inputs:
        if chunk.prompt is not None:
            prompt = (prompt or "") + chunk.prompt
        tokens.extend(chunk.token_ids)
        if chunk.data is not None:
            datas.append(chunk.data)
        source = chunk.source or source
        if chunk.final:
            break
    data: Any = None if not datas else datas[0] if len(datas) == 1 else datas
    return StageInput(prompt=prompt, token_ids=tuple(tokens), data=data, final=True, source=source)


@dataclass(eq=False)
class _Running:
    scope: trio.CancelScope
    partial: list[StageOutput] = field(default_factory=list)
    done: trio.Event = field(default_factory=trio.Event)
    aborted: bool = False


class StageBackend(abc.ABC):
    """Base class of stage backends (one instance per replica)."""

    #: the name used in configs ("scripted", "vllm", ...)
    backend_name: str = "custom"

    def __init__(self, config: StageConfig, *, stage_index: int, replica: int = 0) -> None:
        self.config = config
        self.stage_id = config.id
        self.stage_index = stage_index
        self.replica = replica
        self._running: dict[str, _Running] = {}
        self._ready = False
        self._death: BaseException | None = None
        self._stopped = False
        self._n_finished = 0
        self._n_aborted = 0
        self._n_failed = 0
        #: start-up phases -> time.perf_counter() (``start``, backend phases, ``ready``)
        self.timeline: dict[str, float] = {}

    def mark_phase(self, phase: str) -> None:
        """Record a start-up phase (e.g. "thread_started", "engine_constructed",
        "model_loaded"). Safe to call from a backend's worker thread."""
        self.timeline[phase] = time.perf_counter()

    # -- what subclasses implement -------------------------------------------------------
    @abc.abstractmethod
    async def _start(self) -> None:
        """Bring the replica up. Runs inside ``serve`` before readiness is reported."""

    async def _serve_forever(self) -> None:
        """Run while the replica is up (after ``_start``). Default: sleep until cancelled.
        Backends with a background reader override this; returning means the replica died
        unless ``_die`` was called with a better reason."""
        await trio.sleep_forever()

    async def _stop(self) -> None:  # noqa: B027 (optional hook)
        """Release everything ``_start`` acquired. Runs shielded, bounded by the caller."""

    @abc.abstractmethod
    async def _run(
        self, request_id: str, inputs: InputStream, sampling_params: Any, emit: Emit
    ) -> None:
        """Run one request, calling ``emit`` per output. Cancellation must abort it."""

    async def _rpc(self, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        raise StageError(
            f"stage {self.stage_id!r} ({self.backend_name}) has no rpc method {method!r}",
            stage_id=self.stage_id,
        )

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._ready and self._death is None and not self._stopped

    @property
    def name(self) -> str:
        return f"{self.stage_id}[{self.replica}]"

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the replica, report readiness, run until cancelled, then stop it.

        Checkpoints. Cancellation is the shutdown signal: in-flight requests are cancelled
        and ``_stop`` runs shielded (bounded by ``shutdown_timeout`` in the options, default
        30 s). Raises whatever ``_start`` raised if start-up fails.
        """
        try:
            self.mark_phase("start")
            await self._start()
            self.mark_phase("ready")
            self._ready = True
            task_status.started()
            await self._serve_forever()
            if self._death is None:
                self._die(ReplicaDeadError(f"replica {self.name} stopped unexpectedly"))
        finally:
            self._stopped = True
            for running in list(self._running.values()):
                running.scope.cancel()
            with trio.CancelScope(shield=True) as stop_scope:
                stop_scope.deadline = trio.current_time() + float(
                    self.config.options.get("shutdown_timeout", 30.0)
                )
                await self._stop()

    def _die(self, reason: BaseException) -> None:
        """Mark this replica dead and fail every request bound to it. Synchronous."""
        if self._death is None:
            self._death = reason
        for running in list(self._running.values()):
            running.scope.cancel()

    # -- requests ------------------------------------------------------------------------
    async def run_request(
        self, request_id: str, inputs: InputStream, sampling_params: Any, emit: Emit
    ) -> None:
        """Run one request on this replica, streaming its outputs through ``emit``.

        Checkpoints. Cancelling the caller aborts the request here before returning.
        Raises :class:`ReplicaDeadError` if the replica is or becomes dead, a
        :class:`StageError` for request-scoped failures.
        """
        if not self.alive:
            raise self._dead_error(request_id)
        if request_id in self._running:
            raise StageError(
                f"request {request_id!r} is already running on {self.name}",
                stage_id=self.stage_id,
                request_id=request_id,
            )
        running = _Running(scope=trio.CancelScope())
        self._running[request_id] = running

        async def record(out: StageOutput) -> None:
            running.partial.append(out)
            await emit(out)

        try:
            with running.scope:
                await self._run(request_id, inputs, sampling_params, record)
        except (StageError, InvalidRequestError):
            # request-scoped and already typed: bad input stays an InvalidRequestError
            self._n_failed += 1
            raise
        except trio.Cancelled:
            self._n_aborted += 1
            raise
        except Exception as exc:
            self._n_failed += 1
            if self._death is not None:
                raise self._dead_error(request_id) from self._death
            raise StageError(
                f"stage {self.name} failed request {request_id!r}: {type(exc).__name__}: {exc}",
                stage_id=self.stage_id,
                request_id=request_id,
            ) from exc
        finally:
            running.done.set()
            del self._running[request_id]
        if running.scope.cancelled_caught:
            if self._death is not None:
                self._n_failed += 1
                raise self._dead_error(request_id) from self._death
            # cancelled through abort(): the pool tells the orchestrator
            self._n_aborted += 1
            raise StageAborted(f"request {request_id!r} was aborted on {self.name}")
        self._n_finished += 1

    async def abort(self, request_id: str) -> list[StageOutput]:
        """Abort a request on this replica; returns its outputs so far.

        Checkpoints; returns once the backend dropped the request. Unknown ids: ``[]``.
        """
        running = self._running.get(request_id)
        if running is None:
            return []
        running.aborted = True
        running.scope.cancel()
        await running.done.wait()
        return list(running.partial)

    def partial_outputs(self, request_id: str) -> list[StageOutput]:
        running = self._running.get(request_id)
        return list(running.partial) if running else []

    async def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Call ``method`` on this replica. Checkpoints; raises :class:`StageError`."""
        if not self.alive:
            raise self._dead_error(None)
        return await self._rpc(method, tuple(args), dict(kwargs or {}))

    def _dead_error(self, request_id: str | None) -> ReplicaDeadError:
        why = f": {self._death}" if self._death is not None else ""
        return ReplicaDeadError(
            f"replica {self.name} is dead{why}",
            stage_id=self.stage_id,
            request_id=request_id,
            replica=self.replica,
        )

    # -- introspection -------------------------------------------------------------------
    @property
    def requests_in_flight(self) -> int:
        return len(self._running)

    def statistics(self) -> ReplicaStatistics:
        return ReplicaStatistics(
            replica=self.replica,
            alive=self.alive,
            requests_in_flight=len(self._running),
            requests_finished=self._n_finished,
            requests_aborted=self._n_aborted,
            requests_failed=self._n_failed,
        )

    def __repr__(self) -> str:
        state = (
            "dead"
            if self._death
            else "alive"
            if self.alive
            else "stopped"
            if self._stopped
            else "starting"
        )
        return (
            f"<{type(self).__name__} {self.name} {state} in_flight={len(self._running)} "
            f"finished={self._n_finished} aborted={self._n_aborted} failed={self._n_failed}>"
        )


def no_live_replica(stage_id: str, request_id: str | None) -> NoLiveReplicaError:
    return NoLiveReplicaError(
        f"stage {stage_id!r} has no live replica", stage_id=stage_id, request_id=request_id
    )
