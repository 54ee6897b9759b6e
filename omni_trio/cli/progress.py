"""Live progress for the command line: model builds and engine start-up, drawn with rich.

:func:`open_engine_with_progress` enters an engine (starts its stages) under a live display:
one line per stage with what it is doing and the seconds so far, ending as ``<stage>
(<backend>) ready in 48.2s``, and one line with a bar per model build (the tiny models and
the tiny vocoder report their steps through :mod:`omni_trio.models.progress`). The display
is redrawn by a trio task once a second (it reads the replicas' start-up phases, which the
backends record as they pass them); it ends when every stage is ready, so the lines above
stay as a record. On a terminal the lines update in place; elsewhere (a pipe, a log) they
are printed once, when the start-up ends.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, TextIO

import trio
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TaskID
from rich.text import Text

from ..models.progress import reporting_to

if TYPE_CHECKING:
    from ..engine.engine import Engine

__all__ = ["StartupDisplay", "open_engine_with_progress", "phase_label"]

#: what a replica is doing once it has passed a phase (see StageBackend.mark_phase)
_DOING = {
    "start": "starting",
    "thread_started": "importing vllm",
    "vllm_imported": "preparing the model",
    "model_ready": "starting the engine",
    "engine_ready": "ready",
    "model_loaded": "ready",
    "ready": "ready",
}


def phase_label(phases: dict[str, float]) -> str:
    """What a replica is doing, from its phases (name -> seconds since its start). Pure."""
    if not phases:
        return "waiting to start"
    latest = max(phases.items(), key=lambda kv: kv[1])[0]
    return _DOING.get(latest, f"past {latest}")


class _Bar(BarColumn):
    """A bar while the line runs; nothing once it is finished (its text says it all)."""

    def render(self, task: Task) -> Any:
        return Text("") if task.finished else super().render(task)


class _Seconds(ProgressColumn):
    """Seconds since the line appeared, while it is running (finished lines say it all)."""

    def render(self, task: Task) -> Text:
        if task.finished:
            return Text("")
        return Text(f"{task.elapsed or 0.0:.0f}s", style="progress.elapsed")


class StartupDisplay:
    """The live lines of a start-up: stages (updated by :meth:`tick`) and model builds (a
    :class:`~omni_trio.models.progress.BuildSink`: :meth:`step` may be called from any
    thread)."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(
            SpinnerColumn(finished_text="[green]✓"),
            "{task.description}",
            _Bar(bar_width=20),
            _Seconds(),
            console=console,
            auto_refresh=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._stages: dict[str, TaskID] = {}
        self._builds: dict[str, TaskID] = {}
        self._lock = threading.Lock()

    def add_stage(self, stage_id: str, backend: str) -> None:
        self._stages[stage_id] = self.progress.add_task(f"{stage_id} ({backend}): starting")

    def tick(self, engine: Engine) -> None:
        """Update each stage's line from the engine's start-up records; redraw."""
        phases = engine.init_phases()
        for st in engine.config.stages:
            task = self._stages.get(st.id)
            if task is None or self.progress.tasks[task].finished:
                continue
            ready = engine.init_timeline.get(st.id)
            if ready is not None:
                self.progress.update(
                    task,
                    description=f"{st.id} ({st.backend}) ready in {ready['seconds']:.1f}s",
                    total=1,
                    completed=1,
                )
                continue
            labels = [phase_label(p) for p in phases.get(st.id, [])]
            doing = labels[0] if len(set(labels)) == 1 else ", ".join(labels)
            self.progress.update(task, description=f"{st.id} ({st.backend}): {doing}")
        self.progress.refresh()

    def step(self, what: str, index: int, total: int, doing: str) -> None:
        """A model build's step (a BuildSink); thread-safe, does not block."""
        with self._lock:
            task = self._builds.get(what)
            if task is None:
                task = self._builds[what] = self.progress.add_task(what, total=total)
        if doing == "done":
            self.progress.update(task, description=f"{what} built", completed=total)
        else:
            self.progress.update(
                task, description=f"{what}: {doing}", completed=index - 1, total=total
            )


@asynccontextmanager
async def open_engine_with_progress(engine: Engine, stream: TextIO) -> AsyncIterator[Engine]:
    """Enter ``engine`` (an unentered :class:`~omni_trio.Engine`) while a live display on
    ``stream`` shows its start-up; yield it once every stage is ready; leave it on exit.

    Checkpoints. Cancellation during the start-up stops what started (as the engine's own
    ``async with`` does) and ends the display. Raises what entering the engine raises, and
    what the body raises, as raised (not in an exception group).
    """
    display = StartupDisplay(Console(file=stream, highlight=False))
    for st in engine.config.stages:
        display.add_stage(st.id, st.backend)
    # The engine's own nursery opens inside this one (scopes nest), and the redraw task
    # is done before the engine is handed out.
    try:
        async with trio.open_nursery() as nursery:
            redraw = trio.CancelScope()
            nursery.start_soon(_redraw, display, engine, redraw)
            async with AsyncExitStack() as stack:
                try:
                    with display.progress, reporting_to(display):
                        await stack.enter_async_context(engine)
                        display.tick(engine)  # the final state of every line
                finally:
                    redraw.cancel()
                yield engine
    except BaseExceptionGroup as group:
        # the redraw task raises nothing of its own: a group of one holds what entering the
        # engine or the body raised, which the caller gets as it was raised
        if len(group.exceptions) != 1:
            raise
        error = group.exceptions[0]
        raise error from error.__cause__  # `from None` would erase the error's own cause


async def _redraw(display: StartupDisplay, engine: Engine, scope: trio.CancelScope) -> None:
    # UI only: redrawn once a second; nothing waits on what it reads
    with scope:
        while True:
            display.tick(engine)
            await trio.sleep(1.0)
