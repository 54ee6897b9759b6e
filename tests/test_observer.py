"""Engine observers (observer.py): which hooks run, in which order, and what an observer
that needs no routing (``routes_stages = False``: the tracer, the timeline) changes about
how requests run: nothing. Scripted stages on the MockClock, the observers on its clock."""

from __future__ import annotations

import pytest
import trio

import omni_trio
from omni_trio.observer import EngineObserver, ObserverSet, RequestInfo, Transfer
from omni_trio.outputs import StageOutput
from omni_trio.testing import assert_nothing_in_flight, scripted_pipeline

PROMPT = [10, 20, 30, 40]


class Recorder(EngineObserver):
    """Every event, with its trio-clock time."""

    routes_stages = False

    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []

    def request_info(self, request_id: str, info: RequestInfo, t: float) -> None:
        self.events.append(("info", request_id, info.stages, t))

    def stage_started(self, request_id: str, stage_id: str, t: float) -> None:
        self.events.append(("started", stage_id, t))

    def stage_bound(
        self, request_id: str, stage_id: str, replica: int, waited_s: float, t: float
    ) -> None:
        self.events.append(("bound", stage_id, replica, t))

    def stage_output(self, request_id: str, stage_id: str, first: bool, t: float) -> None:
        self.events.append(("output", stage_id, first, t))

    def stage_delta(self, request_id: str, stage_id: str, output: object, t: float) -> None:
        assert isinstance(output, StageOutput)
        self.events.append(("delta", stage_id, output.token_ids))

    def transfer_sent(self, request_id: str, transfer: Transfer, t: float) -> None:
        self.events.append(("transfer", transfer.source, transfer.target, transfer.tokens, t))

    def stage_finished(self, request_id: str, stage_id: str, status: str, t: float) -> None:
        self.events.append(("finished", stage_id, status, t))

    def of(self, stage_id: str) -> list[tuple[object, ...]]:
        return [e for e in self.events if e[1] == stage_id]


class Routed(Recorder):
    routes_stages = True


@pytest.mark.parametrize("observer", [Recorder, Routed])
async def test_a_stage_taking_whole_input_starts_when_it_is_complete_unless_routed(
    autojump_clock, observer
):
    cfg = scripted_pipeline(2, outputs=4, latency_s=1.0)
    async with omni_trio.open_engine(cfg) as engine:
        engine.orchestrator.observers.clock = trio.current_time
        rec = observer()
        engine.add_observer(rec)
        t0 = trio.current_time()
        async with engine.generate(PROMPT, request_id="r") as stream:
            await trio.sleep(2.5)  # s0 is half way
            # a routing observer binds every stage at once; the recorder changes nothing
            assert engine.pools["s1"].requests_in_flight == int(observer is Routed)
            outs = [o async for o in stream]
        assert [o.token_ids[0] for o in outs] == [t + 2 for t in PROMPT]
        assert_nothing_in_flight(engine)
    s1 = rec.of("s1")
    started = t0 + (4.0 if observer is Recorder else 0.0)
    assert s1[0] == ("started", "s1", started)
    assert s1[1] == ("bound", "s1", 0, started)
    # s1 is an output stage feeding nothing: without routing its outputs are reported when
    # it ended, the first one with the time it came
    assert [e[:3] for e in s1[2:]][:1] == [("output", "s1", True)]
    assert s1[2][3] == t0 + 5.0
    assert [e[2] for e in s1 if e[0] == "delta"] == [(t + 2,) for t in PROMPT]
    assert s1[-1] == ("finished", "s1", "finished", t0 + 8.0)
    # s0's whole output was handed to s1 (4 tokens) as it started
    assert ("transfer", "s0", "s1", 4, t0 + 4.0) in rec.events


async def test_every_path_reports_its_stage_once_with_its_outcome(autojump_clock):
    # s0 collected (nobody streams it), s1 routed (an output stage feeding s2), s2 pulled
    cfg = scripted_pipeline(3, outputs=3, latency_s=0.1, final_outputs=["s1", "s2"])
    async with omni_trio.open_engine(cfg) as engine:
        rec = Recorder()
        engine.add_observer(rec)
        await engine.generate(PROMPT, request_id="r").collect()
        async with engine.generate(PROMPT, request_id="a") as stream:
            await stream.receive()  # s1's first output: s0 finished, s1 runs, s2 not started
        assert_nothing_in_flight(engine)
    finished = [(e[1], e[2]) for e in rec.events if e[0] == "finished"]
    assert finished == [
        ("s0", "finished"),
        ("s1", "finished"),
        ("s2", "finished"),
        ("s0", "finished"),
        ("s1", "aborted"),
    ]
    starts = [e[1] for e in rec.events if e[0] == "started"]
    assert starts == ["s0", "s1", "s2", "s0", "s1"]


def test_an_observer_that_raises_is_detached_and_routing_follows_the_set():
    observers = ObserverSet(clock=lambda: 1.0)
    assert not observers.routes

    class Bad(EngineObserver):
        routes_stages = False

        def request_started(self, request_id: str, t: float) -> None:
            raise RuntimeError("a bug in the observer")

    bad, plain = Bad(), EngineObserver()
    observers.add(bad)
    assert observers and not observers.routes
    observers.add(plain)
    assert observers.routes  # an observer from before: every stage routed, as it expects
    observers.emit("request_started", "r")
    assert len(observers) == 1 and observers.routes
    observers.remove(plain)
    assert not observers and not observers.routes
