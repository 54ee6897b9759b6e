"""The stage backend contract: one replica of one stage.

A backend is started with ``await nursery.start(backend.serve)``: ``serve`` does whatever
start-up the backend needs, calls ``task_status.started()`` when it can take requests, then
runs until cancelled (which is how it is shut down) or until the replica dies.

Requests, aborts and interactions run through :mod:`._request_table` (the contract of
``run_request``, ``emit`` and ``interact`` is in its docstring); collective RPCs through
:mod:`._rpc_calls`.

Subclasses implement ``_start``, ``_run`` and optionally ``_serve_forever``, ``_stop``,
``_rpc``, ``_interact``; this base class gives every backend the same bookkeeping: the replica's
:attr:`~StageBackend.state` (starting -> ready -> dead | stopped), per-request cancel scopes
(for ``abort``), the backend contract (nothing after a request's finished output), replica
death (``_die``) failing exactly the requests and RPCs bound to this replica, a stop bounded
by ``shutdown_timeout``, and ``statistics()``.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Coroutine, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING

import trio

from ..errors import InvalidRequestError, ReplicaDeadError, StageRPCError, StageStopError
from ..outputs import ReplicaState, ReplicaStatistics, SamplingParams
from ._request_table import RequestTable
from ._rpc_calls import RpcCalls
from .emit import Emit
from .input_stream import InputStream
from .replica import (
    DEFAULT_SHUTDOWN_TIMEOUT,
    ReplicaView,
    death_reason,
    is_cancellation,
    unavailable_error,
)

if TYPE_CHECKING:
    from ..config.stage import StageConfig
    from ..context import RequestContext

__all__ = ["StageBackend"]

logger = logging.getLogger(__name__)


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
        view = ReplicaView(
            self.stage_id,
            self.name,
            alive=lambda: self.alive,
            death=lambda: self._death,
            unavailable=self._unavailable_error,
        )
        self._requests = RequestTable(view)
        self._rpcs = RpcCalls(view)
        # cancelled by _die: ends _serve_forever so a dead replica is stopped at once
        self._serve_scope = trio.CancelScope()
        # the three facts ``state`` derives from (subclasses may read them)
        self._ready = False  # readiness was reported
        self._stopped = False  # stopping began (shutdown, failed start or death)
        self._death: BaseException | None = None
        self._stop_failure: BaseException | None = None
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
        self, method: str, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> object:
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
                    self._die(death_reason(exc))
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
        self._requests.cancel_all()
        self._rpcs.cancel_all()

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
    def run_request(
        self,
        request_id: str,
        inputs: InputStream,
        sampling_params: SamplingParams,
        emit: Emit,
        *,
        streamed: bool = True,
        text: bool = True,
        context: RequestContext | None = None,
    ) -> Coroutine[object, object, None]:
        """Run one request on this replica, streaming its outputs through ``emit``: await
        what this returns (a coroutine, as if this were an ``async def``).

        ``streamed=False`` says nobody needs the outputs as they come (no caller streams this
        stage, no downstream stage takes streamed input): the backend may then emit its
        finished output only (:meth:`outputs_streamed` tells ``_run``). ``text=False`` says
        nobody reads the outputs' text (no caller or observer sees them, the downstream input
        processors take token ids only): the backend may then leave the text out
        (:meth:`outputs_text_read` tells ``_run``). ``context`` is the request's
        :class:`~omni_trio.context.RequestContext` (:meth:`request_context` gives it to
        ``_run``).

        Awaiting it checkpoints. Cancelling the caller aborts the request here before
        returning. Raises :class:`ReplicaDeadError` if the replica is or becomes dead,
        :class:`StageAborted` if :meth:`abort` ended it, a :class:`StageError` for
        request-scoped failures (or one naming the replica if the backend emitted after the
        finished output), :class:`InvalidRequestError` for input the backend rejects.
        """

        # The request table's own coroutine, not one awaiting it, and a partial, not a
        # closure: no extra coroutine frame per request while it runs (the heap each request
        # in flight holds).
        run = partial(self._run, request_id, inputs, sampling_params)
        return self._requests.run(
            request_id, run, emit, streamed=streamed, text=text, context=context
        )

    def request_context(self, request_id: str) -> RequestContext | None:
        """The context ``request_id`` was run with here (original prompt, every stage's
        sampling params, per-request options), or ``None``. Synchronous."""
        running = self._requests.get(request_id)
        return None if running is None else running.context

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is running on this replica now. Synchronous."""
        return request_id in self._requests

    async def interact(self, request_id: str, payload: object) -> bool:
        """Deliver an interaction (a control payload) to a request running on this replica.

        Returns ``True`` once the backend accepted it (its ``_interact`` hook returned),
        ``False`` without calling the hook if the request is not running here or its
        finished output was already delivered. Always checkpoints. Cancelled before the hook
        is called, nothing is delivered; a cancellation that lands after the hook accepted the
        payload does not undo it (it returns ``True``). Raises :class:`InvalidRequestError`
        naming the stage if this backend takes no interactions (or rejects the payload), a
        :class:`StageError` naming the replica if the hook failed otherwise.
        """
        return await self._requests.interact(request_id, payload, self._interact)

    @property
    def takes_interactions(self) -> bool:
        """Whether this backend implements ``_interact`` (the base class takes none)."""
        return type(self)._interact is not StageBackend._interact

    async def _interact(self, request_id: str, payload: object) -> bool | None:
        """Accept an interaction for a request running here (:meth:`interact` checked that it
        is). Default: this backend takes none, :class:`InvalidRequestError` naming the stage.
        Called in the caller's task; return once the payload is accepted, or return ``False``
        if it was not delivered because the request turned out to have ended (where it runs
        elsewhere: a Ray actor)."""
        raise InvalidRequestError(
            f"stage {self.stage_id!r} ({self.backend_name} backend) takes no interactions: "
            f"its backend does not implement _interact"
        )

    def outputs_streamed(self, request_id: str) -> bool:
        """Whether ``request_id``'s outputs on this replica are needed as they come (see
        :meth:`run_request`); ``True`` for an unknown request. Synchronous."""
        running = self._requests.get(request_id)
        return running is None or running.streamed

    def outputs_text_read(self, request_id: str) -> bool:
        """Whether anyone reads the text of ``request_id``'s outputs on this replica (see
        :meth:`run_request`); ``True`` for an unknown request. Synchronous."""
        running = self._requests.get(request_id)
        return running is None or running.text

    async def abort(self, request_id: str) -> None:
        """Abort a request on this replica: cancel its run here and return once the backend
        dropped it (its ``run_request`` raises :class:`StageAborted`, unless its finished
        output was delivered first). The outputs it emitted went to its ``emit``: whoever
        gave that keeps them (``engine.abort()`` returns a request's outputs so far).

        Always checkpoints; a no-op for an unknown id."""
        await self._requests.abort(request_id)

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[object] | None = None,
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        """Call ``method`` on this replica (``None`` args or kwargs mean none).

        Checkpoints; cancelling the caller cancels the call. Raises :class:`ReplicaDeadError`
        naming the replica if it is not ready, or at once if it dies or stops while the call
        is pending (a dead replica never answers); :class:`StageRPCError` if the call raised.
        """
        return await self._rpcs.call(method, args, kwargs, self._rpc)

    def _unavailable_error(self, request_id: str | None) -> ReplicaDeadError:
        return unavailable_error(
            self.name, self.stage_id, self.replica, self.state, self._death, request_id
        )

    # -- introspection -------------------------------------------------------------------
    @property
    def requests_in_flight(self) -> int:
        return len(self._requests)

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
            requests_in_flight=len(self._requests),
            requests_finished=self._requests.n_finished,
            requests_aborted=self._requests.n_aborted,
            requests_failed=self._requests.n_failed,
            state=self.state,
        )

    def __repr__(self) -> str:
        table = self._requests
        return (
            f"<{type(self).__name__} {self.name} {self.state} in_flight={len(table)} "
            f"finished={table.n_finished} aborted={table.n_aborted} failed={table.n_failed}>"
        )
