"""benchmarks/bench_sessions.py: its pure summaries (rates against the base system pass by pass,
barge-in percentiles and ratios, first-audio pairs), the watch each response is read into, its
in-process drivers on scripted stages under MockClock (every system of a rate cell, barge-ins
and aborts cut where asked, nothing left behind), and the script in its quick mode without the
tiny-omni part (slow: the real clock, a real server): it exits 0 and its JSON holds together."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from omni_trio import open_engine

from .conftest import run_bounded

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_sessions.py"

# the benchmark is a script with sibling modules, not a package: import it from its directory
sys.path.insert(0, str(ROOT / "benchmarks"))
bench = importlib.import_module("bench_sessions")
cells = importlib.import_module("harness.session_cells")


def _watch(t0: float = 10.0, **at: float) -> Any:
    watch = cells.Watch("thinker", "code2wav", t0=t0)
    watch.at.update(at)
    return watch


def test_a_watch_stamps_each_milestone_once_from_its_stages() -> None:
    watch = _watch()
    watch.output("talker", "x", (1,), [0.0] * 4)  # neither the text nor the audio stage
    watch.output("thinker", "", (), None)  # an empty text delta
    assert watch.at == {} and watch.outputs == 2
    watch.output("thinker", "a", (5,), None)
    first = watch.at["first_text"]
    watch.output("thinker", "b", (6,), None)
    watch.output("code2wav", "", (), [])  # no samples
    assert "first_audio" not in watch.at
    watch.output("code2wav", "", (), [0.1, 0.2])
    assert watch.at["first_text"] == first and watch.text_ids == [5, 6]
    assert watch.audio_samples == 2 and watch.events["first_audio"].is_set()
    watch.end("completed")
    assert "cancelled" not in watch.at and watch.events["ended"].is_set()
    cut = _watch()
    cut.end("cancelled")
    assert cut.at["cancelled"] == cut.at["ended"] and cut.status == "cancelled"
    assert _watch(first_text=10.5).since("first_text") == 0.5
    assert _watch(ended=12.0).since("ended", 11.0) == 1.0 and _watch().since("ended") is None


def test_a_cut_must_end_cancelled() -> None:
    watch = _watch(cancelled=11.0, ended=11.5)
    watch.status = "cancelled"
    cut = cells.cut_of(watch, 10.5, 12.0, 3)
    assert (cut.to_cancelled_s, cut.to_ended_s, cut.to_return_s) == (0.5, 1.0, 1.5)
    watch.status = "completed"
    with pytest.raises(AssertionError, match="ended 'completed', not cancelled"):
        cells.cut_of(watch, 10.5, 12.0, 3)


def test_rates_are_paired_with_the_base_system_pass_by_pass() -> None:
    run = cells.RateRun
    runs = [  # two passes, the systems' order rotated
        run("one_shot", 100, 1.0, 0.5),
        run("session", 100, 2.0, 1.5),
        run("session", 100, 1.0, 1.0),
        run("one_shot", 100, 0.5, 0.5),
    ]
    cell = bench.rate_cell(4, runs, "one_shot")
    assert cell["concurrency"] == 4 and cell["ops"] == 100
    base, session = cell["systems"]["one_shot"], cell["systems"]["session"]
    assert base["ops_per_s"] == {"median": 150.0, "min": 100.0, "max": 200.0}
    assert base["cpu_us_per_op"] == 5000.0 and "rate_vs_one_shot" not in base
    # per pass: 50/100 and 100/200 requests per second; 15/5 and 10/5 ms per op
    assert session["rate_vs_one_shot"] == {"median": 0.5, "min": 0.5, "max": 0.5}
    assert session["cpu_vs_one_shot"] == {"median": 2.5, "min": 2.0, "max": 3.0}
    assert bench.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_barge_in_and_first_audio_summaries_compare_p50s() -> None:
    session = [cells.Cut(0.001 * k, 0.001 * k, 0.01, 1) for k in range(1, 102)]
    one_shot = [cells.Cut(0.004, 0.005, 0.02, 2)] * 3
    summary = bench.barge_summary(session, one_shot)
    assert summary["session"]["runs"] == 101
    assert summary["session"]["to_cancelled_ms"] == {
        "p50": pytest.approx(51.0),
        "p99": pytest.approx(100.0),
    }
    assert summary["one_shot"]["outputs_before_cut"] == 2
    assert summary["ratios"]["to_cancelled_ms"] == pytest.approx(4 / 51)
    assert summary["ratios"]["to_return_ms"] == pytest.approx(2.0)

    def side(first_audio: float, ended: float | None, ids: list[int]) -> Any:
        watch = _watch(first_text=10.1, first_audio=10.0 + first_audio)
        if ended is not None:
            watch.at["ended"] = ended
        watch.text_ids = ids
        return watch

    runs = {
        "session": [side(0.2, 11.0, [1, 2]), side(0.4, 11.0, [1, 2])],
        "one_shot": [side(0.4, None, [1, 2]), side(0.8, None, [1, 2])],
        "one_shot_streaming_input": [side(0.3, 12.0, [1, 2])],
    }
    out = bench.first_audio_summary(runs)
    assert out["runs"] == 2 and out["session"]["first_audio_s"]["p50"] == pytest.approx(0.3)
    assert out["ratios"]["one_shot"]["first_audio_s"] == pytest.approx(2.0)
    assert out["ratios"]["one_shot_streaming_input"]["ended_s"] == pytest.approx(2.0)
    assert out["one_shot"]["ended_s"] == {"p50": None, "p90": None, "n": 0}
    assert out["ratios"]["one_shot"]["ended_s"] is None and out["same_text_tokens"] is True
    runs["one_shot"][1].text_ids = [1, 3]
    assert bench.first_audio_summary(runs)["same_text_tokens"] is False


async def test_every_driver_runs_on_scripted_stages_and_leaves_nothing(autojump_clock):
    async with open_engine(bench.scripted_config(4)) as engine:
        for system in cells.RATE_SYSTEMS:
            result = await cells.rate_run(engine, system, bench.PROMPT, 5, 2, 60)
            assert (result.system, result.ops) == (system, 5)
        assert engine.statistics().sessions == engine.statistics().requests_in_flight == 0
    cfg = bench.scripted_config(50, 0.01, abort_delay_s=0.5)
    async with open_engine(cfg) as engine:
        cuts = await cells.barge_ins(engine, bench.PROMPT, None, "first_text", 3, 60)
        assert [c.outputs_before for c in cuts] == [1, 1, 1]
        aborted = await cells.aborts(engine, bench.PROMPT, None, "first_text", 2, 60, "t")
        assert len(aborted) == 2
        # each response was cut at its first delta, its stages dropped it, nothing is left
        stats = engine.statistics()
        assert stats.sessions == stats.requests_in_flight == 0
        runs = await cells.first_audio_runs(engine, bench.PROMPT, None, 2, 60)
        # every side twice; no audio stage: no first audio; every side streamed the same
        assert {side: len(watches) for side, watches in runs.items()} == {
            side: 2 for side in cells.FIRST_AUDIO_SIDES
        }
        watches = [w for side in runs.values() for w in side]
        assert all(w.status == "completed" and w.audio_samples == 0 for w in watches)
        assert all(w.text_ids == watches[0].text_ids != [] for w in watches)


def test_parts_and_quick_mode() -> None:
    quick = bench.parse_args(["--quick", "--skip-vllm"])
    assert quick.parts == ["rates", "barge_in", "websocket"]
    assert (quick.passes, quick.sessions, quick.concurrency) == (1, 20, [1, 4])
    assert bench.parse_args(["--parts", "tiny_omni", "--skip-ws"]).parts == ["tiny_omni"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--parts", "nope"])


@pytest.mark.slow
def test_the_quick_run_without_vllm_reports_every_part() -> None:
    args = [sys.executable, str(SCRIPT), "--quick", "--skip-vllm"]
    done = run_bounded(args, 300, "bench_sessions.py --quick --skip-vllm to end")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["benchmark"] == "sessions" and "tiny_omni" not in result
    for part, systems, base in (
        ("rates", cells.RATE_SYSTEMS, "one_shot"),
        ("websocket", ("http_one_shot", "ws_one_turn", "ws_open_close"), "http_one_shot"),
    ):
        assert [c["concurrency"] for c in result[part]] == [1, 4], part
        for cell in result[part]:
            assert set(cell["systems"]) == set(systems), part
            for name, figures in cell["systems"].items():
                assert figures["ops_per_s"]["median"] > 0 and figures["cpu_us_per_op"] > 0
                assert ("rate_vs_" + base in figures) == (name != base), (part, name)
    for variant in ("scripted", "scripted_slow_abort"):
        cut = result["barge_in"][variant]
        for side in ("session", "one_shot"):
            assert cut[side]["runs"] == 10, (variant, side)
            for key in ("to_cancelled_ms", "to_ended_ms", "to_return_ms"):
                assert 0 < cut[side][key]["p50"] <= cut[side][key]["p99"], (variant, side, key)
        assert all(r > 0 for r in cut["ratios"].values())
    # stages whose abort takes 20 ms: every side's cut call waits for it
    slow = result["barge_in"]["scripted_slow_abort"]
    assert slow["session"]["to_return_ms"]["p50"] >= 20
    assert slow["one_shot"]["to_return_ms"]["p50"] >= 20
