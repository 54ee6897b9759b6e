"""The stage backend contract: one replica of one stage.

A backend is started with ``await nursery.start(backend.serve)``: ``serve`` does whatever
start-up the backend needs, calls ``task_status.started()`` when it can take requests, then
runs until cancelled (which is how it is shut down) or until the replica dies.

Requests run as ``await backend.run_request(request_id, inputs, sampling_params, emit)``:
``inputs`` is a receive channel of :class:`~omni_trio.outputs.StageInput` chunks (one chunk
unless the stage has ``stream_input``), and the backend calls ``await emit(output)`` for each
:class:`~omni_trio.outputs.StageOutput` delta, the last one with ``finished=True`` and none
after it. ``emit`` may block: that is backpressure, and the backend must let it. Cancelling
the task that runs ``run_request`` aborts the request in the backend before it returns. The
``emit`` given to ``_run`` is an :class:`~._emit.Emitter`: ``emit.nowait(output)`` delivers
an output synchronously when nothing would wait and returns whether it did (a backend that
receives many requests' outputs in one task uses it to skip waking each request's task; see
:mod:`._emit` for the rules that keep the order and the cancellation).

Interactions (``engine.interact`` / ``stream.interact``) reach the replica running a request
on its entry stage as ``await backend.interact(request_id, payload)``, which calls the
backend's ``_interact`` hook in the caller's task (default: the backend takes none,
:class:`~omni_trio.errors.InvalidRequestError` naming the stage).

Subclasses implement ``_start``, ``_run`` and optionally ``_serve_forever``, ``_stop``,
``_rpc``, ``_interact``; this base class gives every backend the same bookkeeping: the replica's
:attr:`~StageBackend.state` (starting -> ready -> dead | stopped), per-request cancel scopes
(for ``abort``), partial outputs, replica death (``_die``) failing exactly the requests and
RPCs bound to this replica, a stop bounded by ``shutdown_timeout``, and ``statistics()``.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import trio

from ..errors import (
    InvalidRequestError,
    NoLiveReplicaError,
    OmniTrioError,
    ReplicaDeadError,
    StageError,
    StageRPCError,
    StageStopError,
)
from ..outputs import (
    Payload,
    ReplicaState,
    ReplicaStatistics,
    SamplingParams,
    StageInput,
    StageOutput,
)
from ._emit import Emit, Emitter
from ._requests import RunningRequest, request_outcome
from ._watch import _watches, notify_run

if TYPE_CHECKING:
    from ..config import StageConfig
    from ..context import RequestContext

__all__ = [
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "Emit",
    "Emitter",
    "InputStream",
    "StageAborted",
    "StageBackend",
    "collect_input",
    "merge_inputs",
]

logger = logging.getLogger(__name__)

#: seconds a replica's stop may take when neither the stage nor the pipeline sets one
#: (the default of ``PipelineConfig.shutdown_timeout``)
DEFAULT_SHUTDOWN_TIMEOUT = 30.0


class StageAborted(OmniTrioError):
    """Raised by ``run_request`` when the request was aborted through ``abort()``."""


#: a stage's input chunks (a memory channel, or the orchestrator's one-chunk WholeInput)
InputStream = trio.abc.ReceiveChannel[StageInput]


async def collect_input(inputs: InputStream) -> StageInput:
    """Merge every chunk of a (possibly streamed) input into one final ``StageInput``.

    For backends that cannot start on partial input. Checkpoints; returns when the
    upstream sends its final chunk or closes.
    """
    chunks: list[StageInput] = []
    async for chunk in inputs:
        chunks.append(chunk)
        if chunk.final:
            break
    return merge_inputs(chunks)


def merge_inputs(chunks: Sequence[StageInput]) -> StageInput:
    """Several input chunks as one final ``StageInput``: texts and token ids concatenated,
    data payloads listed (one alone stays itself), the last source. Pure."""
    prompt: str | None = None
    tokens: list[int] = []
    datas: list[object] = []
    source: str | None = None
    for chunk in chunks:
        if chunk.prompt is not None:
            prompt = (prompt or "") + chunk.prompt
        tokens.extend(chunk.token_ids)
        if chunk.data is not None:
            datas.append(chunk.data)
        source = chunk.source or source
    data: object = None if not datas else datas[0] if len(datas) == 1 else datas
    return StageInput(prompt=prompt, token_ids=tuple(tokens), data=data, final=True, source=source)


def is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``trio.Cancelled``, or a group of nothing else. Pure."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


class StageBackend(abc.ABC):
    """Base class of stage backends (one instance per replica)."""

    #: the name used in configs ("scripted", "vllm", ...)
    backend_name: str = "custom"

    def __init__(self, config: StageConfig, *, stage_index: int, replica: int = 0) -> None:
        self.config = config
        self.stage_id = config.id
        self.stage_index = stage_index
        self.replica = replica
        #: bound on ``_stop``: the stage's ``shutdown_timeout``, else the pipeline's (the pool
        #: sets it), else :data:`DEFAULT_SHUTDOWN_TIMEOUT`
        self.shutdown_timeout: float = (
            DEFAULT_SHUTDOWN_TIMEOUT
            if config.shutdown_timeout is None
            else float(config.shutdown_timeout)
        )
        self._running: dict[str, RunningRequest] = {}
        self._rpcs: set[trio.CancelScope] = set()
        # cancelled by _die: ends _serve_forever so a dead replica is stopped at once
        self._serve_scope = trio.CancelScope()
        # the three facts ``state`` derives from (subclasses may read them)
        self._ready = False  # readiness was reported
        self._stopped = False  # stopping began (shutdown, failed start or death)
        self._death: BaseException | None = None
        self._stop_failure: BaseException | None = None
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
        Backends with a background reader override this; raising or returning means the
        replica died (unless ``_die`` was called with a better reason)."""
        await trio.sleep_forever()

    async def _stop(self) -> None:  # noqa: B027 (optional hook)
        """Release everything ``_start`` acquired. Runs shielded, bounded by
        ``shutdown_timeout``; raising or overrunning is a stop failure."""

    @abc.abstractmethod
    async def _run(
        self, request_id: str, inputs: InputStream, sampling_params: SamplingParams, emit: Emit
    ) -> None:
        """Run one request, calling ``emit`` per output. Cancellation must abort it."""

    async def _rpc(
        self, method: str, args: tuple[Payload, ...], kwargs: dict[str, Payload]
    ) -> Payload:
        raise StageRPCError(
            f"stage {self.stage_id!r} ({self.backend_name}) has no rpc method {method!r}",
            stage_id=self.stage_id,
        )

    # -- state ---------------------------------------------------------------------------
    @property
    def state(self) -> ReplicaState:
        """``"starting"`` until ready, ``"ready"`` while serving, then ``"dead"`` (it failed:
        at start or after) or ``"stopped"`` (shut down). Dead and stopped are final."""
        if self._death is not None:
            return "dead"
        if self._stopped:
            return "stopped"
        return "ready" if self._ready else "starting"

    @property
    def alive(self) -> bool:
        """Whether the replica takes requests and RPCs (``state == "ready"``)."""
        # state's rule, read directly: checked for every request a replica takes
        return self._ready and not self._stopped and self._death is None

    @property
    def name(self) -> str:
        """``stage_id[replica]``, as errors and logs name the replica."""
        return f"{self.stage_id}[{self.replica}]"

    @property
    def stop_failure(self) -> BaseException | None:
        """What went wrong stopping the replica: the exception ``_stop`` raised, or a
        ``trio.TooSlowError`` if it overran ``shutdown_timeout``; ``None`` if it stopped
        cleanly or has not stopped."""
        return self._stop_failure

    # -- lifecycle ---------------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the replica, report readiness, run until cancelled or dead, then stop it.

        Checkpoints. Raises whatever ``_start`` raised if start-up fails (the replica is
        then dead and stopped; a failed stop is in :attr:`stop_failure`). After readiness a
        death is not raised: it is recorded (``state == "dead"``, its requests and RPCs fail
        with :class:`ReplicaDeadError`), logged once, the replica is stopped and ``serve``
        returns. Cancellation is the shutdown signal: in-flight requests and RPCs are
        cancelled and ``_stop`` runs shielded, bounded by :attr:`shutdown_timeout`. Raises
        :class:`StageStopError` (instead of returning, or of the cancellation) if that stop
        raised or overran.
        """
        try:
            self.mark_phase("start")
            await self._start()
            if self._death is not None:  # _die during _start: the start failed
                raise self._unavailable_error(None) from self._death
            self.mark_phase("ready")
            self._ready = True
            task_status.started()
            with self._serve_scope:
                try:
                    await self._serve_forever()
                except Exception as exc:
                    self._die(exc)
            self._die(ReplicaDeadError(f"replica {self.name} stopped serving unexpectedly"))
        except BaseException as exc:
            cancelled = is_cancellation(exc)
            if not self._ready and not cancelled and self._death is None:
                self._death = exc  # a failed start: the caller gets exc itself
            await self._shutdown()
            if cancelled:
                self._raise_stop_failure()
            raise
        await self._shutdown()
        self._raise_stop_failure()

    def kill(self, reason: BaseException) -> None:
        """Make this replica dead now, as if it had crashed with ``reason``: every request
        and RPC on it fails with :class:`ReplicaDeadError` and ``serve`` stops it and
        returns. Synchronous. A pool uses it to end a drain; tests use it to inject a crash.
        A no-op on a replica that is already dead or stopping."""
        self._die(reason)

    @property
    def death(self) -> BaseException | None:
        """Why the replica died (a failed start, a crash, :meth:`kill`), or ``None``."""
        return self._death

    def _die(self, reason: BaseException) -> None:
        """Mark this replica dead and fail every request and RPC bound to it with
        :class:`ReplicaDeadError`; ``serve`` then stops the replica. Synchronous. The first
        reason wins; a replica that is stopping or stopped ignores it."""
        if self._death is not None or self._stopped:
            return
        # recorded before anything is cancelled: every cancelled request and RPC sees it
        self._death = reason
        if self._ready:
            logger.warning(
                "stage %r: replica %s died: %s: %s",
                self.stage_id,
                self.name,
                type(reason).__name__,
                reason,
            )
        self._cancel_work()
        self._serve_scope.cancel()

    def _cancel_work(self) -> None:
        for running in self._running.values():
            running.cancel()
        for scope in self._rpcs:
            scope.cancel()

    async def _shutdown(self) -> None:
        # Cancels what is bound to the replica, then stops it shielded and bounded; a stop
        # that raises or overruns is recorded (the caller raises it), never lost.
        self._stopped = True
        self._cancel_work()
        timeout = self.shutdown_timeout
        with trio.move_on_after(timeout, shield=True) as scope:
            try:
                await self._stop()
            except Exception as exc:
                self._stop_failure = exc
        if scope.cancelled_caught and self._stop_failure is None:
            self._stop_failure = trio.TooSlowError(
                f"stop did not finish within shutdown_timeout={timeout}s"
            )
        if self._stop_failure is not None:
            logger.warning(
                "stage %r: replica %s did not stop cleanly: %s: %s",
                self.stage_id,
                self.name,
                type(self._stop_failure).__name__,
                self._stop_failure,
            )

    def _raise_stop_failure(self) -> None:
        cause = self._stop_failure
        if cause is not None:
            raise StageStopError([(self.name, cause)]) from cause

    # -- requests ------------------------------------------------------------------------
    async def run_request(
        self,
        request_id: str,
        inputs: InputStream,
        sampling_params: SamplingParams,
        emit: Emit,
        *,
        streamed: bool = True,
        context: RequestContext | None = None,
    ) -> None:
        """Run one request on this replica, streaming its outputs through ``emit``.

        ``streamed=False`` says nobody needs the outputs as they come (no caller streams this
        stage, no downstream stage takes streamed input): the backend may then emit its
        finished output only (:meth:`outputs_streamed` tells ``_run``). ``context`` is the
        request's :class:`~omni_trio.context.RequestContext` (:meth:`request_context` gives
        it to ``_run``).

        Checkpoints. Cancelling the caller aborts the request here before returning.
        Raises :class:`ReplicaDeadError` if the replica is or becomes dead,
        :class:`StageAborted` if :meth:`abort` ended it, a :class:`StageError` for
        request-scoped failures (or one naming the replica if the backend emitted after the
        finished output), :class:`InvalidRequestError` for input the backend rejects.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self.alive or request_id in self._running:
            await trio.lowlevel.cancel_shielded_checkpoint()
            if not self.alive:
                raise self._unavailable_error(request_id)
            raise StageError(
                f"request {request_id!r} is already running on {self.name}",
                stage_id=self.stage_id,
                request_id=request_id,
            )
        running = RunningRequest(
            request_id, self.stage_id, self.name, streamed=streamed, context=context
        )
        self._running[request_id] = running
        if _watches:  # someone waits for this request to run here (an interaction)
            notify_run(context, self.stage_id, request_id, "started")
        error: Exception | None = None
        try:
            with running.scope:
                await self._run(request_id, inputs, sampling_params, running.emitter(emit))
        except Exception as exc:
            error = exc
        except BaseException:
            # the caller was cancelled (our own scope catches its own cancellation)
            if running.finished:
                self._n_finished += 1
            else:
                self._n_aborted += 1
            raise
        finally:
            running.end()
            del self._running[request_id]
            if _watches:
                notify_run(context, self.stage_id, request_id, "ended")
        self._end_request(request_id, running, error)

    def _end_request(
        self, request_id: str, running: RunningRequest, error: Exception | None
    ) -> None:
        if error is None and running.finished and running.violation is None:
            self._n_finished += 1  # the usual end, decided without the general rule
            return
        outcome = request_outcome(
            violated=running.violation is not None,
            failed=error is not None,
            cancelled=running.scope.cancelled_caught,
            finished=running.finished,
            dead=self._death is not None,
        )
        if outcome == "finished":
            self._n_finished += 1
            return
        if outcome == "aborted":
            # cancelled through abort() (or by shutdown): the pool tells the orchestrator
            self._n_aborted += 1
            raise StageAborted(f"request {request_id!r} was aborted on {self.name}")
        self._n_failed += 1
        if outcome == "violation":
            assert running.violation is not None
            raise running.violation from (error if error is not running.violation else None)
        if outcome == "dead":
            raise self._unavailable_error(request_id) from self._death
        assert error is not None
        if isinstance(error, (StageError, InvalidRequestError)):
            # request-scoped and already typed: bad input stays an InvalidRequestError
            raise error
        raise StageError(
            f"stage {self.name} failed request {request_id!r}: {type(error).__name__}: {error}",
            stage_id=self.stage_id,
            request_id=request_id,
        ) from error

    def request_context(self, request_id: str) -> RequestContext | None:
        """The context ``request_id`` was run with here (original prompt, every stage's
        sampling params, per-request options), or ``None``. Synchronous."""
        running = self._running.get(request_id)
        return None if running is None else running.context

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is running on this replica now. Synchronous."""
        return request_id in self._running

    async def interact(self, request_id: str, payload: Payload) -> bool:
        """Deliver an interaction (a control payload) to a request running on this replica.

        Returns ``True`` once the backend accepted it (its ``_interact`` hook returned),
        ``False`` without calling the hook if the request is not running here or its
        finished output was already delivered. Always checkpoints. Cancelled before the hook
        is called, nothing is delivered; a cancellation that lands after the hook accepted the
        payload does not undo it (it returns ``True``). Raises :class:`InvalidRequestError`
        naming the stage if this backend takes no interactions (or rejects the payload), a
        :class:`StageError` naming the replica if the hook failed otherwise.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        running = self._running.get(request_id)
        if running is None or running.finished:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return False
        try:
            await self._interact(request_id, payload)
        except trio.Cancelled:
            raise
        except (InvalidRequestError, StageError):
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise
        except Exception as exc:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise StageError(
                f"replica {self.name} failed an interaction with request {request_id!r}: "
                f"{type(exc).__name__}: {exc}",
                stage_id=self.stage_id,
                request_id=request_id,
            ) from exc
        # accepted: a schedule point that a cancellation cannot turn into a lost delivery
        await trio.lowlevel.cancel_shielded_checkpoint()
        return True

    async def _interact(self, request_id: str, payload: Payload) -> None:
        """Accept an interaction for a request running here (:meth:`interact` checked that it
        is). Default: this backend takes none, :class:`InvalidRequestError` naming the stage.
        Called in the caller's task; return once the payload is accepted."""
        raise InvalidRequestError(
            f"stage {self.stage_id!r} ({self.backend_name} backend) takes no interactions: "
            f"its backend does not implement _interact"
        )

    def outputs_streamed(self, request_id: str) -> bool:
        """Whether ``request_id``'s outputs on this replica are needed as they come (see
        :meth:`run_request`); ``True`` for an unknown request. Synchronous."""
        running = self._running.get(request_id)
        return running is None or running.streamed

    async def abort(self, request_id: str) -> list[StageOutput]:
        """Abort a request on this replica; returns its outputs so far.

        Always checkpoints; returns once the backend dropped the request. Unknown ids: ``[]``.
        """
        running = self._running.get(request_id)
        if running is None:
            await trio.lowlevel.checkpoint()
            return []
        running.cancel()
        await running.wait_ended()
        return list(running.partial or ())

    def partial_outputs(self, request_id: str) -> list[StageOutput]:
        """The outputs a running request has emitted so far (``[]`` if it is not running)."""
        running = self._running.get(request_id)
        return list(running.partial or ()) if running else []

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[Payload] | None = None,
        kwargs: Mapping[str, Payload] | None = None,
    ) -> Payload:
        """Call ``method`` on this replica (``None`` args or kwargs mean none).

        Checkpoints; cancelling the caller cancels the call. Raises :class:`ReplicaDeadError`
        naming the replica if it is not ready, or at once if it dies or stops while the call
        is pending (a dead replica never answers); :class:`StageRPCError` if the call raised.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self.alive:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise self._unavailable_error(None)
        scope = trio.CancelScope()
        self._rpcs.add(scope)
        try:
            with scope:
                result = await self._rpc(method, tuple(args or ()), dict(kwargs or {}))
        except Exception as exc:
            if not self.alive:
                raise self._unavailable_error(None) from exc
            if isinstance(exc, (StageRPCError, ReplicaDeadError)):
                raise
            raise StageRPCError(
                f"collective_rpc({method!r}) failed on {self.name}: {type(exc).__name__}: {exc}",
                stage_id=self.stage_id,
            ) from exc
        finally:
            self._rpcs.discard(scope)
        if scope.cancelled_caught or not self.alive:
            raise self._unavailable_error(None) from self._death
        return result

    def _unavailable_error(self, request_id: str | None) -> ReplicaDeadError:
        state = self.state
        if state == "dead":
            why = f"is dead: {type(self._death).__name__}: {self._death}"
        else:
            why = f"is {state}, not ready"
        return ReplicaDeadError(
            f"replica {self.name} {why}",
            stage_id=self.stage_id,
            request_id=request_id,
            replica=self.replica,
        )

    # -- introspection -------------------------------------------------------------------
    @property
    def requests_in_flight(self) -> int:
        return len(self._running)

    def init_phases(self) -> dict[str, float]:
        """Seconds from this replica's ``start`` to each recorded start-up phase
        (``{}`` before it started)."""
        t0 = self.timeline.get("start")
        return {} if t0 is None else {k: v - t0 for k, v in self.timeline.items()}

    def statistics(self) -> ReplicaStatistics:
        """A frozen snapshot of this replica. Never blocks."""
        return ReplicaStatistics(
            replica=self.replica,
            alive=self.alive,
            requests_in_flight=len(self._running),
            requests_finished=self._n_finished,
            requests_aborted=self._n_aborted,
            requests_failed=self._n_failed,
            state=self.state,
        )

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.name} {self.state} in_flight={len(self._running)} "
            f"finished={self._n_finished} aborted={self._n_aborted} failed={self._n_failed}>"
        )


def no_live_replica(stage_id: str, request_id: str | None) -> NoLiveReplicaError:
    return NoLiveReplicaError(
        f"stage {stage_id!r} has no live replica", stage_id=stage_id, request_id=request_id
    )
