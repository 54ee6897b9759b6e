"""Where model builders report their steps: a context-local sink, or plain lines on stderr.

A builder (:func:`~omni_trio.models.ensure_tiny_model`, the tiny vocoder) calls
:func:`report_step` for each of its steps. If the calling context has a sink
(:func:`reporting_to`, set by the command line's progress display), the step goes there;
otherwise, unless the builder was asked to be quiet, it is one line on stderr. The sink is a
:class:`contextvars.ContextVar`, so it follows the work into trio tasks and into
``trio.to_thread`` threads (and into threads started with ``copy_context().run``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

__all__ = ["BuildSink", "report_step", "reporting_to"]


class BuildSink(Protocol):
    """Receives build steps. Called from worker threads: implementations must be
    thread-safe and must not block."""

    def step(self, what: str, index: int, total: int, doing: str) -> None:
        """``what`` (e.g. ``tiny model 'thinker'``) is at step ``index`` of ``total``
        (1-based), now ``doing`` it; ``index == total`` with ``doing == "done"`` ends it."""


_SINK: ContextVar[BuildSink | None] = ContextVar("omni_trio_build_sink", default=None)


@contextmanager
def reporting_to(sink: BuildSink) -> Iterator[None]:
    """Send the build steps of this context (and of what it starts) to ``sink``."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def report_step(what: str, index: int, total: int, doing: str, *, echo: bool = True) -> None:
    """Report a build step to the context's sink, else (if ``echo``) as a line on stderr.
    Does not block (beyond writing the line)."""
    sink = _SINK.get()
    if sink is not None:
        sink.step(what, index, total, doing)
    elif echo and doing != "done":
        print(f"omni-trio: {what} [{index}/{total}] {doing}", file=sys.stderr, flush=True)
