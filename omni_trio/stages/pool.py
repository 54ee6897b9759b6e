"""Replica pools: one per stage, owning that stage's replicas for the whole session.

:class:`StagePool` starts, supervises, adds, removes and stops the replicas of one stage,
binds requests to them and runs RPCs on them. It starts its replicas in parallel in its own
nursery (one failing to start cancels the others' starts at once). Each replica index runs as one
supervising task in that nursery (``nursery.start``): it serves the index's backend and, with
``restart: on-failure``, replaces a dead one (same index, exponential backoff, at most
``max_restarts`` times). Replicas join (:meth:`StagePool.add_replica`) and leave
(:meth:`StagePool.remove_replica`: drain, then stop) while the pool serves. Each request is
bound to one replica by a :class:`~omni_trio.stages.binding.ReplicaBinder` (balancing policy,
per-replica slots, waiting for a restarting replica), and a dead replica fails only the
requests bound to it; every change of a replica's state wakes the binder, whose waiting
requests may now bind. RPCs fan out to every replica concurrently. Backends are created from
``StageConfig.backend`` by :func:`~omni_trio.stages.factory.create_backend`; the pool uses
only their public methods.

Ownership. The pool's nursery owns every supervising task, an added replica's from its first
step (``start_soon``, not ``nursery.start``, whose starting task would run under the caller's
cancel scopes, which the pool's stop does not reach): stopping the pool cancels a start in
flight like any replica, bounded by its ``shutdown_timeout``. The caller of ``add_replica``
only waits for the outcome. A slot leaves the pool's list once: its supervising task drops
it as it ends if it was being removed or was added and never joined; ``remove_replica`` drops
a slot whose task had ended before the removal began (a replica dead for good).

Resources. With a :class:`~omni_trio.stages.ledger.ResourceLedger` (the engine's), an added
replica reserves its stage's ``resources`` before anything of it is built (refused, the pool
is unchanged), and a slot gives its share back as it leaves the pool's list; the first
replicas' shares are reserved by the :class:`~omni_trio.stages.group.StageGroup`, all at
once. A restart keeps the index's share.

Several children failing (starts, stops, RPCs) raise one typed error ``from`` an
``ExceptionGroup`` of every cause, as trio's ``open_tcp_stream`` does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import trio

from ..config.stage import LbPolicy, StageConfig
from ..errors import (
    EngineClosedError,
    InvalidRequestError,
    OmniTrioError,
    ReplicaDeadError,
    ResourceUnavailableError,
    StageStartError,
    StageStopError,
)
from ..failures import describe_failures, group_causes
from ..outputs import StageStatistics
from .backend import StageBackend
from .balancing import Balancer
from .binding import ReplicaBinder
from .factory import BackendFactory, create_backend
from .fanout import call_replicas
from .ledger import ResourceLedger
from .replica import DEFAULT_SHUTDOWN_TIMEOUT, is_cancellation
from .replicas import ReplicaSlot, RestartRule

__all__ = ["StagePool", "join_failure"]

logger = logging.getLogger(__name__)


def join_failure(
    stage_id: str,
    name: str,
    *,
    removed: bool,
    closing: bool,
    timeout: float | None,
    cause: Exception | None,
    stops: list[tuple[str, BaseException]],
) -> OmniTrioError:
    """Why added replica ``name`` did not join its pool, as the error ``add_replica`` raises:
    ``removed`` (``remove_replica`` took it while it started), ``closing`` (the pool stopped:
    :class:`EngineClosedError`), ``timeout`` (it overran that ``stage_init_timeout``), else
    its start failed with ``cause``; ``stops`` are its stop failures. Pure."""
    note = f" (and did not stop cleanly: {describe_failures(stops)})" if stops else ""
    if closing and not removed:
        error: OmniTrioError = EngineClosedError(
            f"stage {stage_id!r} stopped while its added replica {name} was starting; "
            f"it was not added{note}"
        )
    else:
        if removed:
            what = " was removed while it was starting"
        elif timeout is not None:
            what = f" did not start within stage_init_timeout={timeout}s"
        elif cause is not None and not isinstance(cause, StageStopError):
            what = f": {type(cause).__name__}: {cause}"
        else:
            what = " ended before it was ready"
        error = StageStartError(stage_id, f"added replica {name}{what}{note}")
    error.__cause__ = cause
    return error


class _Joining:
    """An added replica on its way into the pool: the task status its supervising task
    reports readiness to, the deadline of its start (``stage_init_timeout``, lifted at
    readiness), and the outcome ``add_replica`` waits for."""

    __slots__ = ("ended", "error", "ready", "scope", "settled")

    def __init__(self, timeout: float) -> None:
        self.scope = trio.CancelScope(deadline=trio.current_time() + timeout)
        self.ready = False
        #: why it did not join (set before ``settled``)
        self.error: OmniTrioError | None = None
        #: set once it is ready, or its start ended without readiness
        self.settled = trio.Event()
        #: set once its supervising task returned (a slot that did not join has left)
        self.ended = trio.Event()

    def started(self, value: None = None) -> None:
        if self.scope.cancel_called:
            return  # ready as its deadline passed: the start is being cancelled, it fails
        self.ready = True
        self.scope.deadline = math.inf  # the deadline bounds the start, not the serving
        self.settled.set()


class StagePool:
    """The replicas of one stage and the requests bound to them.

    ``shutdown_timeout`` (the pipeline's) bounds each replica's stop unless the stage sets
    its own ``shutdown_timeout``; ``stage_init_timeout`` (the pipeline's; default unbounded)
    bounds an added replica's start unless the stage sets its own (:attr:`init_timeout`; the
    :class:`~omni_trio.stages.group.StageGroup` bounds the first start with it); ``lb_policy``
    (the pipeline's) is the balancing policy unless the stage sets its own; ``lb_seed`` seeds
    the ``random`` policy; ``factory`` builds each replica's backend (default
    :func:`create_backend`), for the first start, restarts and added replicas alike;
    ``resources`` is the engine's ledger an added replica reserves from (see the module
    docstring; None: nothing is reserved).
    """

    def __init__(
        self,
        config: StageConfig,
        *,
        stage_index: int,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
        lb_policy: LbPolicy = "least_loaded",
        lb_seed: int | None = None,
        factory: BackendFactory = create_backend,
        stage_init_timeout: float = math.inf,
        resources: ResourceLedger | None = None,
    ) -> None:
        self.config = config
        # what an added replica reserves first (the stage's asks; None: nothing)
        self._resources = resources if config.resources else None
        self.stage_id = config.id
        self.stage_index = stage_index
        self._shutdown_timeout = shutdown_timeout
        self._stage_init_timeout = stage_init_timeout
        self._factory = factory
        self._restart_rule = RestartRule.of(config)
        self._slots: list[ReplicaSlot] = [
            ReplicaSlot(r, self._new_backend(r), self._restart_rule) for r in range(config.replicas)
        ]
        self._next_index = config.replicas
        self._binder = ReplicaBinder(
            self.stage_id,
            self._slots,
            Balancer(config.lb_policy or lb_policy, lb_seed),
            max_in_flight=config.max_in_flight_per_replica,
            wait_timeout=config.replica_wait_timeout_s,
        )
        self._nursery: trio.Nursery | None = None  # while serving
        self._change = trio.Event()  # set (and replaced) whenever a replica's state changes

    @property
    def init_timeout(self) -> float:
        """Seconds a start of this stage may take (the pool's first start, an added
        replica's): the stage's ``stage_init_timeout``, else the pipeline's."""
        own = self.config.stage_init_timeout
        return self._stage_init_timeout if own is None else own

    def _new_backend(self, index: int) -> StageBackend:
        backend = self._factory(self.config, stage_index=self.stage_index, replica=index)
        if self.config.shutdown_timeout is None:
            backend.shutdown_timeout = self._shutdown_timeout
        return backend

    # -- lifecycle -------------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every replica in parallel, report ready when all are, run until cancelled.

        Checkpoints. If a replica fails to start, the other starts are cancelled at once,
        every replica is stopped, and :class:`StageStartError` names each failed replica
        (raised from the cause, or from an ``ExceptionGroup`` of every cause). A replica that
        dies after readiness does not end the pool (it is restarted, or stays dead).
        Cancellation is the shutdown signal: it stops every replica in parallel (each bounded
        by its ``shutdown_timeout``; an added replica still starting too, and its
        :meth:`add_replica` raises :class:`EngineClosedError`), then raises
        :class:`StageStopError` listing each member replica whose stop raised or overran.
        """
        failed: list[tuple[str, BaseException]] = []
        try:
            async with trio.open_nursery() as nursery:
                async with trio.open_nursery() as starters:
                    for slot in self._slots:
                        starters.start_soon(self._start_slot, nursery, starters, slot, failed)
                if failed:
                    nursery.cancel_scope.cancel()
                else:
                    self._nursery = nursery
                    task_status.started()
                    try:
                        # the pool lives until shutdown, even if every replica died
                        await trio.sleep_forever()
                    finally:
                        # before the nursery closes: no replica joins a stopping pool
                        self._nursery = None
        except BaseException as exc:
            if is_cancellation(exc):
                self._raise_stop_failures()
            raise
        if not failed:
            # No replica failed, yet the start did not complete: a cancellation reached the
            # starts and was absorbed on its way. A cancelled caller gets its cancellation; else
            # a typed error (an empty ExceptionGroup used to escape from here as ValueError).
            await trio.lowlevel.checkpoint()
            raise StageStartError(self.stage_id, "the start was interrupted")
        # only a failed start gets here
        failed = self._in_replica_order(failed)
        stops = self._stop_failures()
        causes = [exc for _, exc in failed] + [exc for _, exc in stops]
        reason = describe_failures(failed)
        if stops:
            reason += f" (and did not stop cleanly: {describe_failures(stops)})"
        raise StageStartError(self.stage_id, reason) from group_causes(
            f"stage {self.stage_id!r}: replica start failures", causes
        )

    async def _start_slot(
        self,
        nursery: trio.Nursery,
        starters: trio.Nursery,
        slot: ReplicaSlot,
        failed: list[tuple[str, BaseException]],
    ) -> None:
        try:
            await nursery.start(self._serve_slot, slot)
        except StageStopError:
            pass  # a start cancelled by a sibling's failure, whose stop failed: recorded
        except Exception as exc:
            failed.append((slot.backend.name, exc))
            starters.cancel_scope.cancel()  # the siblings' starts stop now, not at the slowest

    async def _serve_slot(self, slot: ReplicaSlot, *, task_status: trio.TaskStatus[None]) -> None:
        # a replica index's supervising task (see the module docstring's ownership)
        try:
            await slot.serve(self._new_backend, self._changed, task_status=task_status)
        finally:
            if slot.draining:
                self._drop(slot)

    async def _serve_added(self, slot: ReplicaSlot, joining: _Joining) -> None:
        # An added replica's supervising task, in the pool's nursery from its first step.
        # Its start runs under joining.scope (stage_init_timeout); the pool's stop cancels it
        # from outside; remove_replica (or add_replica's cancelled caller) through slot.scope.
        error: Exception | None = None
        try:
            with joining.scope:
                try:
                    await slot.serve(self._new_backend, self._changed, task_status=joining)
                except Exception as exc:
                    if joining.ready:
                        raise  # after readiness a slot keeps its failures: a bug
                    error = exc  # its first start failed, or was cancelled and did not stop
        finally:
            if not joining.ready:
                joining.error = join_failure(
                    self.stage_id,
                    slot.backend.name,
                    removed=slot.draining,
                    # out of joining.scope: only the pool's stop cancels this task
                    closing=trio.current_effective_deadline() == -math.inf,
                    timeout=self.init_timeout if joining.scope.cancel_called else None,
                    cause=error,
                    stops=slot.stop_failures,
                )
            if slot.draining or not joining.ready:
                self._drop(slot)
            joining.settled.set()
            joining.ended.set()

    def _in_replica_order(
        self, failures: list[tuple[str, BaseException]]
    ) -> list[tuple[str, BaseException]]:
        order = {s.backend.name: i for i, s in enumerate(self._slots)}
        return sorted(failures, key=lambda f: order[f[0]])

    def _stop_failures(self) -> list[tuple[str, BaseException]]:
        stops: list[tuple[str, BaseException]] = []
        for slot in self._slots:
            slot.record_stopped(slot.backend)
            stops.extend(slot.stop_failures)
        return stops

    def _raise_stop_failures(self) -> None:
        stops = self._stop_failures()
        if stops:
            raise StageStopError(stops) from group_causes(
                f"stage {self.stage_id!r}: replica stop failures", [exc for _, exc in stops]
            )

    # -- membership ------------------------------------------------------------------------
    async def add_replica(self) -> int:
        """Start one more replica; return its index once it is ready (new requests may go
        to it from then on). The replica is listed (``starting``) from the call on.

        Its supervising task belongs to the pool's nursery from its first step (this call
        only waits for it): stopping the pool cancels the start, bounded by the replica's
        ``shutdown_timeout``. The start is bounded by :attr:`init_timeout`.

        Always checkpoints. Cancelled, the start is cancelled (or the replica stopped, if it
        was ready that instant) and the pool is unchanged once the cancellation propagates.
        Raises :class:`ResourceUnavailableError` if its ``resources`` do not fit in what is
        left of the capacities (nothing built, the pool unchanged); :class:`StageStartError`
        naming the replica if it fails to start, overruns ``stage_init_timeout`` or is
        removed (:meth:`remove_replica`) while it starts (the pool unchanged);
        :class:`EngineClosedError` if the pool is not serving, or stops while the replica
        starts (it is not added).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        nursery = self._nursery
        if nursery is None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise EngineClosedError(f"stage {self.stage_id!r} is not serving; cannot add a replica")
        index = self._next_index
        if self._resources is not None:
            try:
                self._resources.reserve(
                    [(self.stage_id, index, self.config.resources)], "the replica was not added"
                )
            except ResourceUnavailableError:
                await trio.lowlevel.cancel_shielded_checkpoint()
                raise
        self._next_index += 1
        try:
            backend = self._new_backend(index)
        except Exception as exc:
            self._release(index)
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise StageStartError(
                self.stage_id,
                f"added replica {self.stage_id}[{index}]: {type(exc).__name__}: {exc}",
            ) from exc
        slot = ReplicaSlot(index, backend, self._restart_rule)
        joining = _Joining(self.init_timeout)
        self._slots.append(slot)
        self._changed()
        nursery.start_soon(self._serve_added, slot, joining)
        try:
            await joining.settled.wait()
        except BaseException:
            # cancelled: the replica (starting, or ready this instant) leaves the pool, stopped
            with trio.CancelScope(shield=True):
                self._evict(slot, "its add_replica was cancelled")
                await joining.ended.wait()
            raise
        if joining.error is not None:
            raise joining.error
        return index

    async def remove_replica(self, index: int, *, drain_timeout: float = 30.0) -> None:
        """Stop routing new requests to replica ``index``, let its in-flight requests finish
        for up to ``drain_timeout`` seconds, fail the rest with :class:`ReplicaDeadError`,
        stop it and drop it from the pool. Removing the last ready replica is allowed; so is
        removing one still starting (:meth:`add_replica` is in flight): its start is
        cancelled, and that ``add_replica`` raises :class:`StageStartError`.

        Always checkpoints. Cancelled before the removal is committed, nothing happens;
        cancelled while draining, the drain is cut short (the rest fail now) and the replica
        is still stopped before the cancellation propagates. Raises
        :class:`InvalidRequestError` for an unknown index or one already being removed,
        :class:`StageStopError` if the replica's stop failed or overran,
        :class:`EngineClosedError` if the pool is not serving.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        slot = self._slot(index)
        if self._nursery is None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise EngineClosedError(
                f"stage {self.stage_id!r} is not serving; cannot remove replica {index}"
            )
        if slot is None or slot.draining:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise InvalidRequestError(
                f"stage {self.stage_id!r} has no replica {index} to remove"
                + (" (it is already being removed)" if slot is not None else "")
                + f"; its replicas are {[s.index for s in self._slots if not s.draining]}"
            )
        # a slot whose task already ended (dead for good) is dropped here; else its task drops it
        task_ended = slot.ended.is_set()
        slot.start_draining()
        self._changed()
        try:
            with trio.move_on_after(drain_timeout):
                await slot.wait_drained()
        finally:
            with trio.CancelScope(shield=True):
                self._evict(
                    slot,
                    f"drain_timeout={drain_timeout}s ran out with {slot.bound} "
                    f"request(s) in flight",
                )
                if task_ended:
                    self._drop(slot)
                while slot in self._slots:
                    await self._change.wait()
        if slot.stop_failures:
            raise StageStopError(slot.stop_failures) from group_causes(
                f"stage {self.stage_id!r}: replica stop failures",
                [exc for _, exc in slot.stop_failures],
            )

    def _evict(self, slot: ReplicaSlot, why: str) -> None:
        # mark a slot removed and end its supervising task, which stops its backend and drops
        # the slot; the requests still bound to it fail with ReplicaDeadError
        if not slot.draining:
            slot.start_draining()
            self._changed()
        if slot.bound:
            slot.backend.kill(
                ReplicaDeadError(
                    f"replica {slot.backend.name} was removed from the pool: {why}",
                    stage_id=self.stage_id,
                    replica=slot.index,
                )
            )
        slot.scope.cancel()

    def _drop(self, slot: ReplicaSlot) -> None:
        # the one way a slot leaves the pool's list (see the module docstring's ownership)
        self._slots.remove(slot)
        self._release(slot.index)
        self._changed()

    def _release(self, index: int) -> None:
        # replica `index` no longer needs its share of the resources (a no-op if it has none)
        if self._resources is not None:
            self._resources.release(self.stage_id, index)

    def _changed(self) -> None:
        # a replica became ready, restarting, dead, draining, or joined or left the pool
        self._binder.wake()
        self._change.set()
        self._change = trio.Event()

    async def wait_settled(self) -> None:
        """Wait until no replica is starting or restarting (each is ready, draining or dead
        for good); event-driven (see :func:`omni_trio.testing.wait_until_settled`). Always
        checkpoints."""
        await trio.lowlevel.checkpoint()
        while any(slot.pending for slot in self._slots):
            await self._change.wait()

    def _slot(self, index: int) -> ReplicaSlot | None:
        for slot in self._slots:
            if slot.index == index:
                return slot
        return None

    def replica(self, index: int) -> StageBackend:
        """The backend serving replica ``index`` now. Synchronous. Raises
        :class:`InvalidRequestError` for an unknown index."""
        slot = self._slot(index)
        if slot is None:
            raise InvalidRequestError(
                f"stage {self.stage_id!r} has no replica {index}; "
                f"its replicas are {[s.index for s in self._slots]}"
            )
        return slot.backend

    # -- requests ------------------------------------------------------------------------
    def bind_nowait(self, request_id: str) -> StageBackend:
        """Bind a request to a replica now (see :class:`ReplicaBinder`). Synchronous. Raises
        :class:`trio.WouldBlock` if it would wait, :class:`NoLiveReplicaError`."""
        return self._binder.bind_nowait(request_id)

    def bind_to(self, request_id: str, backend: StageBackend) -> None:
        """Bind a request to the replica ``backend`` serves (see
        :meth:`ReplicaBinder.bind_to`). Synchronous."""
        self._binder.bind_to(request_id, backend)

    async def bind(self, request_id: str) -> StageBackend:
        """Bind a request to a replica, waiting first-in first-out if none can take it.
        Always checkpoints; see :meth:`ReplicaBinder.bind`."""
        return await self._binder.bind(request_id)

    def release(self, request_id: str) -> None:
        """Forget a request's binding (its run on the replica ended). Synchronous; a no-op
        for a request that is not bound."""
        self._binder.release(request_id)

    def replica_of(self, request_id: str) -> StageBackend | None:
        """The replica a request is bound to, or ``None``. Synchronous."""
        return self._binder.replica_of(request_id)

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[object] | None = None,
        kwargs: Mapping[str, object] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the engine's API passes it through)
    ) -> list[object]:
        """Call ``method`` on every replica concurrently; one result per replica, in order.

        Checkpoints; cancelling the caller cancels every call. Raises
        :class:`CollectiveRPCTimeoutError` naming the replicas that did not answer within
        ``timeout``; :class:`StageRPCError` naming each replica that raised (a dead one
        raises :class:`ReplicaDeadError`), from an ``ExceptionGroup`` of every cause.
        """
        return await call_replicas(
            self.stage_id, self.replicas, method, args, kwargs, timeout=timeout
        )

    # -- introspection -------------------------------------------------------------------
    @property
    def replicas(self) -> list[StageBackend]:
        """The backends serving the pool's replica indexes now, in index order (a copy)."""
        return [slot.backend for slot in self._slots]

    def init_phases(self) -> list[dict[str, float]]:
        """Per replica: seconds from its ``start`` to each recorded start-up phase."""
        return [slot.backend.init_phases() for slot in self._slots]

    @property
    def live_replicas(self) -> int:
        """Replicas that take new requests (ready, not draining)."""
        return sum(1 for slot in self._slots if slot.takes_requests)

    @property
    def requests_in_flight(self) -> int:
        return self._binder.requests_in_flight

    def statistics(self) -> StageStatistics:
        """A frozen snapshot of the stage and its replicas. Never blocks."""
        return StageStatistics(
            stage_id=self.stage_id,
            stage_index=self.stage_index,
            backend=self.config.backend,
            requests_in_flight=self._binder.requests_in_flight,
            live_replicas=self.live_replicas,
            replicas=tuple(slot.statistics() for slot in self._slots),
            requests_waiting=self._binder.requests_waiting,
        )

    def __repr__(self) -> str:
        return (
            f"<StagePool {self.stage_id!r} backend={self.config.backend} "
            f"replicas={self.live_replicas}/{len(self._slots)} live "
            f"in_flight={self._binder.requests_in_flight} "
            f"waiting={self._binder.requests_waiting}>"
        )
