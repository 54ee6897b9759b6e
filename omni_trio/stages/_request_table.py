"""A replica's table of running requests: running one, aborting one, and the counts.

:class:`RequestTable` keeps, for one replica, every request running on it (by id, as a
:class:`~._running.RunningRequest`), runs a request's backend call inside the request's own
cancel scope, turns how it ended into the typed outcome the caller sees, and counts the
requests that finished, were aborted or failed. The replica's lifecycle (is it alive, why
did it die) stays with :class:`~.backend.StageBackend`, which hands the table a narrow
:class:`~.replica.ReplicaView` of itself.

Requests run as ``await backend.run_request(request_id, inputs, sampling_params, emit)``:
``inputs`` is a receive channel of :class:`~omni_trio.outputs.StageInput` chunks (one chunk
unless the stage has ``stream_input``), and the backend calls ``await emit(output)`` for each
:class:`~omni_trio.outputs.StageOutput` delta, the last one with ``finished=True`` and none
after it. ``emit`` may block: that is backpressure, and the backend must let it. Cancelling
the task that runs ``run_request`` aborts the request in the backend before it returns. The
``emit`` given to ``_run`` is an :class:`~.emit.Emitter`: ``emit.nowait(output)`` delivers
an output synchronously when nothing would wait and returns whether it did (a backend that
receives many requests' outputs in one task uses it to skip waking each request's task; see
:mod:`.emit` for the rules that keep the order and the cancellation).

Interactions (``engine.interact`` / ``stream.interact``) reach the replica running a request
on its entry stage as ``await backend.interact(request_id, payload)``, which calls the
backend's ``_interact`` hook in the caller's task (default: the backend takes none,
:class:`~omni_trio.errors.InvalidRequestError` naming the stage).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from ..errors import InvalidRequestError, StageAborted, StageError
from ._running import RunningRequest, request_outcome
from .emit import Emit, Emitter
from .replica import ReplicaView
from .watch import _watches, notify_run

if TYPE_CHECKING:
    from ..context import RequestContext

__all__ = ["RequestTable"]


class RequestTable:
    """The requests running on one replica and how many finished, were aborted or failed."""

    def __init__(self, replica: ReplicaView) -> None:
        self.stage_id = replica.stage_id
        self.name = replica.name
        self._alive = replica.alive
        self._death = replica.death
        self._unavailable = replica.unavailable
        self._running: dict[str, RunningRequest] = {}
        self.n_finished = 0
        self.n_aborted = 0
        self.n_failed = 0

    def get(self, request_id: str) -> RunningRequest | None:
        """The record of ``request_id`` if it is running here, else ``None``. Synchronous."""
        return self._running.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._running

    def __len__(self) -> int:
        return len(self._running)

    def cancel_all(self) -> None:
        """Cancel every running request (replica death or shutdown). Synchronous."""
        for running in self._running.values():
            running.cancel()

    async def run(
        self,
        request_id: str,
        run: Callable[[Emitter], Awaitable[None]],
        emit: Emit,
        *,
        streamed: bool,
        text: bool,
        context: RequestContext | None,
    ) -> None:
        """Record ``request_id`` as running, await ``run(emitter)`` in its own cancel scope,
        then settle its outcome (see :meth:`StageBackend.run_request
        <omni_trio.stages.backend.StageBackend.run_request>` for what it raises). Checkpoints;
        a replica that is not ``alive()``, or an id already running here, fails at once."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._alive() or request_id in self._running:
            await trio.lowlevel.cancel_shielded_checkpoint()
            if not self._alive():
                raise self._unavailable(request_id)
            raise StageError(
                f"request {request_id!r} is already running on {self.name}",
                stage_id=self.stage_id,
                request_id=request_id,
            )
        running = RunningRequest(
            request_id, self.stage_id, self.name, streamed=streamed, text=text, context=context
        )
        self._running[request_id] = running
        if _watches:  # someone waits for this request to run here (an interaction)
            notify_run(context, self.stage_id, request_id, "started")
        error: Exception | None = None
        try:
            with running.scope:
                work = run(running.emitter(emit))
                # the backend's coroutine holds what the partial gave it: not held twice
                del run
                await work
        except Exception as exc:
            error = exc
        except BaseException:
            # the caller was cancelled (our own scope catches its own cancellation)
            if running.finished:
                self.n_finished += 1
            else:
                self.n_aborted += 1
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
            self.n_finished += 1  # the usual end, decided without the general rule
            return
        death = self._death()
        outcome = request_outcome(
            violated=running.violation is not None,
            failed=error is not None,
            cancelled=running.scope.cancelled_caught,
            finished=running.finished,
            dead=death is not None,
        )
        if outcome == "finished":
            self.n_finished += 1
            return
        if outcome == "aborted":
            # cancelled through abort() (or by shutdown): the pool tells the orchestrator
            self.n_aborted += 1
            raise StageAborted(f"request {request_id!r} was aborted on {self.name}")
        self.n_failed += 1
        if outcome == "violation":
            assert running.violation is not None
            raise running.violation from (error if error is not running.violation else None)
        if outcome == "dead":
            raise self._unavailable(request_id) from death
        assert error is not None
        if isinstance(error, (StageError, InvalidRequestError)):
            # request-scoped and already typed: bad input stays an InvalidRequestError
            raise error
        raise StageError(
            f"stage {self.name} failed request {request_id!r}: {type(error).__name__}: {error}",
            stage_id=self.stage_id,
            request_id=request_id,
        ) from error

    async def interact(
        self,
        request_id: str,
        payload: object,
        hook: Callable[[str, object], Awaitable[bool | None]],
    ) -> bool:
        """Deliver ``payload`` to running ``request_id`` through ``hook`` (the backend's
        ``_interact``); see :meth:`StageBackend.interact
        <omni_trio.stages.backend.StageBackend.interact>` for the contract. Always checkpoints."""
        await trio.lowlevel.checkpoint_if_cancelled()
        running = self._running.get(request_id)
        if running is None or running.finished:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return False
        try:
            delivered = await hook(request_id, payload)
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
        # accepted (or found ended elsewhere): a schedule point that a cancellation cannot
        # turn into a lost delivery
        await trio.lowlevel.cancel_shielded_checkpoint()
        return delivered is not False

    async def abort(self, request_id: str) -> None:
        """Abort a running request; returns once the backend dropped it (its run raises
        :class:`StageAborted` unless it had finished). Always checkpoints; a no-op for an
        unknown id."""
        running = self._running.get(request_id)
        if running is None:
            await trio.lowlevel.checkpoint()
            return
        running.cancel()
        await running.wait_ended()
