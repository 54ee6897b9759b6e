"""The start-up display: one line per stage until it is ready, one per model build."""

from __future__ import annotations

import io

import pytest
import trio
from rich.console import Console

from omni_trio.cli.progress import StartupDisplay, open_engine_with_progress, phase_label
from omni_trio.engine.engine import open_engine
from omni_trio.errors import StageStartError
from omni_trio.models.progress import report_step, reporting_to

PIPELINE = {
    "name": "slow-start",
    "stages": [
        {"id": "a", "backend": "scripted", "options": {"start_delay_s": 3.0}},
        {"id": "b", "backend": "scripted", "inputs": ["a"], "final_output": True},
    ],
}


def test_phase_label() -> None:
    assert phase_label({}) == "waiting to start"
    assert phase_label({"start": 0.0, "thread_started": 0.1}) == "importing vllm"
    assert phase_label({"start": 0.0, "model_ready": 9.0, "vllm_imported": 2.0}) == (
        "starting the engine"
    )
    assert phase_label({"start": 0.0, "custom": 1.0}) == "past custom"


async def test_display_ends_with_a_line_per_stage_and_hands_out_a_started_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stream = io.StringIO()
    engine = open_engine(PIPELINE)
    async with open_engine_with_progress(engine, stream) as started:
        assert started is engine
        assert [s.live_replicas for s in engine.statistics().stages] == [1, 1]
        lines = stream.getvalue().splitlines()
    # not a terminal: the final state is printed once, when the start-up ends
    assert [line.strip() for line in lines] == [
        "✓ a (scripted) ready in 3.0s",
        "✓ b (scripted) ready in 0.0s",
    ]
    assert engine.closed


async def test_cancelled_start_ends_the_display_and_the_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stream = io.StringIO()
    engine = open_engine(PIPELINE)
    with trio.move_on_after(1.0) as scope:
        async with open_engine_with_progress(engine, stream):
            raise AssertionError("the start-up takes 3 s: never reached")
    assert scope.cancelled_caught and engine.closed
    shown = stream.getvalue()
    assert "a (scripted): " in shown and "ready" not in shown  # cut while starting


async def test_a_failed_start_raises_its_own_error_not_a_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stream = io.StringIO()
    failing = {"stages": [{"id": "a", "options": {"fail_start": True}, "final_output": True}]}
    engine = open_engine(failing)
    with pytest.raises(StageStartError, match="'a'") as info:
        async with open_engine_with_progress(engine, stream):
            raise AssertionError("the stage fails to start: never reached")
    assert info.value.__cause__ is not None  # what the stage raised is kept
    assert engine.closed


async def test_the_body_error_reaches_the_caller_as_raised(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = open_engine(PIPELINE)
    with pytest.raises(KeyError, match="from the body"):
        async with open_engine_with_progress(engine, io.StringIO()):
            raise KeyError("from the body")
    assert engine.closed


async def test_build_steps_reach_the_display_from_worker_threads() -> None:
    display = StartupDisplay(Console(file=io.StringIO()))
    with reporting_to(display):
        await trio.to_thread.run_sync(report_step, "tiny model 'x'", 1, 3, "training")
        (task,) = display.progress.tasks
        assert (task.description, task.completed, task.total) == (
            "tiny model 'x': training",
            0,
            3,
        )
        await trio.to_thread.run_sync(report_step, "tiny model 'x'", 3, 3, "done")
    assert task.description == "tiny model 'x' built" and task.finished
