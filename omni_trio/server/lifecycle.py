"""Where a server is in its life, shared by the HTTP app and the loop that serves it.

A server listens before its engine's stages have started, so that a taken port fails at
once and a load balancer can see it coming up; then it serves; on shutdown it drains (no
new work, in-flight requests get a grace period), then cuts what is left (each streamed
response ends with a ``server_shutdown`` error event), then stops::

    STARTING -> SERVING -> DRAINING -> CUT -> STOPPED     (phases only move forward)

:class:`ServerLifecycle` holds the phase and wakes whoever waits for the cut or the stop;
:func:`refusal` decides, purely, which requests a phase turns away and how.
"""

from __future__ import annotations

import enum

import trio

from .asgi import Headers
from .bodies import error_body

__all__ = ["RETRY_AFTER_S", "WORK_PATHS", "ServerLifecycle", "ServerPhase", "refusal"]

# the endpoints that hand work to the engine; the others (health, models, metrics) answer
# in every phase
WORK_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/audio/speech"})
# what a client told to come back later waits; stages start in seconds to minutes
RETRY_AFTER_S = 5


class ServerPhase(enum.Enum):
    STARTING = "starting"  # listening; the engine's stages are starting
    SERVING = "serving"
    DRAINING = "draining"  # shutdown asked: no new work, in-flight requests may finish
    CUT = "cut"  # the grace period is over: in-flight responses end now
    STOPPED = "stopped"  # every connection is closed


_ORDER = {phase: i for i, phase in enumerate(ServerPhase)}


class ServerLifecycle:
    """The phase of one server. Created ``starting=True`` by a server that listens before
    its engine is ready, else already serving. The ``mark_*`` methods are synchronous and
    idempotent; a phase never goes back (marking an earlier phase does nothing)."""

    def __init__(self, *, starting: bool = False) -> None:
        self._phase = ServerPhase.STARTING if starting else ServerPhase.SERVING
        self._cut = trio.Event()
        self._stopped = trio.Event()

    @property
    def phase(self) -> ServerPhase:
        return self._phase

    def _advance(self, phase: ServerPhase) -> None:
        if _ORDER[phase] > _ORDER[self._phase]:
            self._phase = phase
        if _ORDER[self._phase] >= _ORDER[ServerPhase.CUT]:
            self._cut.set()
        if self._phase is ServerPhase.STOPPED:
            self._stopped.set()

    def mark_serving(self) -> None:
        """The engine is ready: requests are admitted."""
        self._advance(ServerPhase.SERVING)

    def mark_draining(self) -> None:
        """Shutdown began: refuse new work, let in-flight requests finish."""
        self._advance(ServerPhase.DRAINING)

    def mark_cut(self) -> None:
        """The grace period is over: wakes :meth:`wait_cut` (in-flight responses end)."""
        self._advance(ServerPhase.CUT)

    def mark_stopped(self) -> None:
        """Every connection is closed: wakes :meth:`wait_stopped`."""
        self._advance(ServerPhase.STOPPED)

    async def wait_cut(self) -> None:
        """Return once the grace period is over (at once if it is). Checkpoints."""
        await self._cut.wait()

    async def wait_stopped(self) -> None:
        """Return once the server has stopped. Checkpoints."""
        await self._stopped.wait()

    def __repr__(self) -> str:
        return f"<ServerLifecycle {self._phase.value}>"


def refusal(phase: ServerPhase, path: str) -> tuple[int, dict[str, object], Headers] | None:
    """``(status, OpenAI error body, headers)`` if ``phase`` turns a request for ``path``
    away, else None. Pure.

    While starting, work endpoints answer 503 with ``Retry-After``; from the drain on, 503
    ``server_shutdown`` (a new request would be cut anyway; another replica can take it)."""
    if path not in WORK_PATHS or phase is ServerPhase.SERVING:
        return None
    if phase is ServerPhase.STARTING:
        body = error_body(
            "the server is starting: the pipeline's stages are not ready yet; "
            f"retry in {RETRY_AFTER_S} s (GET /health says when it is ready)",
            type_="service_unavailable",
            code="starting",
        )
        return 503, body, [(b"retry-after", str(RETRY_AFTER_S).encode())]
    body = error_body(
        "the server is shutting down and takes no new requests",
        type_="service_unavailable",
        code="server_shutdown",
    )
    return 503, body, []
