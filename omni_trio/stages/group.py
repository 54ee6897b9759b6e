"""``StageGroup``: every stage pool of one engine, started together and stopped together.

:meth:`StageGroup.serve` starts the pools in parallel (each under its stage's
``stage_init_timeout``, all under the pipeline's ``init_timeout``; the first failure cancels
the other starts at once) and reports readiness; from then on it runs shielded from outside
cancellation, because the engine's requests must end before the stages they run on, until
:meth:`StageGroup.stop` is called. Stopping stops every pool in parallel (each replica bounded
by its ``shutdown_timeout``); what did not stop cleanly is kept as one
:class:`~omni_trio.errors.StageStopError` (:attr:`StageGroup.stop_error`) for the engine to
raise after everything stopped.

Before any replica starts, every replica's ``resources`` are reserved at once in the
group's :class:`~omni_trio.stages.ledger.ResourceLedger` (:attr:`StageGroup.resources`,
shared with the pools, which reserve an added replica's and give back a removed one's): a
deployment that does not fit raises
:class:`~omni_trio.errors.ResourceUnavailableError` and starts nothing. Every share is
given back once the stages stopped.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from functools import partial

import trio

from ..config.pipeline import PipelineConfig
from ..errors import ResourceUnavailableError, StageStartError, StageStopError
from ..failures import merge_start_errors, merge_stop_errors, single_leaf
from ..outputs import StageStatistics
from .factory import create_backend
from .ledger import Ask, ResourceLedger
from .pool import StagePool

__all__ = ["StageGroup"]

logger = logging.getLogger(__name__)


class StageGroup:
    """The stage pools of one pipeline. See the module docstring."""

    def __init__(self, config: PipelineConfig, resources: ResourceLedger | None = None) -> None:
        self.config = config
        #: what the replicas reserve of the capacities (default: the config's, the
        #: machine's share read when a stage asks for cpu_cores or memory_gib)
        self.resources = ResourceLedger.for_pipeline(config) if resources is None else resources
        # a backend that cannot be built names the config's file
        build = partial(create_backend, source=config.source)
        self.pools: dict[str, StagePool] = {
            st.id: StagePool(
                st,
                stage_index=i,
                shutdown_timeout=config.shutdown_timeout,
                stage_init_timeout=config.stage_init_timeout,
                lb_policy=config.lb_policy,
                # one seed per stage: stages with the same replicas do not choose in lockstep
                lb_seed=None if config.lb_seed is None else config.lb_seed + i,
                factory=build,
                resources=self.resources,
            )
            for i, st in enumerate(config.stages)
        }
        #: per stage: trio-clock ``start``, ``ready`` and ``seconds`` of its start-up
        self.init_timeline: dict[str, dict[str, float]] = {}
        self._scope: trio.CancelScope | None = None
        self._stopped = trio.Event()
        self._stop_error: StageStopError | None = None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every pool in parallel, report started, run (shielded) until :meth:`stop`,
        then stop every pool. Checkpoints. Raises :class:`ResourceUnavailableError` before
        starting anything when the replicas' resources do not fit the capacities;
        :class:`StageStartError` naming every stage that failed to start (after stopping
        those that started); a stop failure is kept in :attr:`stop_error`, not raised."""
        try:
            try:
                self.resources.reserve(self._initial_asks(), "nothing was started")
            except ResourceUnavailableError:
                await trio.lowlevel.cancel_shielded_checkpoint()
                raise
            with trio.CancelScope() as scope:
                self._scope = scope
                try:
                    async with trio.open_nursery() as pools:
                        await self._start(pools)
                        # A cancellation that landed while the last pool reported ready has
                        # reached some replicas but not this task: honour it here. Shielding
                        # now would hide it from the pools, whose nurseries would then absorb
                        # their replicas' Cancelled and end as if the start was interrupted.
                        await trio.lowlevel.checkpoint_if_cancelled()
                        scope.shield = True
                        task_status.started()
                        await trio.sleep_forever()
                except BaseExceptionGroup as group:
                    starts, _ = group.split(StageStartError)
                    stops, rest = group.split(StageStopError)
                    if stops is not None:
                        self._stop_error = merge_stop_errors(stops)
                    if starts is not None:
                        # stages that started were stopped; a stop failure beside a failed
                        # start is logged, the start failure is what the caller gets
                        if self._stop_error is not None:
                            logger.error("after a failed start: %s", self._stop_error)
                        leaf = single_leaf(starts)
                        if leaf is not None:
                            # `from None` would also erase the leaf's own cause
                            raise leaf from leaf.__cause__
                        raise starts from None
                    if rest is not None:
                        # the cancellation that stopped the pools (this scope catches it),
                        # or a bug: either way not ours to swallow
                        raise rest from None
        finally:
            self.resources.release_all()
            self._stopped.set()

    def _initial_asks(self) -> list[Ask]:
        # every replica of every stage that reserves something, in config order
        return [
            (st.id, replica, st.resources)
            for st in self.config.stages
            if st.resources
            for replica in range(st.replicas)
        ]

    async def _start(self, pools: trio.Nursery) -> None:
        failures: list[StageStartError] = []
        started: set[str] = set()

        async def start(pool: StagePool) -> None:
            timeout = pool.init_timeout
            t0 = trio.current_time()
            with trio.move_on_after(timeout) as scope:
                try:
                    await pools.start(pool.serve)
                except StageStartError as exc:
                    failures.append(exc)
                except Exception as exc:
                    failure = StageStartError(pool.stage_id, f"{type(exc).__name__}: {exc}")
                    failure.__cause__ = exc
                    failures.append(failure)
                else:
                    started.add(pool.stage_id)
                    now = trio.current_time()
                    self.init_timeline[pool.stage_id] = {
                        "start": t0,
                        "ready": now,
                        "seconds": now - t0,
                    }
            if scope.cancelled_caught:
                failures.append(
                    StageStartError(
                        pool.stage_id, f"did not start within stage_init_timeout={timeout}s"
                    )
                )
            if failures:
                starters.cancel_scope.cancel()

        overall = self.config.init_timeout
        with trio.move_on_after(overall) if overall else nullcontext() as overall_scope:
            async with trio.open_nursery() as starters:
                for pool in self.pools.values():
                    starters.start_soon(start, pool)
        if not failures and overall_scope is not None and overall_scope.cancelled_caught:
            slow = [sid for sid in self.pools if sid not in started]
            failures.append(
                StageStartError(
                    ", ".join(slow), f"the pipeline did not start within init_timeout={overall}s"
                )
            )
        if failures:
            pools.cancel_scope.cancel()
            raise merge_start_errors(failures)

    def stop(self) -> None:
        """Stop every pool (in parallel). Synchronous and idempotent; :meth:`wait_stopped`
        waits for it."""
        if self._scope is not None:
            self._scope.cancel()

    async def wait_stopped(self) -> None:
        """Wait until every pool has stopped (or failed to start). Always checkpoints."""
        await self._stopped.wait()

    @property
    def stop_error(self) -> StageStopError | None:
        """Every replica whose stop failed or overran, once stopped; else None."""
        return self._stop_error

    def init_phases(self) -> dict[str, list[dict[str, float]]]:
        """Per stage, per replica: seconds from ``start`` to each recorded start-up phase."""
        return {sid: pool.init_phases() for sid, pool in self.pools.items()}

    def statistics(self) -> tuple[StageStatistics, ...]:
        return tuple(p.statistics() for p in self.pools.values())

    def __repr__(self) -> str:
        return " ".join(
            f"{p.stage_id}:{p.live_replicas}/{len(p.replicas)}" for p in self.pools.values()
        )
