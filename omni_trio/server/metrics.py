"""Prometheus metrics of one engine: an observer for latencies, a collector for live state.

:class:`EngineMetrics` owns its own ``CollectorRegistry`` (never the process-global one, so
two engines in one process, or one per test, do not clash). Event-driven numbers (latency
histograms, audio figures, transfers, each replica's running and waiting requests) come from
:class:`~omni_trio.observer.EngineObserver` hooks; state (requests in flight, replica health,
sessions) is read from ``engine.statistics()`` at scrape time, so a scrape always shows the
truth and nothing is double-counted.

Every metric, its type, labels and meaning is in :data:`METRICS` (the README's metrics table
is checked against it). The audio figures (:mod:`omni_trio.telemetry.audio_slo`) are those of
the stages with ``output_type: audio``: a packet is an output carrying samples, its length
is its samples over the sample rate its output reports (``metrics["sample_rate"]``), else
the stage's ``options.sample_rate``, else 16 kHz.

The stage and replica gauges come from the engine's health report
(:func:`~omni_trio.engine.health.assess_health` of the same snapshot), so ``/metrics`` and
``/health`` agree: a live replica is a ``ready`` one (a draining replica is not).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..audio import sample_rate_of
from ..engine.health import assess_health
from ..observer import EngineObserver, Transfer
from ..outputs import EngineStatistics, ReplicaState, StageOutput
from ..telemetry.audio_slo import AudioStream, audio_samples

if TYPE_CHECKING:
    from ..engine.engine import Engine

__all__ = ["CONTENT_TYPE", "METRICS", "EngineMetrics", "state_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# CPU inference is slow: buckets reach minutes, not only the library's 10 s default.
_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# hand-offs between stages in one process take microseconds, unless backpressure holds them
_FAST_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30)
# real-time factors: below 1 the audio is made faster than it plays
_RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 5, 10, 50)
# bytes handed from stage to stage: a few token ids to a large tensor
_SIZE_BUCKETS = tuple(float(64 * 4**k) for k in range(12))  # 64 B ... 268 MB
# every replica state, each one sample of the enum gauge replica_state
_REPLICA_STATES: tuple[ReplicaState, ...] = get_args(ReplicaState)

#: every metric /metrics exposes (without the ``omni_trio_`` prefix; counters with
#: ``_total``): its type, its labels, what it measures
METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("requests_running", "gauge", "", "requests producing output"),
    ("requests_waiting", "gauge", "", "requests admitted that produced no output yet"),
    ("requests_total", "counter", "", "requests admitted"),
    ("requests_finished_total", "counter", "", "requests that finished"),
    ("requests_aborted_total", "counter", "", "requests aborted (caller, disconnect, close)"),
    ("requests_failed_total", "counter", "", "requests a stage failed"),
    ("request_latency_seconds", "histogram", "status", "admission to the request's end"),
    ("time_to_first_output_seconds", "histogram", "", "admission to its first output"),
    ("admission_waiting", "gauge", "", "admissions waiting for room or for resume()"),
    ("engine_paused", "gauge", "", "1 while admission is paused"),
    ("stage_latency_seconds", "histogram", "stage, status", "a stage's run, start to end"),
    ("stage_queue_wait_seconds", "histogram", "stage", "a stage's start to its first output"),
    ("stage_requests_in_flight", "gauge", "stage", "requests bound to the stage"),
    ("stage_requests_waiting", "gauge", "stage", "requests waiting for a replica"),
    ("stage_live_replicas", "gauge", "stage", "ready replicas"),
    ("replica_healthy", "gauge", "stage, replica", "1 if the replica is ready"),
    ("replica_state", "gauge", "stage, replica, state", "1 for its current state"),
    ("replica_requests_in_flight", "gauge", "stage, replica", "requests bound to it"),
    (
        "replica_requests_running",
        "gauge",
        "stage, replica",
        "requests bound to it that produced output",
    ),
    ("replica_requests_waiting", "gauge", "stage, replica", "bound, no output yet"),
    ("replica_requests_finished_total", "counter", "stage, replica", "its runs that finished"),
    ("replica_requests_aborted_total", "counter", "stage, replica", "its runs aborted"),
    ("replica_requests_failed_total", "counter", "stage, replica", "its runs that failed"),
    ("replica_restarts_total", "counter", "stage, replica", "times the index was replaced"),
    ("replica_failures_total", "counter", "stage, replica", "times the index died"),
    (
        "audio_time_to_first_packet_seconds",
        "histogram",
        "stage",
        "admission to the stage's first audio packet",
    ),
    (
        "audio_real_time_factor",
        "histogram",
        "stage",
        "admission to the last packet, per second of audio, of a finished stream "
        "(< 1: faster than it plays)",
    ),
    ("audio_seconds_total", "counter", "stage", "seconds of audio produced"),
    ("audio_packets_total", "counter", "stage", "audio packets (outputs with samples)"),
    (
        "audio_underruns_total",
        "counter",
        "stage",
        "packets that came later than the audio before them lasted",
    ),
    ("transfers_total", "counter", "source, target", "chunks handed between stages"),
    ("transfer_bytes_total", "counter", "source, target", "approximate bytes handed on"),
    ("transfer_size_bytes", "histogram", "source, target", "approximate bytes per chunk"),
    (
        "transfer_seconds",
        "histogram",
        "source, target",
        "a chunk ready to the next stage's input taking it (backpressure)",
    ),
    ("sessions", "gauge", "", "live sessions holding a slot (open, detached, closing)"),
    ("sessions_detached", "gauge", "", "live sessions detached, waiting for a resume"),
    ("sessions_opened_total", "counter", "", "live sessions opened"),
    (
        "requests_in_graph",
        "gauge",
        "",
        "max_requests_in_graph tickets held (only with that limit)",
    ),
    ("resource_capacity", "gauge", "resource", "a resource's capacity (the resource ledger)"),
    ("resource_reserved", "gauge", "resource", "what the replicas reserve of a resource"),
)


class _StateCollector(Collector):
    """Reads the engine's statistics at scrape time."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        yield from state_metrics(m.engine.statistics(), m.waiting, m.replica_load)


#: per (stage, replica): requests bound to it (waiting, running)
ReplicaLoad = Mapping[tuple[str, int], tuple[int, int]]


def state_metrics(
    stats: EngineStatistics, without_output: int, replica_load: ReplicaLoad | None = None
) -> Iterator[Metric]:
    """Every state metric of one statistics snapshot; ``without_output`` counts the requests
    that produced no output yet and ``replica_load`` each replica's requests waiting and
    running (the observer's counts: statistics do not know them). Pure."""
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
        "omni_trio_sessions_detached",
        "Live sessions detached, waiting for a resume.",
        value=stats.sessions_detached,
    )
    yield CounterMetricFamily(
        "omni_trio_sessions_opened", "Live sessions opened.", value=stats.sessions_opened
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
    yield from _stage_metrics(stats, replica_load or {})


def _stage_metrics(stats: EngineStatistics, load: ReplicaLoad) -> Iterator[Metric]:
    """The per-stage and per-replica families of one statistics snapshot, read through its
    health report, and each replica's requests waiting and running."""
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
    r_waiting = g(
        "omni_trio_replica_requests_waiting", "Requests bound, no output yet.", labels=replica
    )
    r_running = g(
        "omni_trio_replica_requests_running", "Requests bound, producing output.", labels=replica
    )
    ends = {
        end: c(f"omni_trio_replica_requests_{end}", f"Runs on the replica {end}.", labels=replica)
        for end in ("finished", "aborted", "failed")
    }
    counts = {
        (st.stage_id, r.replica): (r.requests_finished, r.requests_aborted, r.requests_failed)
        for st in stats.stages
        for r in st.replicas
    }
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
            waits, runs = load.get((st.stage_id, r.replica), (0, 0))
            r_waiting.add_metric(labels, waits)
            r_running.add_metric(labels, runs)
            for family, value in zip(
                ends.values(), counts.get((st.stage_id, r.replica), (0, 0, 0)), strict=True
            ):
                family.add_metric(labels, value)
    yield from (inflight, waiting, live, health, state, r_inflight, restarts, failures)
    yield from (r_waiting, r_running, *ends.values())


class EngineMetrics(EngineObserver):
    """Prometheus metrics of one engine. ``EngineMetrics(engine)`` attaches itself as an
    observer; :meth:`render` returns the text exposition. Hooks are synchronous and O(1);
    per-request bookkeeping is dropped when the request ends (nothing accumulates)."""

    def __init__(self, engine: Engine, *, attach: bool = True) -> None:
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry

        def histogram(
            name: str, doc: str, labels: list[str], buckets: tuple[float, ...]
        ) -> Histogram:
            return Histogram(f"omni_trio_{name}", doc, labels, buckets=buckets, registry=reg)

        self.request_latency = histogram(
            "request_latency_seconds",
            "End-to-end request latency, admission to end.",
            ["status"],
            _BUCKETS,
        )
        self.first_output = histogram(
            "time_to_first_output_seconds",
            "Admission to the request's first output of any stage.",
            [],
            _BUCKETS,
        )
        self.stage_latency = histogram(
            "stage_latency_seconds",
            "A request's time in one stage, start to end.",
            ["stage", "status"],
            _BUCKETS,
        )
        self.queue_wait = histogram(
            "stage_queue_wait_seconds",
            "A request's wait in one stage before its first output.",
            ["stage"],
            _BUCKETS,
        )
        edge = ["source", "target"]
        self.transfers = Counter(
            "omni_trio_transfers", "Inter-stage transfers.", edge, registry=reg
        )
        self.transfer_bytes = Counter(
            "omni_trio_transfer_bytes",
            "Approximate bytes moved between stages.",
            edge,
            registry=reg,
        )
        self.transfer_size = histogram(
            "transfer_size_bytes", "Approximate bytes of one chunk handed on.", edge, _SIZE_BUCKETS
        )
        self.transfer_seconds = histogram(
            "transfer_seconds",
            "A chunk ready to the next stage's input taking it (backpressure).",
            edge,
            _FAST_BUCKETS,
        )
        self.audio_first_packet = histogram(
            "audio_time_to_first_packet_seconds",
            "Admission to an audio stage's first packet.",
            ["stage"],
            _BUCKETS,
        )
        self.audio_rtf = histogram(
            "audio_real_time_factor",
            "Admission to the last packet, per second of audio produced.",
            ["stage"],
            _RTF_BUCKETS,
        )
        self.audio_seconds = Counter(
            "omni_trio_audio_seconds", "Seconds of audio produced.", ["stage"], registry=reg
        )
        self.audio_packets = Counter(
            "omni_trio_audio_packets",
            "Audio packets (outputs carrying samples).",
            ["stage"],
            registry=reg,
        )
        self.audio_underruns = Counter(
            "omni_trio_audio_underruns",
            "Audio packets that came later than the audio before them lasted.",
            ["stage"],
            registry=reg,
        )
        self._started: dict[str, float] = {}
        self._waiting: set[str] = set()
        self._stage_started: dict[tuple[str, str], float] = {}
        # per request, per stage: the replica it is bound to and whether it produced output
        self._bound: dict[str, dict[str, tuple[int, bool]]] = {}
        self._load: dict[tuple[str, int], tuple[int, int]] = {}
        # per request, per audio stage: its stream so far
        self._audio: dict[str, dict[str, AudioStream]] = {}
        self._audio_options = {
            st.id: st.options for st in engine.config.stages if st.output_type == "audio"
        }
        for sid in self._audio_options:  # every audio stage's series, from zero
            for family in (self.audio_underruns, self.audio_seconds, self.audio_packets):
                family.labels(sid)
            for histo in (self.audio_first_packet, self.audio_rtf):
                histo.labels(sid)
        reg.register(_StateCollector(self))
        if attach:
            engine.add_observer(self)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def replica_load(self) -> ReplicaLoad:
        """Per (stage, replica): its bound requests waiting for output and producing it."""
        return self._load

    @property
    def tracked(self) -> int:
        """Requests and stage runs this observer holds state for (0 when idle)."""
        return (
            len(self._started)
            + len(self._stage_started)
            + len(self._bound)
            + len(self._audio)
            + sum(w + r for w, r in self._load.values())
        )

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
        # a stage whose end was not seen ends with its request
        for stage_id in list(self._bound.get(request_id, ())):
            self._unbind(request_id, stage_id)
        self._audio.pop(request_id, None)

    def stage_started(self, request_id: str, stage_id: str, t: float) -> None:
        self._stage_started[(request_id, stage_id)] = t

    def stage_bound(
        self, request_id: str, stage_id: str, replica: int, waited_s: float, t: float
    ) -> None:
        self._unbind(request_id, stage_id)  # a stage bound again (a later hop) moves
        self._bound.setdefault(request_id, {})[stage_id] = (replica, False)
        self._count(stage_id, replica, False, 1)

    def _count(self, stage_id: str, replica: int, running: bool, n: int) -> None:
        key = (stage_id, replica)
        waits, runs = self._load.get(key, (0, 0))
        waits, runs = (waits, runs + n) if running else (waits + n, runs)
        if waits or runs:
            self._load[key] = (waits, runs)
        else:
            self._load.pop(key, None)

    def _unbind(self, request_id: str, stage_id: str) -> None:
        stages = self._bound.get(request_id)
        bound = stages.pop(stage_id, None) if stages is not None else None
        if bound is not None:
            self._count(stage_id, bound[0], bound[1], -1)
        if stages is not None and not stages:
            del self._bound[request_id]

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
        stages = self._bound.get(request_id)
        bound = stages.get(stage_id) if stages is not None else None
        if stages is not None and bound is not None and not bound[1]:
            stages[stage_id] = (bound[0], True)
            self._count(stage_id, bound[0], False, -1)
            self._count(stage_id, bound[0], True, 1)

    def stage_delta(self, request_id: str, stage_id: str, output: object, t: float) -> None:
        options = self._audio_options.get(stage_id)
        if options is None or not isinstance(output, StageOutput):
            return
        samples = audio_samples(output.data)
        if not samples:
            return
        seconds = samples / sample_rate_of(output.metrics, options)
        streams = self._audio.setdefault(request_id, {})
        stream = streams.get(stage_id)
        if stream is None:
            stream = streams[stage_id] = AudioStream(self._started.get(request_id, t))
        if stream.add(t, seconds):
            self.audio_underruns.labels(stage_id).inc()
        if stream.packets == 1 and stream.time_to_first_packet is not None:
            self.audio_first_packet.labels(stage_id).observe(max(0.0, stream.time_to_first_packet))
        self.audio_seconds.labels(stage_id).inc(seconds)
        self.audio_packets.labels(stage_id).inc()

    def stage_finished(self, request_id: str, stage_id: str, status: str, t: float) -> None:
        t0 = self._stage_started.pop((request_id, stage_id), None)
        if t0 is not None:
            self.stage_latency.labels(stage_id, status).observe(max(0.0, t - t0))
        self._unbind(request_id, stage_id)
        streams = self._audio.get(request_id)
        stream = streams.pop(stage_id, None) if streams is not None else None
        if streams is not None and not streams:
            del self._audio[request_id]
        # a stream cut short says nothing of how fast the whole would have come
        rtf = stream.real_time_factor if stream is not None and status == "finished" else None
        if rtf is not None:
            self.audio_rtf.labels(stage_id).observe(rtf)

    def transfer(self, request_id: str, source: str, target: str, nbytes: int, t: float) -> None:
        self.transfers.labels(source, target).inc()
        self.transfer_bytes.labels(source, target).inc(nbytes)

    def transfer_sent(self, request_id: str, transfer: Transfer, t: float) -> None:
        edge = (transfer.source, transfer.target)
        self.transfer_size.labels(*edge).observe(transfer.nbytes)
        self.transfer_seconds.labels(*edge).observe(max(0.0, transfer.seconds))

    def __repr__(self) -> str:
        return f"<EngineMetrics tracking={len(self._started)} waiting={len(self._waiting)}>"
