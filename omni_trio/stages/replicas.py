"""One replica index of a stage's pool, across the backends that serve it in turn.

A :class:`ReplicaSlot` is what the pool keeps per replica index: the backend serving it now,
the requests bound to it, whether it is being drained (removed), whether a replacement is on
its way (``restart: on-failure``), and the counts that outlive one backend (restarts, deaths,
the last error, finished/aborted/failed requests). Its :attr:`~ReplicaSlot.state` is the
replica's state as users see it: the backend's own (starting, ready, dead, stopped) with
``draining`` and ``restarting`` laid over it. The slot changes only through its own methods;
the pool calls them. :func:`restart_delay` is the backoff rule, pure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from ..errors import StageStopError
from ..outputs import ReplicaState, ReplicaStatistics
from .backend import StageBackend

if TYPE_CHECKING:
    from ..config.stage import StageConfig

__all__ = ["ReplicaSlot", "RestartRule", "restart_delay"]

logger = logging.getLogger(__name__)


def restart_delay(restarts: int, base: float, cap: float) -> float:
    """Seconds to wait before replacing a replica index that was already replaced
    ``restarts`` times: ``base * 2**restarts``, at most ``cap``. Pure."""
    if base <= 0:
        return 0.0
    # 2**restarts overflows float only past ~1000 restarts; min() first keeps it finite
    return min(cap, base * 2.0 ** min(restarts, 64))


@dataclass(frozen=True, slots=True)
class RestartRule:
    """A stage's restart settings (``restart``, ``max_restarts``, ``restart_backoff_s``,
    ``restart_backoff_max_s``)."""

    on_failure: bool = False
    max_restarts: int = 0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0

    @classmethod
    def of(cls, config: StageConfig) -> RestartRule:
        return cls(
            config.restart == "on-failure",
            config.max_restarts,
            config.restart_backoff_s,
            config.restart_backoff_max_s,
        )

    def allows(self, restarts: int) -> bool:
        """Whether an index replaced ``restarts`` times may be replaced again. Pure."""
        return self.on_failure and restarts < self.max_restarts

    def delay(self, restarts: int) -> float:
        return restart_delay(restarts, self.backoff_s, self.backoff_max_s)


class _Started:
    """The task status a backend's ``serve`` gets: remembers whether it reported readiness,
    passes the first start's readiness on to the pool's ``nursery.start``, and calls
    ``on_ready``."""

    def __init__(self, inner: trio.TaskStatus[None] | None, on_ready: Callable[[], None]) -> None:
        self._inner = inner
        self._on_ready = on_ready
        self.called = False
        #: the index's first start (its outcome is the supervising task's start)
        self.first = inner is not None

    def started(self, value: None = None) -> None:
        self.called = True
        if self._inner is not None:
            self._inner.started()
        self._on_ready()


def describe_error(exc: BaseException | None) -> str | None:
    """``"ExcType: message"`` (how statistics report a death), or ``None``. Pure."""
    return None if exc is None else f"{type(exc).__name__}: {exc}"


class ReplicaSlot:
    """One replica index of a pool. See the module docstring."""

    __slots__ = (
        "_counts",
        "_drained",
        "backend",
        "bound",
        "draining",
        "ended",
        "failures",
        "index",
        "last_error",
        "restarting",
        "restarts",
        "rule",
        "scope",
        "stop_failures",
    )

    def __init__(self, index: int, backend: StageBackend, rule: RestartRule | None = None) -> None:
        self.index = index
        self.backend = backend
        self.rule = rule or RestartRule()
        #: requests bound to this index now (bound before their run starts on the backend)
        self.bound = 0
        #: being removed (an added replica: also when its add is cancelled): takes no new
        #: request, never restarted
        self.draining = False
        #: a replacement is on its way (backoff, then its start)
        self.restarting = False
        self.restarts = 0
        self.failures = 0
        self.last_error: str | None = None
        #: the supervising task's scope: cancelling it stops this index alone (removal)
        self.scope = trio.CancelScope()
        #: set when the supervising task returned (the last backend stopped)
        self.ended = trio.Event()
        #: (replica name, exception) of every backend of this index whose stop failed
        self.stop_failures: list[tuple[str, BaseException]] = []
        # finished / aborted / failed requests of the backends replaced so far
        self._counts = (0, 0, 0)
        self._drained: trio.Event | None = None

    # -- state ---------------------------------------------------------------------------
    @property
    def state(self) -> ReplicaState:
        if self.restarting:
            return "restarting"
        state = self.backend.state
        if state == "ready" and self.draining:
            return "draining"
        return state

    @property
    def takes_requests(self) -> bool:
        """Ready and not draining: new requests may be bound here. Synchronous."""
        return self.backend.alive and not self.draining

    @property
    def pending(self) -> bool:
        """Not ready yet but on its way (starting, or a replacement pending), and not being
        removed: a request may wait for it. Synchronous."""
        if self.draining or self.ended.is_set():
            return False
        state = self.backend.state
        # a death the supervising task has not handled yet counts if it will be restarted
        return (
            self.restarting
            or state == "starting"
            or (state == "dead" and self.rule.allows(self.restarts))
        )

    # -- bindings --------------------------------------------------------------------------
    def bind(self) -> None:
        self.bound += 1

    def unbind(self) -> None:
        self.bound -= 1
        if self.bound == 0 and self._drained is not None:
            self._drained.set()

    async def wait_drained(self) -> None:
        """Wait until no request is bound here. Always checkpoints."""
        if self._drained is None:
            self._drained = trio.Event()
        if self.bound == 0:
            self._drained.set()
        await self._drained.wait()

    def start_draining(self) -> None:
        self.draining = True

    # -- the supervising task ----------------------------------------------------------------
    async def serve(
        self,
        new_backend: Callable[[int], StageBackend],
        on_change: Callable[[], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve this index for the session: its backend, then (:attr:`rule`) each replacement
        of a dead one, after a backoff, until the rule gives up. ``on_change`` is called
        whenever the index becomes ready, restarting, or gives up (the pool's waiters).

        Checkpoints. Its first start is this task's start: a failure is raised (to the
        pool's ``nursery.start``). A replacement failing to start counts as one more death.
        Cancelling :attr:`scope` ends it (removal): the backend is stopped and it returns;
        other cancellation (shutdown) propagates once the backend stopped. Stop failures are
        kept in :attr:`stop_failures`, not raised.
        """
        status = _Started(task_status, on_change)
        rule = self.rule
        try:
            with self.scope:
                while True:
                    backend = self.backend
                    try:
                        await backend.serve(task_status=status)
                    except StageStopError:
                        if status.first and not status.called:
                            raise  # a cancelled first start: nursery.start must see it
                        # after a death or at shutdown: kept by record_stopped below
                    except Exception as exc:
                        if status.first and not status.called:
                            raise  # the first start failed: the pool's start fails
                        self.record_failure(exc)  # a replacement failed to start
                    else:
                        if backend.state == "dead":
                            self.record_failure(backend.death)
                    finally:
                        self.record_stopped(backend)
                    if backend.state != "dead" or self.draining or not rule.allows(self.restarts):
                        return
                    self.begin_restart()
                    on_change()  # waiters now wait for the replacement, bounded
                    await trio.sleep(rule.delay(self.restarts))
                    try:
                        replacement = new_backend(self.index)
                    except Exception as exc:
                        self.record_failure(exc)
                        return
                    self.replace(replacement)
                    status = _Started(None, self._restarted_callback(on_change))
        finally:
            self.end_restart()
            self.ended.set()
            on_change()  # whoever waits for this index may have to fail now

    def _restarted_callback(self, on_change: Callable[[], None]) -> Callable[[], None]:
        def restarted() -> None:
            self.end_restart()
            logger.info("replica %s restarted (restart %d)", self.backend.name, self.restarts)
            on_change()

        return restarted

    # -- life across backends ------------------------------------------------------------
    def record_failure(self, exc: BaseException | None) -> None:
        """The backend died (or a replacement failed to start) with ``exc``."""
        self.failures += 1
        self.last_error = describe_error(exc)

    def record_stopped(self, backend: StageBackend) -> None:
        """``backend`` (this index's, now or before) has stopped: keep its stop failure."""
        failure = backend.stop_failure
        if failure is not None and all(exc is not failure for _, exc in self.stop_failures):
            self.stop_failures.append((backend.name, failure))

    def begin_restart(self) -> None:
        """A replacement is on its way: ``restarting`` until :meth:`end_restart`."""
        self.restarting = True

    def end_restart(self) -> None:
        """The replacement is ready, or no more will be tried."""
        self.restarting = False

    def replace(self, backend: StageBackend) -> None:
        """``backend`` (starting) now serves this index, as a restart; the old one's counts
        are kept. The slot stays ``restarting`` until :meth:`end_restart`."""
        old = self.backend.statistics()
        f, a, x = self._counts
        self._counts = (
            f + old.requests_finished,
            a + old.requests_aborted,
            x + old.requests_failed,
        )
        self.backend = backend
        self.restarts += 1

    # -- introspection -------------------------------------------------------------------
    def statistics(self) -> ReplicaStatistics:
        """A frozen snapshot of this replica index. Never blocks."""
        now = self.backend.statistics()
        f, a, x = self._counts
        return ReplicaStatistics(
            replica=self.index,
            alive=now.alive,
            requests_in_flight=now.requests_in_flight,
            requests_finished=f + now.requests_finished,
            requests_aborted=a + now.requests_aborted,
            requests_failed=x + now.requests_failed,
            state=self.state,
            restarts=self.restarts,
            failures=self.failures,
            last_error=self.last_error,
        )

    def __repr__(self) -> str:
        return (
            f"<ReplicaSlot {self.backend.name} {self.state} bound={self.bound} "
            f"restarts={self.restarts} failures={self.failures}>"
        )
