"""omni_trio.testing.exact_clock: the loop blocks until a millisecond before the next deadline,
then polls, so a sleep ends at its deadline (the timeout rule, and what the loop asks of it
in a real trio run)."""

from __future__ import annotations

import trio

from omni_trio.testing import ExactStepClock


def test_the_loop_blocks_until_a_millisecond_before_the_deadline_then_polls():
    clock = ExactStepClock(now=lambda: 10.0)
    assert clock.current_time() == 10.0
    assert abs(clock.deadline_to_sleep_time(10.005) - 0.004) < 1e-9
    assert clock.deadline_to_sleep_time(10.0005) == 0.0  # the last millisecond: poll
    assert clock.deadline_to_sleep_time(10.001) == 0.0
    assert clock.deadline_to_sleep_time(9.0) == 0.0  # due already
    assert clock.deadline_to_sleep_time(float("inf")) == float("inf")  # nothing to wait for
    assert repr(clock) == "<ExactStepClock now=10.0>"


class RecordingClock(ExactStepClock):
    """Notes every timeout the loop asked for, and the deadline's distance then."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[float, float]] = []

    def deadline_to_sleep_time(self, deadline: float) -> float:
        remaining = deadline - self.current_time()
        timeout = super().deadline_to_sleep_time(deadline)
        self.asked.append((remaining, timeout))
        return timeout


def test_under_it_the_loop_never_blocks_into_a_sleeps_last_millisecond():
    clock = RecordingClock()

    async def sleeper() -> tuple[float, float]:
        deadline = trio.current_time() + 0.003
        await trio.sleep_until(deadline)
        return deadline, trio.current_time()

    deadline, woke = trio.run(sleeper, clock=clock)
    assert woke >= deadline
    asked = [(r, t) for r, t in clock.asked if r != float("inf")]
    timeouts = [timeout for _remaining, timeout in asked]
    # the loop never blocked into the deadline's last millisecond (it polls there, unless
    # the kernel woke it late, past the deadline)
    assert all(timeout <= max(0.0, remaining - 0.001) for remaining, timeout in asked)
    assert 0 < len(timeouts) and max(timeouts) <= 0.002
