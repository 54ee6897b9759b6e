"""Collective RPCs to one replica: each call in a cancel scope the replica's death ends.

:class:`RpcCalls` runs a backend's ``_rpc`` hook for :meth:`StageBackend.collective_rpc
<omni_trio.stages.backend.StageBackend.collective_rpc>`, keeps the cancel scope of every call
in flight so that a dying or stopping replica fails them at once (a dead replica never
answers), and turns what the hook raised into a typed error naming the replica. The
replica's lifecycle stays with the backend, which hands a narrow
:class:`~.replica.ReplicaView` of itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence

import trio

from ..errors import ReplicaDeadError, StageRPCError
from .replica import ReplicaView

__all__ = ["RpcCalls", "RpcHook"]

#: a backend's ``_rpc``: (method, args, kwargs) -> result
RpcHook = Callable[[str, tuple[object, ...], dict[str, object]], Awaitable[object]]


class RpcCalls:
    """The collective RPCs in flight on one replica."""

    def __init__(self, replica: ReplicaView) -> None:
        self._replica = replica
        self._scopes: set[trio.CancelScope] = set()

    def cancel_all(self) -> None:
        """Cancel every call in flight (replica death or shutdown). Synchronous."""
        for scope in self._scopes:
            scope.cancel()

    async def call(
        self,
        method: str,
        args: Sequence[object] | None,
        kwargs: Mapping[str, object] | None,
        hook: RpcHook,
    ) -> object:
        """Call ``hook(method, args, kwargs)`` as one RPC on the replica (``None`` args or
        kwargs mean none); see :meth:`StageBackend.collective_rpc
        <omni_trio.stages.backend.StageBackend.collective_rpc>` for the contract. Checkpoints."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._replica.alive():
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise self._replica.unavailable(None)
        scope = trio.CancelScope()
        self._scopes.add(scope)
        try:
            with scope:
                result = await hook(method, tuple(args or ()), dict(kwargs or {}))
        except Exception as exc:
            if not self._replica.alive():
                raise self._replica.unavailable(None) from exc
            if isinstance(exc, (StageRPCError, ReplicaDeadError)):
                raise
            replica = self._replica
            raise StageRPCError(
                f"collective_rpc({method!r}) failed on {replica.name}: {type(exc).__name__}: {exc}",
                stage_id=replica.stage_id,
            ) from exc
        finally:
            self._scopes.discard(scope)
        if scope.cancelled_caught or not self._replica.alive():
            raise self._replica.unavailable(None) from self._replica.death()
        return result
