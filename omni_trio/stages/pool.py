"""Replica pools: one per stage, owning that stage's replicas for the whole session.

:class:`StagePool` runs requests on its replicas: each is bound to one replica by a
:class:`~omni_trio.stages.binding.ReplicaBinder` (balancing policy, per-replica slots, waiting
for a restarting replica), and a dead replica fails only the requests bound to it. RPCs fan
out to every replica concurrently. Starting, restarting, adding, removing and stopping the
replicas is its base :class:`~omni_trio.stages._pool_lifecycle.PoolLifecycle`. Backends are
created from ``StageConfig.backend`` by :func:`create_backend`; the pool uses only their
public methods.

Several children failing (starts, stops, RPCs) raise one typed error ``from`` an
``ExceptionGroup`` of every cause, as trio's ``open_tcp_stream`` does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import trio

from ..context import RequestContext
from ..failures import describe_failures
from ..outputs import Payload, SamplingParams, StageOutput, StageStatistics
from ._abc import StageBackend
from ._emit import Emit
from ._inputs import InputStream
from ._pool_lifecycle import PoolLifecycle
from .factory import BackendFactory, create_backend
from .fanout import call_replicas

__all__ = ["BackendFactory", "StagePool", "create_backend", "describe_failures"]  # re-exported

logger = logging.getLogger(__name__)


class StagePool(PoolLifecycle):
    """The replicas of one stage and the requests bound to them.

    ``shutdown_timeout`` (the pipeline's) bounds each replica's stop unless the stage sets
    its own ``shutdown_timeout``; ``stage_init_timeout`` (the pipeline's; default unbounded)
    bounds an added replica's start unless the stage sets its own (:attr:`init_timeout`; the
    :class:`~omni_trio.stages.group.StageGroup` bounds the first start with it); ``lb_policy``
    (the pipeline's) is the balancing policy unless the stage sets its own; ``lb_seed`` seeds
    the ``random`` policy; ``factory`` builds each replica's backend (default
    :func:`create_backend`), for the first start, restarts and added replicas alike.
    """

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
        """Run a request on a replica; the binding is gone when this returns.
        ``streamed``: see :meth:`StageBackend.run_request`.

        Checkpoints. Cancellation aborts it in the replica first. Raises what the replica
        raises (StageError, ReplicaDeadError) or NoLiveReplicaError.
        """
        backend = await self._binder.bind(request_id)
        try:
            await backend.run_request(
                request_id, inputs, sampling_params, emit, streamed=streamed, context=context
            )
        finally:
            self._binder.release(request_id)

    def release(self, request_id: str) -> None:
        """Forget a request's binding (its run on the replica ended). Synchronous; a no-op
        for a request that is not bound."""
        self._binder.release(request_id)

    def replica_of(self, request_id: str) -> StageBackend | None:
        """The replica a request is bound to, or ``None``. Synchronous."""
        return self._binder.replica_of(request_id)

    async def abort(self, request_id: str) -> list[StageOutput]:
        """Abort a request in its replica; returns its outputs so far (``[]`` if unknown).
        Always checkpoints."""
        backend = self._binder.replica_of(request_id)
        if backend is None:
            await trio.lowlevel.checkpoint()
            return []
        return await backend.abort(request_id)

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[Payload] | None = None,
        kwargs: Mapping[str, Payload] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the engine's API passes it through)
    ) -> list[Payload]:
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
