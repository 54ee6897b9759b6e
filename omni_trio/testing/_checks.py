"""Checks that nothing of any request is left behind, and waiting until that is so, or until
every replica is up again."""

from __future__ import annotations

import trio

from ..engine.engine import Engine

__all__ = [
    "assert_nothing_in_flight",
    "in_flight_problems",
    "wait_until_idle",
    "wait_until_settled",
]


def in_flight_problems(engine: Engine) -> list[str]:
    """What is still in flight anywhere (orchestrator, pools, replicas), one line each;
    empty when nothing is. Synchronous."""
    stats = engine.statistics()
    problems = []
    if stats.requests_in_flight:
        problems.append(f"{stats.requests_in_flight} request(s) in flight in the orchestrator")
    if stats.requests_waiting:
        problems.append(f"{stats.requests_waiting} admission(s) waiting (max_requests_in_flight)")
    if stats.requests_in_graph:
        problems.append(
            f"{stats.requests_in_graph} graph ticket(s) held (max_requests_in_graph): a "
            "consumer that left or took its final output still counts"
        )
    for st in stats.stages:
        if st.requests_in_flight:
            problems.append(f"stage {st.stage_id!r}: {st.requests_in_flight} bound request(s)")
        for r in st.replicas:
            if r.requests_in_flight:
                problems.append(
                    f"stage {st.stage_id!r} replica {r.replica}: {r.requests_in_flight} running"
                )
    return problems


def assert_nothing_in_flight(engine: Engine) -> None:
    """Assert that no request state is left anywhere: orchestrator, pools, replicas."""
    problems = in_flight_problems(engine)
    if problems:
        raise AssertionError("requests left in flight: " + "; ".join(problems))


async def wait_until_idle(engine: Engine) -> None:
    """Wait until no request is in flight anywhere (event-driven: it waits on each remaining
    request's end, no polling). Always checkpoints; bound it with ``trio.fail_after``."""
    await engine.orchestrator.wait_idle()


async def wait_until_settled(engine: Engine) -> None:
    """Wait until no replica of any stage is starting or restarting: each is ready, being
    removed, or dead for good (after a crash with ``restart: on-failure``, until its
    replacement is up). Event-driven: it waits on each pool's replica changes, no polling.
    Always checkpoints; bound it with ``trio.fail_after``."""
    await trio.lowlevel.checkpoint()
    for pool in engine.pools.values():
        await pool.wait_settled()
