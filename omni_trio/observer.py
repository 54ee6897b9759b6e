"""Engine events for metrics and tracing: subclass :class:`EngineObserver`, override what you need.

Observers are called synchronously from the orchestrator's tasks (no checkpoint; keep them
cheap and non-blocking: they run on the engine's loop). An observer that raises is a bug in
the observer; the exception is logged and the observer is detached, the request unaffected.
Times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import logging
import time

__all__ = ["EngineObserver", "ObserverSet", "payload_nbytes"]

logger = logging.getLogger(__name__)


def payload_nbytes(token_ids: tuple[int, ...], text: str | None, data: object) -> int:
    """Approximate bytes moved between stages: 4 per token id, UTF-8 text, array nbytes."""
    n = 4 * len(token_ids) + (len(text.encode("utf-8")) if text else 0)
    if data is not None:
        n += int(getattr(data, "nbytes", 0) or (len(data) if isinstance(data, bytes) else 0))
    return n


class EngineObserver:
    """No-op base; every hook gets the request id and a ``time.perf_counter()`` timestamp."""

    def request_started(self, request_id: str, t: float) -> None: ...
    def request_finished(self, request_id: str, status: str, t: float) -> None: ...
    def stage_started(self, request_id: str, stage_id: str, t: float) -> None: ...
    def stage_output(self, request_id: str, stage_id: str, first: bool, t: float) -> None: ...
    def stage_finished(self, request_id: str, stage_id: str, status: str, t: float) -> None: ...
    def transfer(
        self, request_id: str, source: str, target: str, nbytes: int, t: float
    ) -> None: ...


class ObserverSet:
    """The observers of one engine; calls each, detaching any that raises."""

    def __init__(self) -> None:
        self._observers: list[EngineObserver] = []

    def add(self, observer: EngineObserver) -> None:
        self._observers.append(observer)

    def remove(self, observer: EngineObserver) -> None:
        self._observers.remove(observer)

    def __bool__(self) -> bool:
        return bool(self._observers)

    def emit(self, hook: str, *args: object) -> None:
        t = time.perf_counter()
        for obs in list(self._observers):
            try:
                getattr(obs, hook)(*args, t)
            except Exception:
                logger.exception("observer %r raised in %s; detaching it", obs, hook)
                self._observers.remove(obs)
