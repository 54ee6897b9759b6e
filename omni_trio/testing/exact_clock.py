"""A trio clock whose sleeps end at their deadline: :class:`ExactStepClock`, for benchmarks.

With trio's default clock a ``trio.sleep(d)`` ends on the first whole millisecond after
the deadline *and* after whatever work the loop did meanwhile: the loop computes its
timeout once its work is done, and the kernel's timeout is whole milliseconds, rounded up
(measured on a 2-core machine: a 2 ms sleep with 0 / 100 / 500 us of other work after it
takes 2.14 / 2.31 / 2.74 ms). So a fake engine whose step is a ``trio.sleep`` on the loop
it shares with the code under measurement (:class:`~omni_trio.testing.fake_engine.FakeEngine`)
takes longer steps the more that code works, even when the work is far shorter than a
step. Under :class:`ExactStepClock` a step takes its ``step_s`` whatever the loop does
meanwhile, as a model's step on its own device would. It is real time, not a fake: use it
for benchmarks that measure wall time (``trio.run(main, clock=ExactStepClock())``); tests
use ``trio.testing.MockClock``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

__all__ = ["ExactStepClock"]


class ExactStepClock(trio.abc.Clock):
    """trio's default clock (``time.perf_counter``), except that the loop blocks until 1 ms
    before the next deadline and then polls until it is due: a sleeping task wakes at its
    deadline, not on the next whole millisecond after the loop's work. The polling costs up
    to 1 ms of CPU per wake-up, so under it only wall time means anything, not CPU time.
    ``now`` is the time source (a test gives its own)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        return self._now()

    def deadline_to_sleep_time(self, deadline: float) -> float:
        """Seconds the loop may block for ``deadline``: all but its last millisecond, then
        none (the loop polls). Pure but for the time source."""
        return max(0.0, deadline - self._now() - 0.001)

    def __repr__(self) -> str:
        return f"<ExactStepClock now={self._now()!r}>"
