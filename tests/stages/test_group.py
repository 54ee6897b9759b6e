"""StageGroup: the stage pools of one engine, started and stopped together."""

from __future__ import annotations

import trio

import omni_trio
from omni_trio.testing import scripted_pipeline


async def session(cfg: dict) -> None:
    async with omni_trio.open_engine(cfg) as engine:
        await engine.generate("x").collect()


async def test_a_session_cancelled_at_each_scheduling_step_ends_cancelled(autojump_clock):
    # The cancellation lands after k scheduling steps of the whole run: while the pools
    # start, in the window where the last pool reported ready and the group has not yet
    # shielded them, while the request runs, and while everything stops. Whatever k, the
    # caller gets its cancellation back: never a StageStartError, never anything else.
    cfg = scripted_pipeline(2, outputs=2)
    outcomes: dict[int, str] = {}
    k = 0
    while True:
        with trio.CancelScope() as scope:

            async def cancel_after(steps: int) -> None:
                for _ in range(steps):
                    await trio.lowlevel.checkpoint()
                scope.cancel()

            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cancel_after, k)
                    await session(cfg)
            except BaseException as exc:  # anything but the cancellation is the failure
                outcomes[k] = repr(exc)
                raise
        if not scope.cancelled_caught:
            break  # the session finished before the cancellation: every step was probed
        outcomes[k] = "cancelled"
        k += 1
    assert k >= 15  # the start, the request and the stop: 21 steps today
    assert set(outcomes.values()) == {"cancelled"}
