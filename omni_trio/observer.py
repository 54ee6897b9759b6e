"""Engine events for metrics and tracing: subclass :class:`EngineObserver`, override what you need.

Observers are called synchronously from the orchestrator's tasks (no checkpoint; keep them
cheap and non-blocking: they run on the engine's loop). An observer that raises is a bug in
the observer; the exception is logged and the observer is detached, the request unaffected.
Times are ``time.perf_counter()`` seconds (:attr:`ObserverSet.clock`: a test may put the trio
clock there, for exact times under ``MockClock``).

A request's events come in this order: ``request_info`` and ``request_started`` (when it is
admitted, in the task that admitted it: the caller's), then per stage ``stage_started``,
``stage_bound`` (a replica took it), ``stage_output``/``stage_delta`` per output,
``transfer``/``transfer_sent`` per chunk handed downstream, ``stage_finished``; any time
``abort_requested`` and ``stage_error``; last ``request_finished``. A stage's events may
interleave with another stage's (they run in their own tasks), and a stage that never got
to run (the request ended first) has no ``stage_started``.

Every hook has a no-op default, so an observer written against fewer hooks keeps working.
``detached`` comes once, last, when the observer is removed or detached for raising.
:meth:`EngineObserver.stage_trace_headers` is the one hook that answers: a tracer returns the
W3C headers of its stage span, which a vllm stage hands to vLLM.

Routing. While an observer with :attr:`EngineObserver.routes_stages` true (the default, what
every observer always got) is attached, every stage of a request runs with a routing task
and starts with the request, and each output's ``stage_output`` comes as the orchestrator
routes it. When every attached observer sets it false (the tracer, the timeline), requests
run as without observers: a stage that takes its input whole starts (``stage_started``,
its input's ``transfer``) once that input is complete, and the outputs of a stage that has no
routing task (an output stage feeding no other stage, a stage nobody streams) are reported
once it ended, before its ``stage_finished``: ``stage_output`` for the first one with the
time it came, then ``stage_delta`` for each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["EngineObserver", "ObserverSet", "RequestInfo", "Transfer", "payload_nbytes"]

logger = logging.getLogger(__name__)


def payload_nbytes(token_ids: tuple[int, ...], text: str | None, data: object) -> int:
    """Approximate bytes moved between stages: 4 per token id, UTF-8 text, array nbytes."""
    n = 4 * len(token_ids) + (len(text.encode("utf-8")) if text else 0)
    if data is not None:
        n += int(getattr(data, "nbytes", 0) or (len(data) if isinstance(data, bytes) else 0))
    return n


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What an observer learns of a request when it is admitted (``request_info``)."""

    #: the stages it runs on (its route), in pipeline order
    stages: tuple[str, ...]
    #: the stages whose outputs the caller gets
    output_stages: tuple[str, ...]
    #: the caller's tracing headers (``generate(trace_headers=)``, the HTTP ``traceparent``)
    trace_headers: Mapping[str, str] | None = None
    #: seconds it waited for admission (``max_requests_in_flight``, a pause); 0 if none
    admission_wait_s: float = 0.0
    #: token ids and approximate bytes of its first input (the prompt as given)
    input_tokens: int = 0
    input_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Transfer:
    """A chunk handed from one stage to the next (``transfer_sent``)."""

    source: str
    target: str
    #: approximate bytes (:func:`payload_nbytes`) and token ids it carried
    nbytes: int
    tokens: int
    #: from the chunk ready to the downstream stage's input taking it (backpressure)
    seconds: float


class EngineObserver:
    """No-op base; every hook gets the request id and a ``time.perf_counter()`` timestamp."""

    #: whether every stage must run with a routing task while this observer watches (see
    #: the module docstring); an observer that needs no event per output as it is routed
    #: sets it false and costs the requests almost nothing
    routes_stages: ClassVar[bool] = True

    def request_info(self, request_id: str, info: RequestInfo, t: float) -> None:
        """Right before ``request_started``: the request's route and what it came with."""

    def request_started(self, request_id: str, t: float) -> None: ...
    def request_finished(self, request_id: str, status: str, t: float) -> None: ...
    def stage_started(self, request_id: str, stage_id: str, t: float) -> None: ...
    def stage_output(self, request_id: str, stage_id: str, first: bool, t: float) -> None: ...
    def stage_finished(self, request_id: str, stage_id: str, status: str, t: float) -> None: ...
    def transfer(
        self, request_id: str, source: str, target: str, nbytes: int, t: float
    ) -> None: ...

    def stage_bound(
        self, request_id: str, stage_id: str, replica: int, waited_s: float, t: float
    ) -> None:
        """Stage ``stage_id`` bound the request to replica ``replica`` after waiting
        ``waited_s`` seconds for one (0: at once)."""

    def stage_delta(self, request_id: str, stage_id: str, output: object, t: float) -> None:
        """One output of the stage (a :class:`~omni_trio.outputs.StageOutput` delta), right
        after ``stage_output``. Do not keep it: it may hold a large array."""

    def transfer_sent(self, request_id: str, transfer: Transfer, t: float) -> None:
        """A chunk went from one stage to the next (:class:`Transfer`: which, its size, how
        long the downstream stage's input took to take it). A chunk the downstream stage no
        longer reads is not reported."""

    def stage_error(self, request_id: str, stage_id: str, error: BaseException, t: float) -> None:
        """Stage ``stage_id`` failed the request with ``error`` (the request ends failed)."""

    def abort_requested(self, request_id: str, t: float) -> None:
        """An abort of the request was requested (the caller, a disconnect, the engine's
        close); ``request_finished`` comes once every stage dropped it."""

    def stage_trace_headers(self, request_id: str, stage_id: str) -> Mapping[str, str] | None:
        """The tracing headers stage ``stage_id`` hands to its engine for this request
        (``None``: leave them as the caller gave them). Asked once per stage run, after
        ``stage_bound``."""
        return None

    def detached(self, t: float) -> None:
        """It gets no more events: it was removed, or detached because one of its hooks
        raised. Called once; end what it holds open (a tracer ends its open spans)."""


#: an observer's bound hook method
_Method = Callable[[*tuple[object, ...]], object]
#: per hook name, the observers' methods to call (only those that override the no-op)
_Hooks = dict[str, list[tuple[EngineObserver, _Method]]]


class ObserverSet:
    """The observers of one engine; calls each, detaching any that raises."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._observers: list[EngineObserver] = []
        self._hooks: _Hooks = {}
        #: whether an attached observer needs every stage routed (see the module docstring)
        self.routes = False
        #: what every timestamp and duration the observers get is read from
        self.clock = clock

    def add(self, observer: EngineObserver) -> None:
        self._observers.append(observer)
        self._changed()

    def remove(self, observer: EngineObserver) -> None:
        self._observers.remove(observer)
        self._changed()
        detached = getattr(observer, "detached", None)
        if detached is not None:  # an observer written before the hook has none
            try:
                detached(self.clock())
            except Exception:
                logger.exception("observer %r raised in detached", observer)

    def _changed(self) -> None:
        self._hooks.clear()
        self.routes = any(getattr(obs, "routes_stages", True) for obs in self._observers)

    def __bool__(self) -> bool:
        return bool(self._observers)

    def __len__(self) -> int:
        return len(self._observers)

    def _methods(self, hook: str) -> list[tuple[EngineObserver, _Method]]:
        # the observers that do something on ``hook``: a hook nobody overrides costs nothing
        methods = self._hooks.get(hook)
        if methods is None:
            base = getattr(EngineObserver, hook)
            methods = []
            for obs in self._observers:
                method = getattr(obs, hook, None)
                overridden = getattr(type(obs), hook, None) is not base
                if method is not None and (overridden or hook in getattr(obs, "__dict__", ())):
                    methods.append((obs, method))
            self._hooks[hook] = methods
        return methods

    def _detach(self, obs: EngineObserver, hook: str) -> None:
        logger.exception("observer %r raised in %s; detaching it", obs, hook)
        if obs in self._observers:
            self.remove(obs)

    def emit(self, hook: str, *args: object) -> None:
        if self._methods(hook):
            self.emit_at(self.clock(), hook, *args)

    def emit_at(self, t: float, hook: str, *args: object) -> None:
        """:meth:`emit` with the time the event happened (an event reported later)."""
        # a detach replaces the lists (see _changed): this one stays as it is
        for obs, method in self._methods(hook):
            try:
                method(*args, t)
            except Exception:
                self._detach(obs, hook)

    def trace_headers(self, request_id: str, stage_id: str) -> Mapping[str, str] | None:
        """The first tracing headers an observer gives stage ``stage_id`` of the request
        (:meth:`EngineObserver.stage_trace_headers`), or ``None``. Synchronous."""
        for obs, method in list(self._methods("stage_trace_headers")):
            try:
                headers = method(request_id, stage_id)
            except Exception:
                self._detach(obs, "stage_trace_headers")
                continue
            if headers is not None:
                return headers  # type: ignore[return-value]
        return None
