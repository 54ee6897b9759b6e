"""Which replica runs each request of a stage: bindings, the balancing policy, waiting.

A :class:`ReplicaBinder` binds a request to one replica index for the request's whole life on
the stage (sticky), chosen by the stage's balancing policy (:mod:`.balancing`) among the
replicas that take requests now: ready, not draining, and under ``max_in_flight_per_replica``.
When none can take it, the request waits, first-in first-out, if waiting can end:

- some replica is ready but full: it waits for a slot, without a time bound (admission bounds
  how many requests there are);
- no replica is ready but one is starting or restarting: it waits up to the stage's
  ``replica_wait_timeout_s``, then fails with :class:`NoLiveReplicaError`;
- otherwise it fails at once with :class:`NoLiveReplicaError`, and so do the waiters when the
  last pending replica gives up.

Waiting is event-driven: the pool calls :meth:`ReplicaBinder.wake` when a replica's state
changes, and :meth:`ReplicaBinder.release` wakes the next waiter. The binder reads the pool's
list of :class:`~omni_trio.stages.replicas.ReplicaSlot` and changes slots only through their
methods.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import trio

from ..errors import NoLiveReplicaError, ReplicaDeadError
from .backend import StageBackend
from .balancing import Balancer, ReplicaLoad
from .replica import no_live_replica
from .replicas import ReplicaSlot

__all__ = ["ReplicaBinder"]


class _Waiter:
    __slots__ = ("backend", "error", "event", "request_id", "scope")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.event = trio.Event()
        self.scope = trio.CancelScope()
        self.backend: StageBackend | None = None
        self.error: NoLiveReplicaError | None = None


class ReplicaBinder:
    """The request -> replica bindings of one stage. See the module docstring."""

    def __init__(
        self,
        stage_id: str,
        slots: Sequence[ReplicaSlot],
        balancer: Balancer,
        *,
        max_in_flight: int | None = None,
        wait_timeout: float = 10.0,
    ) -> None:
        self.stage_id = stage_id
        self._slots = slots  # the pool's list, read only
        self._balancer = balancer
        self._limit = max_in_flight
        self._wait_timeout = wait_timeout
        self._bindings: dict[str, tuple[ReplicaSlot, StageBackend]] = {}
        self._waiters: deque[_Waiter] = deque()

    # -- choosing --------------------------------------------------------------------------
    def _takes(self, slot: ReplicaSlot) -> bool:
        return slot.takes_requests and (self._limit is None or slot.bound < self._limit)

    def _choose(self) -> ReplicaSlot | None:
        slots = self._slots
        if len(slots) == 1:
            # the usual single replica: nothing to compare
            return slots[0] if self._takes(slots[0]) else None
        open_slots = [s for s in slots if self._takes(s)]
        if not open_slots:
            return None
        loads = [ReplicaLoad(s.index, s.bound) for s in open_slots]
        return open_slots[self._balancer.choose(loads)]

    def _bind(self, request_id: str, slot: ReplicaSlot) -> StageBackend:
        slot.bind()
        backend = slot.backend
        self._bindings[request_id] = (slot, backend)
        return backend

    # -- binding ---------------------------------------------------------------------------
    def bind_nowait(self, request_id: str) -> StageBackend:
        """Bind a request to a replica now. Synchronous. Raises :class:`trio.WouldBlock` when
        it would have to wait (see the module docstring; also when others already wait:
        nobody overtakes them), :class:`NoLiveReplicaError` when waiting could not end."""
        if not self._waiters:
            slot = self._choose()
            if slot is not None:
                return self._bind(request_id, slot)
        if not any(s.takes_requests or s.pending for s in self._slots):
            raise no_live_replica(self.stage_id, request_id)
        raise trio.WouldBlock

    def bind_to(self, request_id: str, backend: StageBackend) -> None:
        """Bind a request to the replica ``backend`` serves (a companion riding with its
        parent), whatever the policy or slot limits say. Synchronous. Raises
        :class:`ReplicaDeadError` if ``backend`` no longer serves a replica of the stage."""
        for slot in self._slots:
            if slot.backend is backend:
                slot.bind()
                self._bindings[request_id] = (slot, backend)
                return
        raise ReplicaDeadError(
            f"replica {backend.name} no longer serves stage {self.stage_id!r}",
            stage_id=self.stage_id,
            request_id=request_id,
            replica=backend.replica,
        )

    async def bind(self, request_id: str) -> StageBackend:
        """Bind a request to a replica, waiting first-in first-out if none can take it now.

        Always checkpoints. Cancelled while waiting, it leaves nothing behind (a replica
        handed to it at that moment passes to the next waiter). Raises
        :class:`NoLiveReplicaError` when no replica is ready or on its way, or none became
        ready within ``replica_wait_timeout_s``.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            backend = self.bind_nowait(request_id)
        except trio.WouldBlock:
            pass
        except NoLiveReplicaError:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return backend
        waiter = _Waiter(request_id)
        self._waiters.append(waiter)
        self._set_deadlines()
        try:
            with waiter.scope:
                await waiter.event.wait()
        except BaseException:
            if waiter.backend is not None:
                self.release(request_id)  # handed a replica as it was cancelled: pass it on
            else:
                self._forget(waiter)
            raise
        if waiter.backend is not None:
            return waiter.backend
        self._forget(waiter)
        if waiter.error is not None:
            raise waiter.error
        raise NoLiveReplicaError(
            f"stage {self.stage_id!r} has no ready replica: none became ready within "
            f"replica_wait_timeout_s={self._wait_timeout}s",
            stage_id=self.stage_id,
            request_id=request_id,
        )

    def _forget(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass  # already taken off the queue (failed by wake)

    def release(self, request_id: str) -> None:
        """Forget a request's binding (its run on the replica ended) and let the next waiter
        in. Synchronous; a no-op for a request that is not bound."""
        binding = self._bindings.pop(request_id, None)
        if binding is not None:
            binding[0].unbind()
            if self._waiters:
                self.wake()

    def wake(self) -> None:
        """Replicas changed (one became ready or full no longer, died, drains, was added or
        removed): bind waiters in order while a replica takes them; fail them all when no
        replica is ready or on its way. Synchronous."""
        waiters = self._waiters
        while waiters:
            slot = self._choose()
            if slot is None:
                break
            waiter = waiters.popleft()
            waiter.backend = self._bind(waiter.request_id, slot)
            waiter.event.set()
        if waiters:
            self._set_deadlines()

    def _set_deadlines(self) -> None:
        # Waiting for a slot on a ready replica is unbounded; waiting for a replica to come
        # up is bounded by replica_wait_timeout_s from when that began; waiting for nothing
        # fails now.
        slots = self._slots
        if any(s.takes_requests for s in slots):
            for w in self._waiters:
                w.scope.deadline = math.inf
            return
        if not any(s.pending for s in slots):
            while self._waiters:
                waiter = self._waiters.popleft()
                waiter.error = no_live_replica(self.stage_id, waiter.request_id)
                waiter.event.set()
            return
        deadline = trio.current_time() + self._wait_timeout
        for w in self._waiters:
            if w.scope.deadline == math.inf:
                w.scope.deadline = deadline

    # -- introspection -------------------------------------------------------------------
    def replica_of(self, request_id: str) -> StageBackend | None:
        """The replica a request is bound to, or ``None``. Synchronous."""
        binding = self._bindings.get(request_id)
        return None if binding is None else binding[1]

    @property
    def requests_in_flight(self) -> int:
        return len(self._bindings)

    @property
    def requests_waiting(self) -> int:
        return len(self._waiters)

    def __repr__(self) -> str:
        return (
            f"<ReplicaBinder {self.stage_id!r} bound={len(self._bindings)} "
            f"waiting={len(self._waiters)} {self._balancer!r}>"
        )
