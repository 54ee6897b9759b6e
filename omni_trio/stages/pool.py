"""Replica pools: one per stage, owning that stage's replicas and the request -> replica bindings.

The pool starts its replicas in parallel in its own nursery, binds each request to one live
replica (:func:`choose_replica`, least loaded first), and forgets the binding when the request
ends, however it ends. A dead replica fails only the requests bound to it; new requests go
to the live ones. Backends are created from ``StageConfig.backend`` by :func:`create_backend`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any

import trio

from ..config import StageConfig
from ..errors import BackendUnavailableError, ConfigError, StageStartError
from ..outputs import ReplicaStatistics, StageOutput, StageStatistics
from ._abc import Emit, InputStream, StageBackend, no_live_replica

__all__ = ["StagePool", "choose_replica", "create_backend"]

logger = logging.getLogger(__name__)

_BUILTIN = {
    "scripted": ("omni_trio.stages.scripted", "ScriptedBackend"),
    "vllm": ("omni_trio.stages.vllm", "VllmBackend"),
    "torch": ("omni_trio.stages.torch", "TorchBackend"),
}


def choose_replica(replicas: Sequence[ReplicaStatistics]) -> int | None:
    """Index of the live replica with the fewest requests in flight (lowest index on ties),
    or ``None`` when none is alive. Pure."""
    best: int | None = None
    for i, r in enumerate(replicas):
        if r.alive and (best is None or r.requests_in_flight < replicas[best].requests_in_flight):
            best = i
    return best


def create_backend(config: StageConfig, *, stage_index: int, replica: int) -> StageBackend:
    """Build one replica of a stage from its config. Raises ConfigError/BackendUnavailableError."""
    where = f"$.stages[{stage_index}].backend"
    module_name, attr = _BUILTIN.get(config.backend, (None, None))
    if module_name is None:
        module_name, _, attr = config.backend.partition(":")
    assert attr is not None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if config.backend in _BUILTIN:
            raise BackendUnavailableError(
                f"stage {config.id!r}: backend {config.backend!r} needs an optional dependency "
                f"({exc.name or exc}); install omni-trio[{config.backend}]"
            ) from exc
        raise ConfigError(
            f"cannot import backend module {module_name!r}: {exc}", path=where
        ) from exc
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(f"backend module {module_name!r} has no {attr!r}", path=where)
    try:
        backend = factory(config, stage_index=stage_index, replica=replica)
    except (ConfigError, BackendUnavailableError):
        raise
    except Exception as exc:
        raise ConfigError(
            f"backend factory {config.backend!r} failed for stage {config.id!r}: "
            f"{type(exc).__name__}: {exc}",
            path=where,
        ) from exc
    if not isinstance(backend, StageBackend):
        raise ConfigError(
            f"backend {config.backend!r} returned {type(backend).__name__}, "
            f"not a omni_trio.stages.StageBackend",
            path=where,
        )
    return backend


class StagePool:
    """The replicas of one stage and the requests bound to them."""

    def __init__(self, config: StageConfig, *, stage_index: int) -> None:
        self.config = config
        self.stage_id = config.id
        self.stage_index = stage_index
        self.replicas: list[StageBackend] = [
            create_backend(config, stage_index=stage_index, replica=r)
            for r in range(config.replicas)
        ]
        self._bindings: dict[str, StageBackend] = {}

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every replica in parallel, report ready when all are, run until cancelled.

        Checkpoints. Raises :class:`StageStartError` if any replica fails to start (the ones
        that started are stopped first). Cancellation stops every replica (in parallel).
        """
        failures: list[tuple[int, BaseException]] = []
        async with trio.open_nursery() as nursery:

            async def start_one(backend: StageBackend) -> None:
                try:
                    await nursery.start(self._serve_replica, backend)
                except Exception as exc:
                    failures.append((backend.replica, exc))

            async with trio.open_nursery() as starters:
                for backend in self.replicas:
                    starters.start_soon(start_one, backend)
            if failures:
                nursery.cancel_scope.cancel()
            else:
                task_status.started()
        if failures:
            replica, exc = failures[0]
            raise StageStartError(
                self.stage_id, f"replica {replica}: {type(exc).__name__}: {exc}"
            ) from exc

    async def _serve_replica(
        self, backend: StageBackend, *, task_status: trio.TaskStatus[None]
    ) -> None:
        # After readiness a replica's failure is that replica's death, never the engine's:
        # it is recorded on the backend (its requests fail) and the pool keeps the others.
        try:
            await backend.serve(task_status=task_status)
        except Exception as exc:
            if not backend._ready:
                raise
            backend._die(exc)
            logger.warning("stage %s: replica %d died: %r", self.stage_id, backend.replica, exc)

    # -- requests ------------------------------------------------------------------------
    def bind(self, request_id: str) -> StageBackend:
        """Bind a request to a live replica. Synchronous. Raises NoLiveReplicaError."""
        idx = choose_replica([r.statistics() for r in self.replicas])
        if idx is None:
            raise no_live_replica(self.stage_id, request_id)
        backend = self.replicas[idx]
        self._bindings[request_id] = backend
        return backend

    async def run_request(
        self, request_id: str, inputs: InputStream, sampling_params: Any, emit: Emit
    ) -> None:
        """Run a request on a live replica; the binding is gone when this returns.

        Checkpoints. Cancellation aborts it in the replica first. Raises what the replica
        raises (StageError, ReplicaDeadError) or NoLiveReplicaError.
        """
        backend = self.bind(request_id)
        try:
            await backend.run_request(request_id, inputs, sampling_params, emit)
        finally:
            self._bindings.pop(request_id, None)

    def replica_of(self, request_id: str) -> StageBackend | None:
        return self._bindings.get(request_id)

    async def abort(self, request_id: str) -> list[StageOutput]:
        backend = self._bindings.get(request_id)
        return await backend.abort(request_id) if backend else []

    @property
    def live_replicas(self) -> int:
        return sum(1 for r in self.replicas if r.alive)

    @property
    def requests_in_flight(self) -> int:
        return len(self._bindings)

    def statistics(self) -> StageStatistics:
        return StageStatistics(
            stage_id=self.stage_id,
            stage_index=self.stage_index,
            backend=self.config.backend,
            requests_in_flight=len(self._bindings),
            live_replicas=self.live_replicas,
            replicas=tuple(r.statistics() for r in self.replicas),
        )

    def __repr__(self) -> str:
        return (
            f"<StagePool {self.stage_id!r} backend={self.config.backend} "
            f"replicas={self.live_replicas}/{len(self.replicas)} live "
            f"in_flight={len(self._bindings)}>"
        )
