"""Cancel a consumer at every one of its checkpoints: :func:`cancel_at_every_checkpoint`.

A consumer of an engine (your request handler, your pipeline client) passes through a
number of checkpoints while it runs a request: entering the stream, each ``receive``,
leaving the stream, an ``abort``. A cancellation (a client disconnect, a deadline, a sibling
task failing) can land at any of them. This harness runs your scenario once to count them,
then once per checkpoint ``k`` with a cancellation injected exactly at the ``k``-th, and
checks after each run, the moment the cancelled scope has exited, that nothing of the request
is left in flight in any layer of the engine, plus any invariant of your own.

Use it under ``trio.testing.MockClock(autojump_threshold=0)`` (pytest-trio's
``autojump_clock`` fixture) with scripted stages: every run is then deterministic. Checkpoints
are counted on the task that runs the scenario and on every task it spawns (an instrument
counts their scheduler steps); the engine's own tasks are not counted.

Example::

    from omni_trio.testing import cancel_at_every_checkpoint, scripted_pipeline

    async def test_my_handler_cancels_cleanly(autojump_clock):
        async with omni_trio.open_engine(scripted_pipeline(2, outputs=3)) as engine:
            async def scenario(engine):
                async with engine.generate("hi") as stream:
                    async for out in stream:
                        ...

            report = await cancel_at_every_checkpoint(engine, scenario)
            report.raise_if_failed()
            assert report.checkpoints > 5
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from ..engine.engine import Engine
from ._checks import in_flight_problems, wait_until_idle

__all__ = ["CancellationFailure", "CancellationReport", "cancel_at_every_checkpoint"]

Scenario = Callable[[Engine], Awaitable[object]]
Invariant = Callable[[Engine], None]


@dataclass(frozen=True, slots=True)
class CancellationFailure:
    """Run ``k`` (cancelled at the ``k``-th checkpoint) left ``problem`` behind."""

    k: int
    problem: str


@dataclass(frozen=True, slots=True)
class CancellationReport:
    """What :func:`cancel_at_every_checkpoint` found. ``checkpoints`` were counted on the
    uncancelled run; ``runs`` cancelled runs were made (``checkpoints + 1``: one cancelled
    before it starts); ``failures`` lists each bad run."""

    checkpoints: int
    runs: int
    failures: tuple[CancellationFailure, ...]

    @property
    def ok(self) -> bool:
        return not self.failures

    def raise_if_failed(self) -> None:
        """Raise AssertionError listing every failing ``k`` and what it left behind."""
        if self.failures:
            lines = "\n".join(f"  k={f.k}: {f.problem}" for f in self.failures)
            raise AssertionError(
                f"{len(self.failures)} of {self.runs} cancelled runs broke an invariant:\n{lines}"
            )


class _CheckpointCounter(trio.abc.Instrument):
    """Counts the scheduler steps of one task tree; cancels a scope at the k-th."""

    def __init__(self, cancel_at: int | None) -> None:
        self.tasks: set[trio.lowlevel.Task] = set()
        self.count = 0
        self.cancel_at = cancel_at
        self.scope: trio.CancelScope | None = None

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        parent = task.parent_nursery.parent_task if task.parent_nursery is not None else None
        if parent in self.tasks:
            self.tasks.add(task)

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task not in self.tasks:
            return
        self.count += 1
        if self.count == self.cancel_at and self.scope is not None:
            # the task just yielded at its k-th checkpoint: the cancellation is delivered
            # there, or at its next cancel point if that checkpoint was shielded
            self.scope.cancel()


def _seed_scheduler(seed: int) -> None:
    # trio picks the order of each scheduling batch at random; seeding its generator makes
    # each run reproducible (a testing aid only: without it the harness still works)
    rng = getattr(getattr(trio, "_core", None), "_run", None)
    generator = getattr(rng, "_r", None)
    if isinstance(generator, random.Random):
        generator.seed(seed)


async def _run_once(
    engine: Engine, scenario: Scenario, cancel_at: int | None, seed: int, run_timeout: float
) -> tuple[int, BaseException | None]:
    counter = _CheckpointCounter(cancel_at)
    error: BaseException | None = None
    _seed_scheduler(seed)
    trio.lowlevel.add_instrument(counter)
    try:
        with trio.move_on_after(run_timeout) as limit:
            with trio.CancelScope() as scope:
                counter.scope = scope
                if cancel_at == 0:
                    scope.cancel()  # cancelled before it starts: before admission, say
                counter.tasks.add(trio.lowlevel.current_task())
                try:
                    await scenario(engine)
                except trio.Cancelled:
                    raise
                except Exception as exc:
                    error = exc
    finally:
        trio.lowlevel.remove_instrument(counter)
    if limit.cancelled_caught:
        where = "the uncancelled run" if cancel_at is None else f"run {cancel_at}"
        error = trio.TooSlowError(
            f"{where} of the scenario did not end within run_timeout={run_timeout}s "
            f"(it waits for something that never comes)"
        )
    return counter.count, error


async def cancel_at_every_checkpoint(
    engine: Engine,
    scenario: Scenario,
    *,
    invariant: Invariant | None = None,
    max_checkpoints: int = 10_000,
    settle_timeout: float = 60.0,
    run_timeout: float = 600.0,
) -> CancellationReport:
    """Run ``await scenario(engine)`` once to count its checkpoints ``n``, then ``n + 1`` more
    times, cancelling run ``k`` exactly at its ``k``-th checkpoint (run 0: already cancelled
    when the scenario starts); after each run, the moment
    the cancelled scope has exited, check that nothing is in flight in the engine (the
    orchestrator, every pool and replica) and call ``invariant(engine)`` (it raises
    AssertionError to report a broken invariant of yours).

    Checkpoints. Returns a :class:`CancellationReport`; call ``report.raise_if_failed()``.
    The uncancelled run must succeed (its exception propagates). A cancelled run that raised
    something other than ``Cancelled`` is reported as a failure, as is a run that left work in
    flight (the harness then waits, up to ``settle_timeout`` seconds, for the engine to be idle
    before the next run). A run still going after ``run_timeout`` seconds (trio's clock) is
    cancelled and reported: one that waits for what never comes does not reach its ``k``-th
    checkpoint, so it would never be cancelled (under an autojump clock it is reported at
    once). Raises ValueError if the scenario passes more than ``max_checkpoints``;
    ``trio.TooSlowError`` if the uncancelled run overran ``run_timeout``.
    """
    count, error = await _run_once(engine, scenario, None, 0, run_timeout)
    if error is not None:
        raise error
    if invariant is not None:
        invariant(engine)
    if count > max_checkpoints:
        raise ValueError(f"the scenario passed {count} checkpoints, over max_checkpoints")
    failures: list[CancellationFailure] = []
    for k in range(count + 1):
        _, error = await _run_once(engine, scenario, k, k, run_timeout)
        problems = in_flight_problems(engine)
        if error is not None:
            problems.insert(0, f"the scenario raised {type(error).__name__}: {error}")
        if invariant is not None:
            try:
                invariant(engine)
            except AssertionError as exc:
                problems.append(f"invariant: {exc}")
        if problems:
            failures.append(CancellationFailure(k, "; ".join(problems)))
            with trio.move_on_after(settle_timeout):
                await wait_until_idle(engine)
    return CancellationReport(checkpoints=count, runs=count + 1, failures=tuple(failures))
