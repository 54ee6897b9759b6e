"""A timeline to look at: the stage runs of requests, and the engine's start-up, as a Chrome
trace-event file (open it in Perfetto, ui.perfetto.dev, or ``chrome://tracing``).

:func:`record_timeline` attaches a :class:`TimelineRecorder` to an engine;
:meth:`TimelineRecorder.write` writes what it saw (``omni-trio run --timeline out.json``
does both). In the file, each request is a process (``request <id>``) with one thread per
stage: a slice per stage run (its replica, outcome, outputs, time to first output in its
arguments), inside it ``waiting for input`` (until the first chunk from upstream came) and
``waiting for a replica``, and an instant ``first output``; a ``request`` slice spans the
request. The start-up is the process ``start-up``, one thread per replica, a slice per
start-up phase (``--log-stats`` prints the same phases), so a stage's start and the
requests after it share one time axis (``time.perf_counter``).

Recording costs one dictionary per request while it runs and a small record per stage run
after; it keeps the ``max_requests`` most recent requests (default 10,000), dropping the
oldest. Hooks are synchronous and O(1). Building the file is pure (:func:`chrome_trace`).
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..observer import EngineObserver, RequestInfo, Transfer

__all__ = [
    "RequestRecord",
    "StageRun",
    "TimelineRecorder",
    "chrome_trace",
    "record_timeline",
]

#: per stage id, per replica, start-up phase -> ``time.perf_counter()`` when it was reached
StartupMarks = Mapping[str, Sequence[Mapping[str, float]]]
#: one Chrome trace event (a JSON object)
Event = dict[str, object]


@dataclass(slots=True)
class StageRun:
    """One stage's run of one request, as the recorder saw it (perf_counter seconds)."""

    stage_id: str
    started: float
    ended: float | None = None
    status: str | None = None
    replica: int | None = None
    bound: float | None = None
    replica_wait_s: float = 0.0
    first_input: float | None = None
    first_output: float | None = None
    outputs: int = 0


@dataclass(slots=True)
class RequestRecord:
    """One request: its route (stage ids, pipeline order) and its stage runs."""

    request_id: str
    started: float
    route: tuple[str, ...] = ()
    ended: float | None = None
    status: str | None = None
    stages: dict[str, StageRun] = field(default_factory=dict)


class _Replica(Protocol):
    @property
    def timeline(self) -> Mapping[str, float]: ...


class _Pool(Protocol):
    @property
    def replicas(self) -> Sequence[_Replica]: ...


class ObservedEngine(Protocol):
    """What :func:`record_timeline` needs of an engine (an :class:`~omni_trio.Engine`)."""

    def add_observer(self, observer: EngineObserver, /) -> None: ...

    @property
    def pools(self) -> Mapping[str, _Pool]: ...


class TimelineRecorder(EngineObserver):
    """Records the stage runs of an engine's requests (see the module docstring).
    ``startup`` gives the start-up marks to put in the file (:func:`record_timeline`
    passes the engine's). Requests run as without observers while it records
    (:attr:`~omni_trio.observer.EngineObserver.routes_stages` is false)."""

    routes_stages = False

    def __init__(
        self,
        *,
        startup: Callable[[], StartupMarks] | None = None,
        max_requests: int = 10_000,
    ) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self._startup = startup
        self._live: dict[str, RequestRecord] = {}
        #: the requests that ended, oldest first (at most ``max_requests``)
        self.done: deque[RequestRecord] = deque(maxlen=max_requests)

    @property
    def requests_in_flight(self) -> int:
        return len(self._live)

    # -- hooks ---------------------------------------------------------------------------
    def request_info(self, request_id: str, info: RequestInfo, t: float) -> None:
        self._live[request_id] = RequestRecord(request_id, t - info.admission_wait_s, info.stages)

    def request_finished(self, request_id: str, status: str, t: float) -> None:
        rec = self._live.pop(request_id, None)
        if rec is None:
            return
        rec.ended, rec.status = t, status
        for run in rec.stages.values():
            if run.ended is None:
                run.ended, run.status = t, status
        self.done.append(rec)

    def _run(self, request_id: str, stage_id: str, t: float) -> StageRun | None:
        rec = self._live.get(request_id)
        if rec is None:
            return None
        run = rec.stages.get(stage_id)
        if run is None:
            run = rec.stages[stage_id] = StageRun(stage_id, t)
        return run

    def stage_started(self, request_id: str, stage_id: str, t: float) -> None:
        self._run(request_id, stage_id, t)

    def stage_bound(
        self, request_id: str, stage_id: str, replica: int, waited_s: float, t: float
    ) -> None:
        run = self._run(request_id, stage_id, t)
        if run is not None:
            run.replica, run.bound, run.replica_wait_s = replica, t, waited_s

    def stage_output(self, request_id: str, stage_id: str, first: bool, t: float) -> None:
        run = self._run(request_id, stage_id, t)
        if run is not None and run.first_output is None:
            run.first_output = t

    def stage_delta(self, request_id: str, stage_id: str, output: object, t: float) -> None:
        run = self._run(request_id, stage_id, t)
        if run is not None:
            run.outputs += 1

    def transfer_sent(self, request_id: str, transfer: Transfer, t: float) -> None:
        run = self._run(request_id, transfer.target, t)
        if run is not None and run.first_input is None:
            run.first_input = t - transfer.seconds

    def stage_finished(self, request_id: str, stage_id: str, status: str, t: float) -> None:
        run = self._run(request_id, stage_id, t)
        if run is not None:
            run.ended, run.status = t, status

    # -- output --------------------------------------------------------------------------
    def trace(self) -> dict[str, object]:
        """The Chrome trace of the requests that ended (and the start-up). Synchronous."""
        startup = self._startup() if self._startup is not None else {}
        return chrome_trace(self.done, startup)

    def write(self, path: str | os.PathLike[str]) -> int:
        """Write :meth:`trace` as JSON to ``path``; the number of events. Blocking (a file
        write): from async code, run it in a worker thread."""
        trace = self.trace()
        with open(path, "w", encoding="utf-8") as f:
            json.dump(trace, f)
        events = trace["traceEvents"]
        assert isinstance(events, list)
        return len(events)

    def __repr__(self) -> str:
        return f"<TimelineRecorder in_flight={len(self._live)} recorded={len(self.done)}>"


def record_timeline(engine: ObservedEngine, *, max_requests: int = 10_000) -> TimelineRecorder:
    """Attach a :class:`TimelineRecorder` to ``engine`` (its requests from now on, and its
    start-up phases) and return it; ``recorder.write(path)`` writes the file. Synchronous.
    Detach it with ``engine.remove_observer(recorder)``."""

    def startup() -> StartupMarks:
        return {
            sid: [dict(replica.timeline) for replica in pool.replicas]
            for sid, pool in engine.pools.items()
        }

    recorder = TimelineRecorder(startup=startup, max_requests=max_requests)
    engine.add_observer(recorder)
    return recorder


# -- the Chrome trace-event format (pure) -------------------------------------------------
def _us(t: float, origin: float) -> float:
    return round((t - origin) * 1e6, 3)


def _slice(name: str, start: float, end: float, pid: int, tid: int, origin: float) -> Event:
    return {
        "name": name,
        "ph": "X",
        "ts": _us(start, origin),
        "dur": max(0.0, _us(end, origin) - _us(start, origin)),
        "pid": pid,
        "tid": tid,
    }


def _meta(kind: str, pid: int, tid: int, name: str) -> Event:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _origin(requests: Iterable[RequestRecord], startup: StartupMarks) -> float:
    times = [r.started for r in requests]
    times += [t for replicas in startup.values() for marks in replicas for t in marks.values()]
    return min(times, default=0.0)


def _startup_events(startup: StartupMarks, origin: float) -> list[Event]:
    events: list[Event] = [_meta("process_name", 0, 0, "start-up")]
    tid = 0
    for sid, replicas in startup.items():
        for index, marks in enumerate(replicas):
            if not marks:
                continue
            tid += 1
            events.append(_meta("thread_name", 0, tid, f"{sid}[{index}]"))
            ordered = sorted(marks.items(), key=lambda kv: kv[1])
            first, last = ordered[0][1], ordered[-1][1]
            whole = _slice(f"{sid}[{index}] start-up", first, last, 0, tid, origin)
            whole["args"] = {"seconds": round(last - first, 6)}
            events.append(whole)
            for (_, t0), (phase, t1) in zip(ordered, ordered[1:], strict=False):
                events.append(_slice(phase, t0, t1, 0, tid, origin))
    return events


def _stage_events(run: StageRun, pid: int, tid: int, end: float, origin: float) -> list[Event]:
    ended = run.ended if run.ended is not None else end
    whole = _slice(run.stage_id, run.started, ended, pid, tid, origin)
    args: dict[str, object] = {"outcome": run.status, "outputs": run.outputs}
    if run.replica is not None:
        args["replica"] = run.replica
    if run.first_output is not None:
        args["time_to_first_output_s"] = round(run.first_output - run.started, 6)
    whole["args"] = args
    events = [whole]
    if run.first_input is not None and run.first_input > run.started:
        events.append(_slice("waiting for input", run.started, run.first_input, pid, tid, origin))
    if run.replica_wait_s > 0 and run.bound is not None:
        wait_start = max(run.started, run.bound - run.replica_wait_s)
        events.append(_slice("waiting for a replica", wait_start, run.bound, pid, tid, origin))
    if run.first_output is not None:
        events.append(
            {
                "name": "first output",
                "ph": "i",
                "s": "t",
                "ts": _us(run.first_output, origin),
                "pid": pid,
                "tid": tid,
            }
        )
    return events


def chrome_trace(requests: Iterable[RequestRecord], startup: StartupMarks) -> dict[str, object]:
    """The Chrome trace-event JSON object of ``requests`` (in that order) and the start-up
    ``startup`` (see the module docstring for the layout). Times are microseconds from the
    earliest mark. Pure."""
    requests = list(requests)
    origin = _origin(requests, startup)
    events = _startup_events(startup, origin) if startup else []
    for n, rec in enumerate(requests, start=1):
        end = rec.ended if rec.ended is not None else rec.started
        events.append(_meta("process_name", n, 0, f"request {rec.request_id}"))
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": n, "args": {"sort_index": n}}
        )
        events.append(_meta("thread_name", n, 0, "request"))
        whole = _slice("request", rec.started, end, n, 0, origin)
        whole["args"] = {"request_id": rec.request_id, "outcome": rec.status}
        events.append(whole)
        order = {sid: i for i, sid in enumerate(rec.route, start=1)}
        for run in rec.stages.values():
            tid = order.get(run.stage_id) or len(order) + 1 + list(rec.stages).index(run.stage_id)
            events.append(_meta("thread_name", n, tid, run.stage_id))
            events += _stage_events(run, n, tid, end, origin)
    return {"traceEvents": events, "displayTimeUnit": "ms"}
