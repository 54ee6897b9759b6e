"""Deterministic tests of your own application, with ``omni_trio.testing`` and pytest-trio.

Run: ``pytest examples/test_my_app.py`` (pytest-trio: ``trio_mode = true`` in your pytest
config, or the ``pytest.mark.trio`` mark as here).

The app under test is ``Sessions.ask``: it tracks which user has a question in flight and
returns the answer's text. Scripted stages stand in for the models, and pytest-trio's
``autojump_clock`` fixture (a ``trio.testing.MockClock(autojump_threshold=0)``) makes every
latency, timeout and deadline below instant and deterministic: same result on every run.
``cancel_at_every_checkpoint`` then cancels the app at each point where a cancellation can
land, and reports any run that left state behind, in the engine or in the app.
"""

from __future__ import annotations

import pytest
import trio

import omni_trio
from omni_trio.testing import (
    CancellationReport,
    assert_nothing_in_flight,
    cancel_at_every_checkpoint,
    scripted_pipeline,
)

pytestmark = pytest.mark.trio


class Sessions:
    """The application code under test."""

    def __init__(self) -> None:
        self.active: dict[str, str] = {}  # user -> the question in flight

    async def ask(self, engine: omni_trio.Engine, user: str, prompt: str) -> str:
        """The talker's answer to ``prompt``. Cancellation-safe: ``finally`` forgets the
        question however the request ends."""
        self.active[user] = prompt
        try:
            async with engine.generate(prompt) as stream:
                return "".join([out.text async for out in stream])
        finally:
            del self.active[user]


class LeakySessions(Sessions):
    """The same app with a cancellation bug: without ``finally``, a cancelled ``ask`` never
    forgets its question."""

    async def ask(self, engine: omni_trio.Engine, user: str, prompt: str) -> str:
        self.active[user] = prompt
        async with engine.generate(prompt) as stream:
            answer = "".join([out.text async for out in stream])
        del self.active[user]
        return answer


def pipeline() -> omni_trio.PipelineConfig:
    # two scripted stages, 4 outputs each, 1 s of (trio-clock) latency per output
    return scripted_pipeline(["thinker", "talker"], outputs=4, latency_s=1.0)


async def test_ask_answers(autojump_clock: trio.testing.MockClock) -> None:
    async with omni_trio.open_engine(pipeline()) as engine:
        answer = await Sessions().ask(engine, "ann", "Hi!")
    # each scripted stage adds 1 to the token it got: "H" (72) -> 74 after two stages
    assert answer == "talker:74 talker:107 talker:35 talker:74 "


async def test_a_deadline_leaves_nothing_behind(autojump_clock: trio.testing.MockClock) -> None:
    sessions = Sessions()
    async with omni_trio.open_engine(pipeline()) as engine:
        with trio.move_on_after(5.5) as scope:  # mid-way through the talker's outputs
            await sessions.ask(engine, "ann", "Hi!")
        assert scope.cancelled_caught
        assert trio.current_time() == pytest.approx(5.5)  # virtual time: no real waiting
        assert sessions.active == {}  # the app forgot the question
        assert_nothing_in_flight(engine)  # and the engine holds no state of the request
        # the engine is fine afterwards
        assert await sessions.ask(engine, "bob", "Hi!") == (
            "talker:74 talker:107 talker:35 talker:74 "
        )


async def check_every_cancellation(app: type[Sessions]) -> CancellationReport:
    """Cancel ``app.ask`` at each of its checkpoints in turn; after each run, the harness
    checks the engine holds nothing of the request, and ``no_question_left`` our own state."""
    sessions = app()

    async def scenario(engine: omni_trio.Engine) -> None:
        nonlocal sessions
        sessions = app()  # a fresh app per run: one run's leak does not fail the next
        await sessions.ask(engine, "ann", "Hi!")

    def no_question_left(engine: omni_trio.Engine) -> None:
        assert sessions.active == {}, f"questions left: {sessions.active}"

    async with omni_trio.open_engine(pipeline()) as engine:
        report = await cancel_at_every_checkpoint(engine, scenario, invariant=no_question_left)
    return report


async def test_ask_is_cancellation_safe(autojump_clock: trio.testing.MockClock) -> None:
    report = await check_every_cancellation(Sessions)
    report.raise_if_failed()  # an AssertionError listing every failing checkpoint
    assert report.checkpoints > 5  # entering the stream, each receive, leaving it...


async def test_the_harness_finds_the_leak(autojump_clock: trio.testing.MockClock) -> None:
    report = await check_every_cancellation(LeakySessions)
    assert not report.ok
    assert all("questions left: {'ann': 'Hi!'}" in f.problem for f in report.failures)
    with pytest.raises(AssertionError, match=r"k=1: .*questions left"):
        report.raise_if_failed()
