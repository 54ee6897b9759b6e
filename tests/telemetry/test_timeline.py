"""The timeline (telemetry/timeline.py): the stage runs of requests and the start-up phases
as Chrome trace events. Scripted stages on the MockClock, the observers on the trio clock
(exact times)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import pytest
import trio

import omni_trio
from omni_trio.cli.main import main
from omni_trio.telemetry.timeline import (
    RequestRecord,
    StageRun,
    TimelineRecorder,
    chrome_trace,
    record_timeline,
)
from omni_trio.testing import assert_nothing_in_flight, scripted_pipeline

from ..cli.test_main import pipeline

PROMPT = [10, 20, 30, 40]


def slices(trace: dict[str, object]) -> dict[tuple[int, int], list[dict[str, object]]]:
    """The X events per (pid, tid)."""
    events = trace["traceEvents"]
    assert isinstance(events, list)
    out: dict[tuple[int, int], list[dict[str, object]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            out[(e["pid"], e["tid"])].append(e)
    return out


def names(trace: dict[str, object], kind: str) -> dict[tuple[int, int], str]:
    events = trace["traceEvents"]
    assert isinstance(events, list)
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == kind}


async def test_every_stage_of_every_request_is_in_the_file(autojump_clock, tmp_path):
    # three stages streaming into each other: thinker, talker and vocoder overlap
    cfg = scripted_pipeline(3, outputs=4, latency_s=0.1, stream_input=True)
    async with omni_trio.open_engine(cfg) as engine:
        engine.orchestrator.observers.clock = trio.current_time
        recorder = record_timeline(engine)
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(engine.generate(PROMPT, request_id=f"r{i}").collect)
        async with engine.generate(PROMPT, request_id="aborted") as stream:
            await stream.receive()
        assert_nothing_in_flight(engine)
        assert recorder.requests_in_flight == 0
        path = tmp_path / "timeline.json"
        n = recorder.write(path)
    trace = json.loads(path.read_text())
    assert len(trace["traceEvents"]) == n
    assert {e["ph"] for e in trace["traceEvents"]} <= {"X", "M", "i"}
    processes = names(trace, "process_name")
    requests = {name: pid for (pid, _), name in processes.items() if pid}
    assert sorted(requests) == [f"request {r}" for r in ("aborted", "r0", "r1", "r2")]
    assert processes[(0, 0)] == "start-up"
    threads = names(trace, "thread_name")
    by_slice = slices(trace)
    for name, pid in requests.items():
        assert [threads[(pid, tid)] for tid in range(4)] == ["request", "s0", "s1", "s2"]
        (request,) = by_slice[(pid, 0)]
        outcome = "aborted" if name == "request aborted" else "finished"
        assert request["args"]["outcome"] == outcome
        for tid in (1, 2, 3):
            stage = by_slice[(pid, tid)][0]
            assert stage["name"] == f"s{tid - 1}" and stage["args"]["replica"] == 0
            assert stage["args"]["outcome"] == outcome
            assert request["ts"] <= stage["ts"]
            assert stage["ts"] + stage["dur"] <= request["ts"] + request["dur"] + 1e-3
    # exact times on the trio clock: s2 of r0 gets its first input after s0's and s1's first
    # outputs (0.1 s each), emits 4 outputs 0.1 s apart, and ends with the request at 0.6 s
    r0 = requests["request r0"]
    s2, waiting = by_slice[(r0, 3)]
    assert waiting["name"] == "waiting for input"
    assert waiting["dur"] == pytest.approx(200_000, abs=1)
    assert s2["args"]["time_to_first_output_s"] == pytest.approx(0.3)
    assert s2["args"]["outputs"] == 4
    assert by_slice[(r0, 0)][0]["dur"] == pytest.approx(600_000, abs=1)
    # the start-up: one thread per replica, a slice per phase
    startup = [threads[(0, tid)] for (pid, tid) in threads if pid == 0]
    assert sorted(startup) == ["s0[0]", "s1[0]", "s2[0]"]
    phases = {e["name"] for e in by_slice[(0, 1)]}
    assert "ready" in phases and "s0[0] start-up" in phases


def test_chrome_trace_is_pure_and_keeps_the_route_order():
    rec = RequestRecord("x", 10.0, ("a", "b"), ended=12.0, status="finished")
    # b's events came first: its thread is still the second
    rec.stages["b"] = StageRun("b", 10.0, ended=12.0, status="finished", first_input=11.0)
    rec.stages["a"] = StageRun(
        "a",
        10.0,
        ended=11.0,
        status="finished",
        replica=1,
        bound=10.5,
        replica_wait_s=0.5,
        first_output=10.75,
        outputs=2,
    )
    startup = {"a": [{"start": 9.0, "engine_ready": 9.5}]}
    trace = chrome_trace([rec], startup)
    assert trace == chrome_trace([rec], startup)
    threads = names(trace, "thread_name")
    assert (threads[(1, 1)], threads[(1, 2)]) == ("a", "b")
    by_slice = slices(trace)
    a, wait = by_slice[(1, 1)]
    assert (a["ts"], a["dur"], a["args"]["replica"]) == (1e6, 1e6, 1)
    assert (wait["name"], wait["ts"], wait["dur"]) == ("waiting for a replica", 1e6, 5e5)
    assert [(e["name"], e["ts"], e["dur"]) for e in by_slice[(0, 1)]] == [
        ("a[0] start-up", 0.0, 5e5),
        ("engine_ready", 0.0, 5e5),
    ]


def test_the_recorder_keeps_the_most_recent_requests():
    recorder = TimelineRecorder(max_requests=2)
    info = omni_trio.observer.RequestInfo(stages=("a",), output_stages=("a",))
    for i in range(5):
        recorder.request_info(f"r{i}", info, float(i))
        recorder.stage_started(f"r{i}", "a", float(i))
        recorder.request_finished(f"r{i}", "aborted", i + 0.5)
    assert [r.request_id for r in recorder.done] == ["r3", "r4"]
    # a stage still open when its request ended ends with it
    assert recorder.done[-1].stages["a"].status == "aborted"
    with pytest.raises(ValueError, match="max_requests"):
        TimelineRecorder(max_requests=0)


def test_run_writes_the_timeline_file(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["run", pipeline(tmp_path), "--prompt", "hi", "--timeline", str(out)]) == 0
    assert f"in {out}" in capsys.readouterr().out
    trace = json.loads(out.read_text())
    threads = set(names(trace, "thread_name").values())
    assert {"request", "a", "b", "a[0]", "b[0]"} <= threads
    # a file that cannot be written is refused before anything starts
    missing = tmp_path / "missing" / "out.json"
    assert main(["run", pipeline(tmp_path), "--prompt", "hi", "--timeline", str(missing)]) == 2
    assert "--timeline" in capsys.readouterr().err and not missing.parent.exists()


def test_the_readme_picture_is_drawn_from_the_file(tmp_path, monkeypatch):
    # docs/render_timeline.py: the file's rows and panels (pure), then a PNG of them
    pytest.importorskip("PIL")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "render_timeline.py"
    spec = importlib.util.spec_from_file_location("render_timeline", path)
    assert spec is not None and spec.loader is not None
    render = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, render)  # its dataclasses look it up
    spec.loader.exec_module(render)
    rec = RequestRecord("x", 10.0, ("a", "b"), ended=12.0, status="finished")
    rec.stages["a"] = StageRun("a", 10.0, ended=11.0, status="finished", first_output=10.5)
    rec.stages["b"] = StageRun("b", 10.0, ended=12.0, status="finished", first_input=11.0)
    trace = chrome_trace([rec], {"a": [{"start": 9.0, "engine_ready": 9.5}]})
    startup, requests = render.layout(trace["traceEvents"])
    assert [r.label for r in startup.rows] == ["a[0]"]
    assert [r.label for r in requests.rows] == ["x  a", "x  b"]
    assert (requests.start, requests.end) == (1.0, 3.0)  # seconds from the earliest mark
    assert requests.rows[0].ticks == [1.5]
    assert ("waiting for input", 1.0, 2.0) in requests.rows[1].slices
    out = tmp_path / "t.png"
    assert render.main([str(_write(tmp_path, trace)), str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")


def _write(tmp_path, trace):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    return path
