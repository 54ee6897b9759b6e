"""Replica pools: one per stage, owning that stage's replicas and the request -> replica bindings.

The pool starts its replicas in parallel in its own nursery (one failing to start cancels the
others' starts at once), binds each request to one live replica (:func:`choose_replica`,
least loaded first), and forgets the binding when the request ends, however it ends. A dead
replica fails only the requests bound to it; new requests go to the live ones. RPCs fan out
to every replica concurrently. Backends are created from ``StageConfig.backend`` by
:func:`create_backend`; the pool uses only their public methods.

Several children failing (starts, stops, RPCs) raise one typed error ``from`` an
``ExceptionGroup`` of every cause, as trio's ``open_tcp_stream`` does.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence

import trio

from ..config import StageConfig
from ..errors import (
    BackendUnavailableError,
    CollectiveRPCTimeoutError,
    ConfigError,
    StageRPCError,
    StageStartError,
    StageStopError,
)
from ..outputs import Payload, ReplicaStatistics, SamplingParams, StageOutput, StageStatistics
from ._abc import (
    DEFAULT_SHUTDOWN_TIMEOUT,
    Emit,
    InputStream,
    StageBackend,
    is_cancellation,
    no_live_replica,
)

__all__ = ["StagePool", "choose_replica", "create_backend", "describe_failures"]

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


def describe_failures(failures: Sequence[tuple[str, BaseException]]) -> str:
    """``"a[0]: ValueError: boom; a[2]: ..."``: one line naming every failed child. Pure."""
    return "; ".join(f"{name}: {type(exc).__name__}: {exc}" for name, exc in failures)


def _group(message: str, causes: Sequence[BaseException]) -> BaseException:
    # the single cause itself, or every cause kept in a group
    if len(causes) == 1:
        return causes[0]
    if all(isinstance(c, Exception) for c in causes):
        return ExceptionGroup(message, [c for c in causes if isinstance(c, Exception)])
    return BaseExceptionGroup(message, list(causes))


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


class _Started:
    """A task status that remembers whether the replica reported readiness."""

    def __init__(self, inner: trio.TaskStatus[None]) -> None:
        self._inner = inner
        self.called = False

    def started(self, value: None = None) -> None:
        self.called = True
        self._inner.started()


class StagePool:
    """The replicas of one stage and the requests bound to them.

    ``shutdown_timeout`` (the pipeline's) bounds each replica's stop unless the stage sets
    its own ``shutdown_timeout``.
    """

    def __init__(
        self,
        config: StageConfig,
        *,
        stage_index: int,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    ) -> None:
        self.config = config
        self.stage_id = config.id
        self.stage_index = stage_index
        self.replicas: list[StageBackend] = [
            create_backend(config, stage_index=stage_index, replica=r)
            for r in range(config.replicas)
        ]
        if config.shutdown_timeout is None:
            for backend in self.replicas:
                backend.shutdown_timeout = shutdown_timeout
        self._bindings: dict[str, StageBackend] = {}

    # -- lifecycle -------------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every replica in parallel, report ready when all are, run until cancelled.

        Checkpoints. If a replica fails to start, the other starts are cancelled at once,
        every replica is stopped, and :class:`StageStartError` names each failed replica
        (raised from the cause, or from an ``ExceptionGroup`` of every cause). A replica that
        dies after readiness does not end the pool. Cancellation is the shutdown signal: it
        stops every replica in parallel (each bounded by its ``shutdown_timeout``), then
        raises :class:`StageStopError` listing each replica whose stop raised or overran.
        """
        failed: list[tuple[str, BaseException]] = []
        try:
            async with trio.open_nursery() as nursery:
                async with trio.open_nursery() as starters:
                    for backend in self.replicas:
                        starters.start_soon(self._start_replica, nursery, starters, backend, failed)
                if failed:
                    nursery.cancel_scope.cancel()
                else:
                    task_status.started()
                    # the pool lives until shutdown, even if every replica died
                    await trio.sleep_forever()
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
        raise StageStartError(self.stage_id, reason) from _group(
            f"stage {self.stage_id!r}: replica start failures", causes
        )

    async def _start_replica(
        self,
        nursery: trio.Nursery,
        starters: trio.Nursery,
        backend: StageBackend,
        failed: list[tuple[str, BaseException]],
    ) -> None:
        try:
            await nursery.start(self._serve_replica, backend)
        except StageStopError:
            pass  # a start cancelled by a sibling's failure, whose stop failed: recorded
        except Exception as exc:
            failed.append((backend.name, exc))
            starters.cancel_scope.cancel()  # the siblings' starts stop now, not at the slowest

    async def _serve_replica(
        self, backend: StageBackend, *, task_status: trio.TaskStatus[None]
    ) -> None:
        status = _Started(task_status)
        try:
            await backend.serve(task_status=status)
        except StageStopError:
            if not status.called:
                raise  # a cancelled start: nursery.start() must see it
            # After a death or at shutdown. Recorded on the backend (its stop_failure) and
            # raised by serve() when the pool stops; raising it here would stop the siblings.

    def _in_replica_order(
        self, failures: list[tuple[str, BaseException]]
    ) -> list[tuple[str, BaseException]]:
        order = {b.name: i for i, b in enumerate(self.replicas)}
        return sorted(failures, key=lambda f: order[f[0]])

    def _stop_failures(self) -> list[tuple[str, BaseException]]:
        return [(b.name, b.stop_failure) for b in self.replicas if b.stop_failure is not None]

    def _raise_stop_failures(self) -> None:
        stops = self._stop_failures()
        if stops:
            raise StageStopError(stops) from _group(
                f"stage {self.stage_id!r}: replica stop failures", [exc for _, exc in stops]
            )

    # -- requests ------------------------------------------------------------------------
    def bind(self, request_id: str) -> StageBackend:
        """Bind a request to a live replica. Synchronous. Raises NoLiveReplicaError."""
        # choose_replica's rule, without a statistics snapshot of every replica per request
        replicas = self.replicas
        backend: StageBackend | None = None
        if len(replicas) == 1:
            if replicas[0].alive:
                backend = replicas[0]  # the usual single replica: nothing to compare
        else:
            backend = self._least_loaded()
        if backend is None:
            raise no_live_replica(self.stage_id, request_id)
        self._bindings[request_id] = backend
        return backend

    def _least_loaded(self) -> StageBackend | None:
        backend: StageBackend | None = None
        for r in self.replicas:
            if r.alive and (backend is None or r.requests_in_flight < backend.requests_in_flight):
                backend = r
        return backend

    async def run_request(
        self,
        request_id: str,
        inputs: InputStream,
        sampling_params: SamplingParams,
        emit: Emit,
        *,
        streamed: bool = True,
    ) -> None:
        """Run a request on a live replica; the binding is gone when this returns.
        ``streamed``: see :meth:`StageBackend.run_request`.

        Checkpoints. Cancellation aborts it in the replica first. Raises what the replica
        raises (StageError, ReplicaDeadError) or NoLiveReplicaError.
        """
        backend = self.bind(request_id)
        try:
            await backend.run_request(request_id, inputs, sampling_params, emit, streamed=streamed)
        finally:
            self.release(request_id)

    def release(self, request_id: str) -> None:
        """Forget a request's binding (its run on the replica ended). Synchronous; a no-op
        for a request that is not bound."""
        self._bindings.pop(request_id, None)

    def replica_of(self, request_id: str) -> StageBackend | None:
        """The replica a request is bound to, or ``None``. Synchronous."""
        return self._bindings.get(request_id)

    async def abort(self, request_id: str) -> list[StageOutput]:
        """Abort a request in its replica; returns its outputs so far (``[]`` if unknown).
        Always checkpoints."""
        backend = self._bindings.get(request_id)
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
        results: list[Payload] = [None] * len(self.replicas)
        answered = [False] * len(self.replicas)
        errors: list[Exception | None] = [None] * len(self.replicas)

        async def call(i: int, backend: StageBackend) -> None:
            try:
                results[i] = await backend.collective_rpc(method, args, kwargs)
            except Exception as exc:
                errors[i] = exc
            answered[i] = True

        with trio.move_on_after(math.inf if timeout is None else timeout):
            async with trio.open_nursery() as nursery:
                for i, backend in enumerate(self.replicas):
                    nursery.start_soon(call, i, backend)
        failed = [(b.name, e) for b, e in zip(self.replicas, errors, strict=True) if e is not None]
        causes = (
            _group(f"collective_rpc({method!r}) on stage {self.stage_id!r}", [e for _, e in failed])
            if failed
            else None
        )
        if not all(answered):
            pending = [b.name for b, done in zip(self.replicas, answered, strict=True) if not done]
            raise CollectiveRPCTimeoutError(method, float(timeout or 0.0), pending) from causes
        if failed:
            raise StageRPCError(
                f"collective_rpc({method!r}) failed on {describe_failures(failed)}",
                stage_id=self.stage_id,
                failures=failed,
            ) from causes
        return results

    # -- introspection -------------------------------------------------------------------
    def init_phases(self) -> list[dict[str, float]]:
        """Per replica: seconds from its ``start`` to each recorded start-up phase."""
        return [r.init_phases() for r in self.replicas]

    @property
    def live_replicas(self) -> int:
        return sum(1 for r in self.replicas if r.alive)

    @property
    def requests_in_flight(self) -> int:
        return len(self._bindings)

    def statistics(self) -> StageStatistics:
        """A frozen snapshot of the stage and its replicas. Never blocks."""
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
