"""Prometheus metrics of one engine: an observer for latencies, a collector for live state.

:class:`EngineMetrics` owns its own ``CollectorRegistry`` (never the process-global one, so
two engines in one process, or one per test, do not clash). Event-driven numbers (latency
histograms, transfer counters) come from :class:`~omni_trio.observer.EngineObserver` hooks;
state (requests in flight, replica health) is read from ``engine.statistics()`` at scrape
time, so a scrape always shows the truth and nothing is double-counted.

Metric names (all prefixed ``omni_trio_``)::

    requests_running / requests_waiting            gauges (waiting = no output yet)
    requests_finished_total / _aborted_total / _failed_total / requests_total   counters
    request_latency_seconds{status}                histogram, admission -> end
    time_to_first_output_seconds                   histogram, admission -> first output
    stage_latency_seconds{stage,status}            histogram, stage start -> stage end
    stage_queue_wait_seconds{stage}                histogram, stage start -> its first output
    transfers_total{source,target} / transfer_bytes_total{source,target}   counters
    stage_requests_in_flight{stage} / stage_live_replicas{stage}           gauges
    stage_requests_waiting{stage}                  gauge, requests waiting for a replica
    replica_healthy{stage,replica}                 gauge, 1 ready / 0 not
    replica_state{stage,replica,state}             gauge, 1 for the current state, 0 others
    replica_requests_in_flight{stage,replica}      gauge
    replica_restarts_total{stage,replica} / replica_failures_total{stage,replica}   counters
    admission_waiting                              gauge, admissions waiting for room
    engine_paused                                  gauge, 1 while admission is paused
    requests_in_graph                              gauge, max_requests_in_graph tickets held
                                                   (only with that limit)
    resource_capacity{resource} / resource_reserved{resource}   gauges, the resource ledger

The stage and replica gauges come from the engine's health report
(:func:`~omni_trio.engine.health.assess_health` of the same snapshot), so ``/metrics`` and
``/health`` agree: a live replica is a ``ready`` one (a draining replica is not).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.health import assess_health
from ..observer import EngineObserver
from ..outputs import EngineStatistics, ReplicaState

if TYPE_CHECKING:
    from ..engine.engine import Engine

__all__ = ["CONTENT_TYPE", "EngineMetrics", "state_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# CPU inference is slow: buckets reach minutes, not only the library's 10 s default.
_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# every replica state, each one sample of the enum gauge replica_state
_REPLICA_STATES: tuple[ReplicaState, ...] = get_args(ReplicaState)


class _StateCollector(Collector):
    """Reads the engine's statistics at scrape time."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        yield from state_metrics(self._m.engine.statistics(), self._m.waiting)


def state_metrics(stats: EngineStatistics, without_output: int) -> Iterator[Metric]:
    """Every state metric of one statistics snapshot; ``without_output`` counts the requests
    that produced no output yet (the observer's count: statistics do not know it). Pure."""
    waiting = min(without_output, stats.requests_in_flight)
    g = GaugeMetricFamily
    running = stats.requests_in_flight - waiting
    yield g("omni_trio_requests_running", "Requests producing output.", value=running)
    yield g("omni_trio_requests_waiting", "Requests with no output yet.", value=waiting)
    for name, value, doc in (
        ("finished", stats.requests_finished, "Requests that finished."),
        ("aborted", stats.requests_aborted, "Requests aborted (client or engine)."),
        ("failed", stats.requests_failed, "Requests failed by a stage error."),
    ):
        yield CounterMetricFamily(f"omni_trio_requests_{name}", doc, value=value)
    yield CounterMetricFamily(
        "omni_trio_requests", "Requests admitted.", value=stats.requests_total
    )
    yield g(
        "omni_trio_admission_waiting",
        "Admissions waiting for room (max_requests_in_flight) or for resume().",
        value=stats.requests_waiting,
    )
    yield g(
        "omni_trio_sessions",
        "Live sessions holding a slot (open, detached, or closing).",
        value=stats.sessions,
    )
    yield g(
        "omni_trio_engine_paused",
        "1 while admission is paused.",
        value=1 if stats.paused else 0,
    )
    if stats.requests_in_graph is not None:
        yield g(
            "omni_trio_requests_in_graph",
            "Requests holding a max_requests_in_graph ticket (admitted, consumer not done).",
            value=stats.requests_in_graph,
        )
    if stats.resources:
        capacity = g("omni_trio_resource_capacity", "A resource's capacity.", labels=["resource"])
        reserved = g(
            "omni_trio_resource_reserved",
            "What the replicas reserve of a resource.",
            labels=["resource"],
        )
        for r in stats.resources:
            capacity.add_metric([r.resource], r.capacity)
            reserved.add_metric([r.resource], r.reserved)
        yield from (capacity, reserved)
    yield from _stage_metrics(stats)


def _stage_metrics(stats: EngineStatistics) -> Iterator[Metric]:
    """The per-stage and per-replica families of one statistics snapshot, read through its
    health report."""
    g, c = GaugeMetricFamily, CounterMetricFamily
    stage, replica = ["stage"], ["stage", "replica"]
    inflight = g("omni_trio_stage_requests_in_flight", "Requests bound to a stage.", labels=stage)
    waiting = g("omni_trio_stage_requests_waiting", "Requests waiting for a replica.", labels=stage)
    live = g("omni_trio_stage_live_replicas", "Ready replicas of a stage.", labels=stage)
    health = g("omni_trio_replica_healthy", "1 if the replica is ready, else 0.", labels=replica)
    state = g(
        "omni_trio_replica_state",
        "1 for the replica's current state, 0 for the others.",
        labels=[*replica, "state"],
    )
    r_inflight = g(
        "omni_trio_replica_requests_in_flight", "Requests bound to a replica.", labels=replica
    )
    restarts = c("omni_trio_replica_restarts", "Times a replica was replaced.", labels=replica)
    failures = c("omni_trio_replica_failures", "Times a replica died.", labels=replica)
    for st in assess_health(stats).stages:
        inflight.add_metric([st.stage_id], st.requests_in_flight)
        waiting.add_metric([st.stage_id], st.requests_waiting)
        live.add_metric([st.stage_id], st.live_replicas)
        for r in st.replicas:
            labels = [st.stage_id, str(r.replica)]
            health.add_metric(labels, 1 if r.live else 0)
            for name in _REPLICA_STATES:
                state.add_metric([*labels, name], 1 if r.state == name else 0)
            r_inflight.add_metric(labels, r.requests_in_flight)
            restarts.add_metric(labels, r.restarts)
            failures.add_metric(labels, r.failures)
    yield from (inflight, waiting, live, health, state, r_inflight, restarts, failures)


class EngineMetrics(EngineObserver):
    """Prometheus metrics of one engine. ``EngineMetrics(engine)`` attaches itself as an
    observer; :meth:`render` returns the text exposition. Hooks are synchronous and O(1);
    per-request bookkeeping is dropped when the request ends (nothing accumulates)."""

    def __init__(self, engine: Engine, *, attach: bool = True) -> None:
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.request_latency = Histogram(
            "omni_trio_request_latency_seconds",
            "End-to-end request latency, admission to end.",
            ["status"],
            buckets=_BUCKETS,
            registry=reg,
        )
        self.first_output = Histogram(
            "omni_trio_time_to_first_output_seconds",
            "Admission to the request's first output of any stage.",
            buckets=_BUCKETS,
            registry=reg,
        )
        self.stage_latency = Histogram(
            "omni_trio_stage_latency_seconds",
            "A request's time in one stage, start to end.",
            ["stage", "status"],
            buckets=_BUCKETS,
            registry=reg,
        )
        self.queue_wait = Histogram(
            "omni_trio_stage_queue_wait_seconds",
            "A request's wait in one stage before its first output.",
            ["stage"],
            buckets=_BUCKETS,
            registry=reg,
        )
        self.transfers = Counter(
            "omni_trio_transfers", "Inter-stage transfers.", ["source", "target"], registry=reg
        )
        self.transfer_bytes = Counter(
            "omni_trio_transfer_bytes",
            "Approximate bytes moved between stages.",
            ["source", "target"],
            registry=reg,
        )
        self._started: dict[str, float] = {}
        self._waiting: set[str] = set()
        self._stage_started: dict[tuple[str, str], float] = {}
        reg.register(_StateCollector(self))
        if attach:
            engine.add_observer(self)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def tracked(self) -> int:
        """Requests and stage runs this observer holds state for (0 when idle)."""
        return len(self._started) + len(self._stage_started)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric. Synchronous."""
        return generate_latest(self.registry)

    # -- observer hooks --------------------------------------------------------------------
    def request_started(self, request_id: str, t: float) -> None:
        self._started[request_id] = t
        self._waiting.add(request_id)

    def request_finished(self, request_id: str, status: str, t: float) -> None:
        self._waiting.discard(request_id)
        t0 = self._started.pop(request_id, None)
        if t0 is not None:
            self.request_latency.labels(status).observe(max(0.0, t - t0))

    def stage_started(self, request_id: str, stage_id: str, t: float) -> None:
        self._stage_started[(request_id, stage_id)] = t

    def stage_output(self, request_id: str, stage_id: str, first: bool, t: float) -> None:
        if not first:
            return
        t0 = self._stage_started.get((request_id, stage_id))
        if t0 is not None:
            self.queue_wait.labels(stage_id).observe(max(0.0, t - t0))
        if request_id in self._waiting:
            self._waiting.discard(request_id)
            r0 = self._started.get(request_id)
            if r0 is not None:
                self.first_output.observe(max(0.0, t - r0))

    def stage_finished(self, request_id: str, stage_id: str, status: str, t: float) -> None:
        t0 = self._stage_started.pop((request_id, stage_id), None)
        if t0 is not None:
            self.stage_latency.labels(stage_id, status).observe(max(0.0, t - t0))

    def transfer(self, request_id: str, source: str, target: str, nbytes: int, t: float) -> None:
        self.transfers.labels(source, target).inc()
        self.transfer_bytes.labels(source, target).inc(nbytes)

    def __repr__(self) -> str:
        return f"<EngineMetrics tracking={len(self._started)} waiting={len(self._waiting)}>"
