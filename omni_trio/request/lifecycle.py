"""A request's life as a small pure state machine: ``RequestLifecycle``.

admitted -> running -> finished | aborted | failed

The orchestrator owns one per request and feeds it what happens (a stage's finished output,
an error, an abort); the lifecycle decides what that means: which output stages still need an
abort terminal, what the request's final status is. No I/O, no checkpoints, no trio: every
rule here is unit-tested on its own. It only records: that a stage emits nothing after its
finished output is the backend contract, checked where a replica runs the request
(:mod:`omni_trio.stages._running`, which names the replica).

The rules:

- exactly one terminal per output stage: a stage's own finished output is its terminal;
- an error wins over an abort: a stage error raised while the request was being aborted or the
  engine was closing still fails the request (the consumer gets the error, not an abort);
- an abort that lands after every output stage finished changes nothing: the request finished;
- otherwise an ended request is aborted, and every output stage without a terminal gets one
  ``finish_reason="abort"`` terminal.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

__all__ = ["RequestLifecycle", "RequestStatus"]

RequestStatus = Literal["admitted", "running", "finished", "aborted", "failed"]
_TERMINAL: frozenset[str] = frozenset({"finished", "aborted", "failed"})
#: finished stages kept as a tuple up to this many (no set per request in the usual
#: pipelines of a few stages), then as a set (a request through thousands of stages stays
#: linear)
_FEW = 8


class RequestLifecycle:
    """The state of one request. Pure: methods change only this object, never block."""

    __slots__ = ("_errors", "_finished", "_outputs", "_status", "abort_requested", "request_id")

    def __init__(self, request_id: str, output_stages: Iterable[str]) -> None:
        self.request_id = request_id
        self._outputs = tuple(output_stages)
        self._finished: tuple[str, ...] | set[str] = ()  # see _FEW
        self._errors: tuple[BaseException, ...] = ()  # rare: no list per request
        self._status: RequestStatus = "admitted"
        #: an abort (or the engine's close) was requested; the request may still finish
        self.abort_requested = False

    # -- transitions -------------------------------------------------------------------------
    def start(self) -> None:
        """admitted -> running."""
        if self._status != "admitted":
            raise RuntimeError(f"request {self.request_id!r} cannot start: it is {self._status}")
        self._status = "running"

    def finish_stage(self, stage_id: str) -> None:
        """A stage delivered its finished output (once per stage: the replica running it
        enforces that)."""
        done = self._finished
        if isinstance(done, set):
            done.add(stage_id)
        elif len(done) < _FEW:
            self._finished = (*done, stage_id)
        else:
            self._finished = {*done, stage_id}

    def request_abort(self) -> bool:
        """Note an abort request. False if the request had already ended (nothing to do)."""
        if self._status in _TERMINAL:
            return False
        self.abort_requested = True
        return True

    def fail(self, error: BaseException) -> None:
        """Record a request-scoped error. Every error is kept, in the order they came."""
        self._errors = (*self._errors, error)

    def end(self) -> RequestStatus:
        """The request task ended: decide and return its final status (once)."""
        if self._status in _TERMINAL:
            raise RuntimeError(f"request {self.request_id!r} already ended ({self._status})")
        if self._errors:
            self._status = "failed"
        elif all(s in self._finished for s in self._outputs):
            self._status = "finished"
        else:
            self._status = "aborted"
        return self._status

    # -- queries -----------------------------------------------------------------------------
    @property
    def status(self) -> RequestStatus:
        return self._status

    @property
    def failed(self) -> bool:
        """True as soon as an error is recorded (the request will end ``failed``)."""
        return bool(self._errors)

    @property
    def errors(self) -> tuple[BaseException, ...]:
        return self._errors

    def stage_finished(self, stage_id: str) -> bool:
        return stage_id in self._finished

    def abort_terminals(self) -> tuple[str, ...]:
        """The output stages that get an abort terminal: those without their own terminal,
        and only for an aborted request (a failed request raises its error instead)."""
        if self._status != "aborted":
            return ()
        return tuple(s for s in self._outputs if s not in self._finished)

    def __repr__(self) -> str:
        return (
            f"<RequestLifecycle {self.request_id!r} {self._status} "
            f"finished={sorted(self._finished)} errors={len(self._errors)}"
            f"{' abort-requested' if self.abort_requested else ''}>"
        )
