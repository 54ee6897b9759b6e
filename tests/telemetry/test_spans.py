"""OpenTelemetry spans of requests (telemetry/spans.py): the span tree of a request, every
ending (finish, abort, stage failure, replica death, engine close, a cancellation at every
checkpoint) ending each span exactly once, trace context in and out. Scripted stages on the
MockClock; spans go to an in-memory exporter through the tracer's own provider."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
import trio
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import omni_trio
from omni_trio.errors import ReplicaDeadError, StageError
from omni_trio.telemetry.spans import RequestTracer
from omni_trio.testing import (
    assert_nothing_in_flight,
    cancel_at_every_checkpoint,
    scripted_backends,
    scripted_pipeline,
    wait_until_settled,
)

PROMPT = [10, 20, 30, 40]
STAGES = ("s0", "s1", "s2")
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


@dataclass
class Ends(SpanProcessor):
    """Counts starts and ends per span id: every span started ends, once."""

    started: Counter[int] = field(default_factory=Counter)
    ended: Counter[int] = field(default_factory=Counter)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.started[span.context.span_id] += 1

    def on_end(self, span: ReadableSpan) -> None:
        assert span.context is not None
        self.ended[span.context.span_id] += 1

    def problems(self) -> list[str]:
        out = [f"span {s:x} ended {n} times" for s, n in self.ended.items() if n != 1]
        out += [f"span {s:x} never ended" for s in self.started if s not in self.ended]
        return out


@dataclass
class Traced:
    tracer: RequestTracer
    exporter: InMemorySpanExporter
    ends: Ends

    def spans(self) -> tuple[ReadableSpan, ...]:
        return self.exporter.get_finished_spans()

    def of(self, request_id: str) -> tuple[ReadableSpan, list[ReadableSpan]]:
        """The request's root span and its stage spans, by stage index."""
        roots = [
            s
            for s in self.spans()
            if s.name == "omni_trio.request" and attr(s, "request.id") == request_id
        ]
        assert len(roots) == 1, roots
        root = roots[0]
        stages = [
            s
            for s in self.spans()
            if s.parent is not None and s.parent.span_id == root.context.span_id
        ]
        return root, sorted(stages, key=lambda s: attr(s, "stage.index"))

    def check_ended(self) -> None:
        assert self.ends.problems() == []
        assert self.tracer.open_spans == 0


def attr(span: ReadableSpan, name: str) -> object:
    assert span.attributes is not None
    return span.attributes.get("omni_trio." + name)


def events(span: ReadableSpan) -> list[str]:
    return [e.name for e in span.events]


def traced_engine(engine: omni_trio.Engine) -> Traced:
    exporter = InMemorySpanExporter()
    ends = Ends()
    provider = TracerProvider()
    provider.add_span_processor(ends)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(engine.config, provider, restarts=engine._stage_restarts)
    engine.add_observer(tracer)
    return Traced(tracer, exporter, ends)


async def test_the_span_tree_of_a_three_stage_request(autojump_clock):
    cfg = scripted_pipeline(3, outputs=4, latency_s=0.1, final_outputs=["s1", "s2"])
    async with omni_trio.open_engine(cfg) as engine:
        t = traced_engine(engine)
        outs = await engine.generate(PROMPT, request_id="r").collect()
        assert len(outs) == 8
        assert_nothing_in_flight(engine)
    t.check_ended()
    root, stages = t.of("r")
    assert root.kind == SpanKind.SERVER and root.parent is None
    assert attr(root, "request.route") == STAGES
    assert attr(root, "request.output_stages") == ("s1", "s2")
    assert attr(root, "request.output_modalities") == ("text",)
    assert attr(root, "request.outcome") == "finished"
    assert root.status.status_code == StatusCode.UNSET
    assert [s.name for s in stages] == ["omni_trio.stage"] * 3
    assert {s.context.trace_id for s in stages} == {root.context.trace_id}
    for i, (span, sid) in enumerate(zip(stages, STAGES, strict=True)):
        assert attr(span, "stage.id") == sid and attr(span, "stage.index") == i
        assert attr(span, "stage.backend") == "scripted"
        assert attr(span, "replica.index") == 0
        assert attr(span, "stage.outcome") == "finished"
        assert attr(span, "stage.tokens_out") == 4
        assert attr(span, "stage.time_to_first_output_s") is not None
        assert "bound" in events(span) and "first_output" in events(span)
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time
    # nobody streams s0's outputs: its backend sends them whole, in one
    assert [attr(s, "stage.outputs") for s in stages] == [1, 4, 4]
    # the entry stage's input is the prompt; each next one's is what its upstream handed on
    assert attr(stages[0], "stage.tokens_in") == 4
    assert attr(stages[1], "stage.tokens_in") == 4 and "first_input" in events(stages[1])
    assert attr(stages[2], "stage.tokens_in") == 4


async def test_an_abort_ends_every_span_aborted(autojump_clock):
    # every stage streams into the next: all three are running when the abort comes
    cfg = scripted_pipeline(3, outputs=8, latency_s=0.1, stream_input=True)
    async with omni_trio.open_engine(cfg) as engine:
        t = traced_engine(engine)
        async with engine.generate(PROMPT, request_id="a") as stream:
            await stream.receive()
            await engine.abort("a")
        assert_nothing_in_flight(engine)
    t.check_ended()
    root, stages = t.of("a")
    assert attr(root, "request.outcome") == "aborted"
    assert events(root).count("abort_requested") == 1
    assert events(root)[-1] == "abort_committed"
    assert root.status.status_code == StatusCode.UNSET
    assert [attr(s, "stage.outcome") for s in stages] == ["aborted"] * 3


@pytest.mark.parametrize(
    ("options", "error"),
    [({"fail_at_output": 1}, StageError), ({"crash_at_request": 1}, ReplicaDeadError)],
    ids=["stage-failure", "replica-death"],
)
async def test_a_failure_marks_its_stage_span_and_the_root(autojump_clock, options, error):
    # streamed from stage to stage: all three run when s1 fails
    cfg = scripted_pipeline(
        3, outputs=4, latency_s=0.1, stream_input=True, stage_options={"s1": options}
    )
    async with omni_trio.open_engine(cfg) as engine:
        t = traced_engine(engine)
        with pytest.raises(error):
            await engine.generate(PROMPT, request_id="f").collect()
        assert_nothing_in_flight(engine)
    t.check_ended()
    root, (s0, s1, s2) = t.of("f")
    assert attr(root, "request.outcome") == "failed"
    assert root.attributes is not None and root.attributes["error.type"] == error.__name__
    assert root.status.status_code == StatusCode.ERROR
    assert s1.status.status_code == StatusCode.ERROR
    assert s1.status.description is not None and error.__name__ in s1.status.description
    assert [e.attributes["exception.type"] for e in s1.events if e.name == "exception"] == [
        f"omni_trio.errors.{error.__name__}"
    ]
    assert attr(s1, "stage.outcome") == "failed"
    # the others were cancelled by the failure: ended, not errors of their own
    assert s0.status.status_code == StatusCode.UNSET and s2.status.status_code == StatusCode.UNSET


async def test_a_restart_and_the_wait_for_it_are_events(autojump_clock):
    # s1's replica dies; a request arriving meanwhile waits for its replacement
    cfg = scripted_pipeline(2, outputs=2, latency_s=0.1)
    cfg.stages[1].restart = "on-failure"
    cfg.stages[1].max_restarts = 1
    cfg.stages[1].restart_backoff_s = 5.0
    async with omni_trio.open_engine(cfg) as engine:
        t = traced_engine(engine)
        engine.pools["s1"].replica(0).kill(RuntimeError("killed by the test"))
        outs = await engine.generate(PROMPT, request_id="w").collect()
        assert outs[-1].finished
        with trio.fail_after(60):
            await wait_until_settled(engine)
    t.check_ended()
    _, (_, s1) = t.of("w")
    assert "replica_wait" in events(s1) and "replica_restarted" in events(s1)
    (wait,) = [e for e in s1.events if e.name == "replica_wait"]
    assert wait.attributes is not None and wait.attributes["omni_trio.wait_s"] > 0
    assert attr(s1, "stage.outcome") == "finished"


async def test_closing_the_engine_ends_every_span(autojump_clock):
    cfg = scripted_pipeline(2, outputs=100, latency_s=1.0)
    async with omni_trio.open_engine(cfg) as engine:
        t = traced_engine(engine)
        streams = [engine.generate(PROMPT, request_id=f"c{i}") for i in range(3)]
        for s in streams:
            await s.__aenter__()
        await trio.sleep(2.5)
    for s in streams:
        await s.__aexit__(None, None, None)
    t.check_ended()
    for i in range(3):
        root, stages = t.of(f"c{i}")
        assert attr(root, "request.outcome") == "aborted"
        assert "abort_requested" in events(root)
        # s1 takes s0's whole output: it never started, it has no span
        assert [attr(s, "stage.id") for s in stages] == ["s0"]
        assert attr(stages[0], "stage.outcome") == "aborted"


async def test_an_admission_wait_is_an_event(autojump_clock):
    cfg = scripted_pipeline(
        1, outputs=2, latency_s=1.0, engine_options={"max_requests_in_flight": 1}
    )
    async with omni_trio.open_engine(cfg) as engine:
        t = traced_engine(engine)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.generate(PROMPT, request_id="first").collect)
            await trio.sleep(0.5)
            await engine.generate(PROMPT, request_id="second").collect()
    t.check_ended()
    root, _ = t.of("second")
    (wait,) = [e for e in root.events if e.name == "admission_wait"]
    assert wait.attributes is not None and wait.attributes["omni_trio.wait_s"] > 0
    assert "admission_wait" not in events(t.of("first")[0])


async def test_cancelled_at_every_checkpoint_every_span_ends_once(autojump_clock):
    cfg = scripted_pipeline(3, outputs=3, latency_s=0.1, final_outputs=["s1", "s2"])
    async with omni_trio.open_engine(cfg) as engine:
        t = traced_engine(engine)

        async def scenario(engine: omni_trio.Engine) -> None:
            async with engine.generate(PROMPT) as stream:
                async for _ in stream:
                    pass

        def invariant(engine: omni_trio.Engine) -> None:
            t.check_ended()
            for root in (s for s in t.spans() if s.name == "omni_trio.request"):
                assert attr(root, "request.outcome") in ("finished", "aborted")

        report = await cancel_at_every_checkpoint(engine, scenario, invariant=invariant)
        report.raise_if_failed()
        assert report.checkpoints > 5
    outcomes = Counter(
        attr(s, "request.outcome") for s in t.spans() if s.name == "omni_trio.request"
    )
    # run 0 is cancelled before admission: no request, no span
    assert sum(outcomes.values()) == report.runs
    assert outcomes["aborted"] >= report.checkpoints - 2 and outcomes["finished"] >= 1


async def test_trace_headers_continue_the_callers_trace(autojump_clock):
    cfg = scripted_pipeline(
        2, outputs=2, final_outputs=["s0", "s1"], stage_options={"s1": {"hang": True}}
    )
    async with omni_trio.open_engine(cfg) as engine:
        t = traced_engine(engine)
        async with engine.generate(
            PROMPT, request_id="p", trace_headers={"traceparent": TRACEPARENT}
        ) as stream:
            await stream.receive()  # s0's first output: s1 is bound and hangs
            (s1,) = scripted_backends(engine, "s1")
            context = s1.request_context("p")
            assert context is not None and context.trace_headers is not None
            handed = context.trace_headers["traceparent"]
            # the caller still sees its own headers
            assert engine.orchestrator._requests["p"].context.trace_headers == {
                "traceparent": TRACEPARENT
            }
    t.check_ended()
    root, (s0_span, s1_span) = t.of("p")
    assert format(root.context.trace_id, "032x") == CALLER_TRACE
    assert root.parent is not None and format(root.parent.span_id, "016x") == CALLER_SPAN
    # the stage hands its engine its own span as the parent
    assert handed == f"00-{CALLER_TRACE}-{s1_span.context.span_id:016x}-01"


async def test_an_observer_without_the_new_hooks_keeps_working(autojump_clock):
    # an observer written before the new hooks (not even an EngineObserver subclass)
    seen: list[tuple[str, ...]] = []

    class Old:
        def request_started(self, request_id: str, t: float) -> None:
            seen.append(("started", request_id))

        def stage_finished(self, request_id: str, stage_id: str, status: str, t: float) -> None:
            seen.append(("stage", stage_id, status))

        def request_finished(self, request_id: str, status: str, t: float) -> None:
            seen.append(("finished", status))

    async with omni_trio.open_engine(scripted_pipeline(2, outputs=2)) as engine:
        old = Old()
        engine.add_observer(old)  # type: ignore[arg-type]
        await engine.generate(PROMPT, request_id="o").collect()
        engine.remove_observer(old)  # type: ignore[arg-type]
        assert not engine.orchestrator.observers
    assert seen[0] == ("started", "o") and seen[-1] == ("finished", "finished")
    assert sorted(seen[1:-1]) == [("stage", "s0", "finished"), ("stage", "s1", "finished")]


class _Raising(RequestTracer):
    """A tracer with a bug: its third stage output raises."""

    calls = 0

    def stage_delta(self, request_id: str, stage_id: str, output: object, t: float) -> None:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("a bug in the tracer")
        super().stage_delta(request_id, stage_id, output, t)


@pytest.mark.parametrize("how", ["raises", "removed"])
async def test_a_detached_tracer_ends_the_spans_it_held_open(autojump_clock, how):
    cfg = scripted_pipeline(2, outputs=4, latency_s=0.1, stream_input=True)
    async with omni_trio.open_engine(cfg) as engine:
        t = traced_engine(engine)
        engine.remove_observer(t.tracer)  # a detach with nothing open ends nothing
        assert t.spans() == ()
        tracer = _Raising(engine.config, t.tracer._provider)
        engine.add_observer(tracer)
        async with engine.generate(PROMPT, request_id="d") as stream:
            outs = [await stream.receive()]
            if how == "removed":
                assert tracer.open_spans == 3
                engine.remove_observer(tracer)
            outs += [out async for out in stream]
        # the request is unaffected by its tracer going
        assert outs[-1].finished and len(outs) == 4
        assert not engine.orchestrator.observers
        assert_nothing_in_flight(engine)
    assert tracer.open_spans == 0
    t.check_ended()
    root, stages = t.of("d")
    assert len(stages) == 2
    for span in (root, *stages):
        assert attr(span, "tracing.detached") is True
    assert attr(root, "request.outcome") is None
