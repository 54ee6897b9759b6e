"""The pure helpers of benchmarks/bench_vllm_pipeline.py and its harness/vllm_* modules: cell
planning, layouts, the pipeline config, the stop breakdown, and how per-pass results become
ratios, spreads and the summary (no vLLM here)."""

from __future__ import annotations

import importlib
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from omni_trio.backends.vllm.protocol import CPU_ENGINE_DEFAULTS
from omni_trio.config.options import VllmOptions, parse_options

ROOT = Path(__file__).resolve().parent.parent

# the benchmark is a script with sibling modules, not a package: import them from its directory
sys.path.insert(0, str(ROOT / "benchmarks"))
bench = importlib.import_module("bench_vllm_pipeline")
pipeline_cells = importlib.import_module("harness.vllm_cells")
procs = importlib.import_module("harness.vllm_procs")
summary = importlib.import_module("harness.vllm_summary")


def test_plan_runs_pairs_systems_per_cell_and_alternates_who_goes_first() -> None:
    runs = pipeline_cells.plan_runs(2, [1, 3], ["core0", "spread"], ["hand", "omni"])
    assert len(runs) == 2 * 2 * 2 * 2
    cells = [(r.pass_index, r.n_stages, r.layout) for r in runs]
    # the two systems of a cell run back to back
    assert all(cells[i] == cells[i + 1] for i in range(0, len(runs), 2))
    firsts: dict[int, set[str]] = {r.pass_index: set() for r in runs}
    for i in range(0, len(runs), 2):
        firsts[runs[i].pass_index].add(runs[i].system)
    assert firsts == {0: {"hand"}, 1: {"omni"}}
    assert [(r.n_stages, r.layout) for r in runs[:8:2]] == [
        (1, "core0"),
        (1, "spread"),
        (3, "core0"),
        (3, "spread"),
    ]


def test_layouts_bind_every_engine_to_core0_or_one_core_per_stage() -> None:
    assert [pipeline_cells.bind_for("core0", k) for k in range(3)] == ["0", "0", "0"]
    assert [pipeline_cells.bind_for("spread", k) for k in range(3)] == ["0", "1", "0"]
    with pytest.raises(ValueError, match="layout must be one of"):
        pipeline_cells.bind_for("numa", 0)


def test_omni_config_chains_token_stages_with_only_the_last_as_output() -> None:
    cfg = pipeline_cells.omni_config(3, "spread", tokens=16, requests=64)
    stages = cfg["stages"]
    assert [s["id"] for s in stages] == ["stage1", "stage2", "stage3"]
    assert [s.get("inputs") for s in stages] == [None, ["stage1"], ["stage2"]]
    assert [s["final_output"] for s in stages] == [False, False, True]
    assert [s["options"]["cpu_bind"] for s in stages] == ["0", "1", "0"]
    assert [s["engine_args"] for s in stages] == [
        {**CPU_ENGINE_DEFAULTS, "model": m} for m in ("tiny:thinker", "tiny:talker", "tiny:talker")
    ]
    greedy = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    assert all(s["default_sampling_params"] == greedy for s in stages)
    # every engine's worker loop: asyncio unless asked (omni_ta: trio-asyncio)
    assert [s["options"]["loop"] for s in stages] == ["asyncio"] * 3
    ta = pipeline_cells.omni_config(2, "core0", 16, 64, pipeline_cells.OMNI_LOOPS["omni_ta"])
    assert [s["options"]["loop"] for s in ta["stages"]] == ["trio-asyncio"] * 2
    for k, stage in enumerate(ta["stages"]):  # valid vllm options, the loop included
        parse_options(VllmOptions, stage["options"], where=f"$.stages[{k}].options")


def _result(median_rps: float, cpu_ms: float, left: int = 0) -> dict[str, Any]:
    at_exit = [{"pid": 10 + i, "what": "x", "status": "zombie"} for i in range(left)]
    return {
        "requests_per_s": {"best": median_rps + 1, "median": median_rps},
        "cpu_ms_per_request_stage": cpu_ms,
        "cpu_split_ms": {"loop": cpu_ms / 2, "engine_threads": cpu_ms / 4, "other": cpu_ms / 4},
        "init_s": 30.0,
        "shutdown_s": 2.0,
        "tokens_ok": True,
        "leftover": {"at_exit": at_exit, "grace_s": 5.0, "after_grace": at_exit[:1]},
        "stop": {"close": 2.0, "gap": 0.5, "slowest_own_stop": 1.5, "engines": []},
    }


def test_cell_reports_median_ratio_spread_and_cpu_skipping_failed_passes() -> None:
    passes = [
        {"hand": _result(100, 2.0), "omni": _result(90, 3.0)},
        {"hand": _result(100, 2.0), "omni": _result(50, 5.0, left=2)},
        {"hand": {"error": "exit 1 without a result"}, "omni": _result(80, 4.0)},
        {"hand": _result(50, 1.0), "omni": _result(55, 1.0)},
    ]
    cell = summary.summarize_cell(2, "spread", passes, ["hand", "omni"])
    assert cell["ratio"] == {"median": 0.9, "min": 0.5, "max": 1.1}
    assert cell["cpu_ratio"]["median"] == pytest.approx(1.5)
    assert cell["requests_per_s"]["hand"] == [100, 100, None, 50]
    assert cell["cpu_ms_per_request_stage_median"] == {"hand": 2.0, "omni": 3.5}
    assert cell["errors"] == {"hand": ["exit 1 without a result"], "omni": []}
    assert [r["pass"] for r in cell["leftover"]["omni"]] == [1]
    row = summary.summary_row(cell)
    assert row == {
        "ratio": 0.9,
        "spread": [0.5, 1.1],
        "cpu_ms_hand": 2.0,
        "cpu_ms_omni": 3.5,
        "cpu_ratio": 1.5,
        # the median of each thread group over the passes where the system ran
        "cpu_ms_by_thread": {
            "hand": {"loop": 1.0, "engine_threads": 0.5, "other": 0.5},
            "omni": {"loop": 1.75, "engine_threads": 0.875, "other": 0.875},
        },
        "init_s": {"hand": 30.0, "omni": 30.0},
        "shutdown_s": {"hand": 2.0, "omni": 2.0},
        "slowest_own_stop_s": {"hand": 1.5, "omni": 1.5},
        "stop_gap_s": {"hand": 0.5, "omni": 0.5},
        "idle_cpu_s": {"hand": None, "omni": None},
        "left_at_exit": 2,
        "left_after_grace": 1,
        "failed_runs": 1,
    }


def test_one_system_only_has_no_ratio() -> None:
    cell = summary.summarize_cell(1, "core0", [{"omni": _result(90, 3.0)}], ["omni"])
    assert cell["ratio"] is None
    assert summary.summary_row(cell)["spread"] is None


def test_the_floors_are_compared_with_hand_and_only_when_they_ran() -> None:
    passes = [
        {"hand": _result(100, 2.0), "omni": _result(90, 3.0), "trio": _result(95, 2.4)},
        {"hand": _result(100, 2.0), "omni": _result(80, 3.0), "trio": {"error": "boom"}},
        {"hand": _result(50, 1.0), "omni": _result(45, 1.5), "trio": _result(50, 1.1)},
    ]
    shared = (_result(110, 1.8), _result(90, 2.2), _result(40, 1.2))
    for p, floor in zip(passes, shared, strict=True):
        p["shared"] = floor
    cell = summary.summarize_cell(2, "core0", passes, ["hand", "omni", "trio", "shared"])
    # each floor/hand over the passes where both ran; omni/hand as before
    assert cell["trio_ratio"] == {"median": 0.975, "min": 0.95, "max": 1.0}
    assert cell["trio_cpu_ratio"]["median"] == pytest.approx(1.15)
    assert cell["shared_ratio"] == {"median": 0.9, "min": 0.8, "max": 1.1}
    assert cell["shared_cpu_ratio"]["median"] == pytest.approx(1.1)
    assert cell["ratio"]["median"] == pytest.approx(0.9)
    row = summary.summary_row(cell)
    assert (row["cpu_ms_trio"], row["trio_ratio"], row["trio_cpu_ratio"]) == (1.75, 0.975, 1.15)
    assert (row["cpu_ms_shared"], row["shared_ratio"], row["shared_cpu_ratio"]) == (1.8, 0.9, 1.1)
    assert row["failed_runs"] == 1
    # without it, neither the cell nor its row mentions it
    two = summary.summarize_cell(
        1, "core0", [{k: p[k] for k in ("hand", "omni")} for p in passes], ["hand", "omni"]
    )
    assert "trio_ratio" not in two and "trio_ratio" not in summary.summary_row(two)
    assert "shared_ratio" not in two and "cpu_ms_shared" not in summary.summary_row(two)
    # they run only when asked for
    assert bench.parse_args([]).systems == ["hand", "omni"]
    assert bench.parse_args(["--systems", "hand,trio,shared"]).systems == ["hand", "trio", "shared"]


def test_the_trio_asyncio_loop_is_compared_with_hand_and_with_omni_run_for_run() -> None:
    passes = [
        {"hand": _result(100, 2.0), "omni": _result(90, 3.0), "omni_ta": _result(72, 5.1)},
        {"hand": _result(100, 2.0), "omni": {"error": "boom"}, "omni_ta": _result(70, 5.0)},
        {"hand": _result(50, 1.0), "omni": _result(50, 1.5), "omni_ta": _result(45, 2.4)},
    ]
    cell = summary.summarize_cell(2, "spread", passes, ["hand", "omni", "omni_ta"])
    assert cell["omni_ta_ratio"] == {"median": 0.72, "min": 0.7, "max": 0.9}
    assert cell["omni_ta_cpu_ratio"]["median"] == pytest.approx(2.5)
    # against omni over the passes where both ran: 72/90 and 45/50; CPU 5.1/3 and 2.4/1.5
    assert cell["loop_ratio"] == {
        "median": pytest.approx(0.85),
        "min": pytest.approx(0.8),
        "max": pytest.approx(0.9),
    }
    assert cell["loop_cpu_ratio"]["median"] == pytest.approx(1.65)
    row = summary.summary_row(cell)
    assert (row["cpu_ms_omni_ta"], row["omni_ta_ratio"], row["omni_ta_cpu_ratio"]) == (
        5.0,
        0.72,
        2.5,
    )
    assert (row["loop_ratio"], row["loop_cpu_ratio"]) == (0.85, 1.65)
    # without omni_ta, no loop comparison
    plain = summary.summarize_cell(
        2, "spread", [{k: p[k] for k in ("hand", "omni")} for p in passes], ["hand", "omni"]
    )
    assert "loop_ratio" not in plain and "loop_ratio" not in summary.summary_row(plain)
    assert "cpu_ms_omni_ta" not in summary.summary_row(plain)
    assert bench.parse_args(["--systems", "hand,omni,omni_ta"]).systems == [
        "hand",
        "omni",
        "omni_ta",
    ]


def test_throughput_and_cpu_per_request_stage() -> None:
    assert summary.batch_throughput([0.5, 0.25, 1.0], 64) == {"best": 256.0, "median": 128.0}
    # 0.96 s of CPU over 64 requests x 3 batches x 2 stages
    assert summary.cpu_ms_per_request_stage(0.96, 64, 3, 2) == pytest.approx(2.5)


def test_cli_rejects_an_unknown_layout_or_stage_count() -> None:
    assert bench.parse_args(["--stages", "1,3", "--layouts", "spread"]).stages == [1, 3]
    for argv in (["--stages", "4"], ["--layouts", "core1"], ["--systems", "vllm-omni"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


def test_stop_breakdown_times_each_engine_from_its_own_begin_to_its_last_process_exit() -> None:
    # engine A (core 10, worker 11) begins 0.1 s into the close, its worker exits at 0.9 and
    # its core at 1.4; engine B (core 20, worker 21) begins at 0.2 and is gone at 1.9; the
    # close returns at 2.5
    groups = {10: [10, 11], 20: [20, 21]}
    phases = [("begin", (10,), 100.1), ("begin", (20,), 100.2), ("end", (10,), 101.45)]
    phases.append(("end", (20,), 101.95))
    exited = {11: 100.9, 10: 101.4, 21: 101.8, 20: 101.9}
    stops = procs.engine_stops(groups, phases, exited)
    assert [(s["core_pid"], s["processes"], s["gone"]) for s in stops] == [
        (10, 2, 101.4),
        (20, 2, 101.9),
    ]
    report = procs.stop_breakdown(100.0, 102.5, stops)
    a, b = report["engines"]
    assert a["began"] == pytest.approx(0.1) and a["own_stop"] == pytest.approx(1.3)
    assert a["call"] == pytest.approx(1.35) and a["gone"] == pytest.approx(1.4)
    assert b["own_stop"] == pytest.approx(1.7)
    assert report["close"] == pytest.approx(2.5)
    assert report["slowest_own_stop"] == pytest.approx(1.7)
    assert report["gap"] == pytest.approx(0.8)  # close minus the slowest own stop
    assert report["before_first_stop"] == pytest.approx(0.1)
    assert report["after_last_gone"] == pytest.approx(0.6)


def test_stop_breakdown_leaves_out_what_it_cannot_know() -> None:
    # the stop of core 20 was never logged, and its worker was never seen to exit
    groups = {10: [10, 11], 20: [20, 21]}
    stops = procs.engine_stops(groups, [("begin", (10,), 1.0)], {10: 2.0, 11: 1.5, 20: 2.1})
    report = procs.stop_breakdown(0.5, 3.0, stops)
    assert [e["own_stop"] for e in report["engines"]] == [pytest.approx(1.0), None]
    assert report["slowest_own_stop"] is None and report["gap"] is None
    assert report["before_first_stop"] is None and report["after_last_gone"] is None
    assert procs.stop_breakdown(0.0, 1.0, [])["gap"] is None  # no engine at all


def test_idle_cpu_is_the_difference_of_two_snapshots() -> None:
    before = {"frontend": 1.0, "engines": {10: 5.0, 20: 7.0}}
    after = {"frontend": 1.002, "engines": {10: 5.5, 20: 7.0}}
    idle = procs.idle_cpu(before, after, 10.0)
    assert idle["seconds"] == 10.0
    assert idle["frontend_cpu_s"] == pytest.approx(0.002)
    assert idle["engines_cpu_s"] == {"10": pytest.approx(0.5), "20": 0.0}
    # a cell: the median over passes of the frontend's and of all engines' idle CPU
    cell = summary.summarize_cell(
        2,
        "core0",
        [{"omni": {**_result(90, 3.0), "idle": i}} for i in (idle, idle, None)],
        ["omni"],
    )
    assert summary.summary_row(cell)["idle_cpu_s"] == {
        "omni": {"seconds": 10.0, "frontend": pytest.approx(0.002), "engines": pytest.approx(0.5)}
    }


def _stop_result(gap: float | None, slowest: float | None) -> dict[str, Any]:
    stop = {"close": 2.0, "gap": gap, "slowest_own_stop": slowest, "engines": []}
    return {**_result(100, 2.0), "stop": stop}  # replaces _result's


def test_cell_reports_median_stop_gap_and_slowest_own_stop() -> None:
    passes = [
        {"omni": _stop_result(0.1, 1.5)},
        {"omni": _stop_result(0.3, 2.5)},
        {"omni": _stop_result(None, None)},
    ]
    cell = summary.summarize_cell(2, "core0", passes, ["omni"])
    assert [s["gap"] for s in cell["stop"]["omni"]] == [0.1, 0.3, None]
    row = summary.summary_row(cell)
    assert row["stop_gap_s"] == {"omni": pytest.approx(0.2)}
    assert row["slowest_own_stop_s"] == {"omni": pytest.approx(2.0)}


@pytest.mark.slow
def test_exit_watch_sees_a_process_exit_when_it_happens() -> None:
    import subprocess
    import time

    short = subprocess.Popen(["sleep", "0.2"])
    long = subprocess.Popen(["sleep", "30"])
    t0 = time.monotonic()
    watch = procs.ExitWatch([short.pid, long.pid])
    short.wait()  # reaped: the exit was still seen
    t_reaped = time.monotonic()
    try:
        exited = watch.close(wait=0.5)  # gives up on the long one
    finally:
        long.kill()
        long.wait()
    assert list(exited) == [short.pid]
    assert t0 < exited[short.pid] <= t_reaped + 0.1


def test_thread_cpu_tells_the_main_loop_from_omni_trios_engine_threads() -> None:
    from omni_trio.backends.vllm.backend import THREAD_PREFIX

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    burnt, done = threading.Event(), threading.Event()

    def engine_thread() -> None:  # alive at both snapshots, as a stage's thread is
        burn(0.2)
        burnt.set()
        done.wait()

    engine = threading.Thread(target=engine_thread, name=f"{THREAD_PREFIX}-a[0]")
    other = threading.Thread(target=burn, args=(0.1,), name="someone-else")
    before = procs.thread_cpu()
    engine.start()
    other.start()
    other.join()  # ended: its time is counted in "other"
    burnt.wait()
    burn(0.1)  # the main thread's own
    after = procs.thread_cpu()
    done.set()
    engine.join()
    split = summary.cpu_split_ms_per_request_stage(before, after, 10, 2, 1)  # ms per 20
    assert split["engine_threads"] == pytest.approx(200 / 20, rel=0.25)
    assert split["other"] == pytest.approx(100 / 20, rel=0.5)
    assert split["loop"] == pytest.approx(100 / 20, rel=0.5)


def test_tracing_on_is_compared_with_omni_run_for_run() -> None:
    passes = [
        {"omni": _result(100, 2.0), "omni_traced": _result(98, 2.1)},
        {"omni": {"error": "boom"}, "omni_traced": _result(50, 9.0)},
        {"omni": _result(50, 1.0), "omni_traced": _result(50, 1.0)},
    ]
    cell = summary.summarize_cell(3, "spread", passes, ["omni", "omni_traced"])
    # over the passes where both ran: 98/100 and 50/50; CPU 2.1/2.0 and 1.0/1.0
    assert cell["tracing_ratio"] == {"median": 0.99, "min": 0.98, "max": 1.0}
    assert cell["tracing_cpu_ratio"]["median"] == pytest.approx(1.025)
    row = summary.summary_row(cell)
    assert (row["tracing_ratio"], row["tracing_cpu_ratio"]) == (0.99, 1.025)
    assert bench.parse_args(["--systems", "omni,omni_traced"]).systems == ["omni", "omni_traced"]
    plain = summary.summarize_cell(3, "spread", [{"omni": p["omni"]} for p in passes], ["omni"])
    assert "tracing_ratio" not in plain


def test_tracing_ab_alternates_abba_and_reports_on_over_off(monkeypatch) -> None:
    import types

    import trio

    assert pipeline_cells.ab_order(3) == [False, True, True, False, False, True]
    child = importlib.import_module("harness.vllm_child")
    modes: list[bool] = []
    now = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0], process_time=time.process_time)
    monkeypatch.setattr(child, "time", clock)

    async def batch(tag: str) -> list[int]:
        if tag != "warm":
            now[0] += 2.0 if modes[-1] else 1.0  # a traced batch takes twice as long
        return [4] * 2

    a = bench.parse_args(["--requests", "2", "--tokens", "4", "--batches", "2"])
    a.child_stages = 1
    timing = trio.run(child.run_ab_batches, batch, modes.append, a)
    # two of each mode, tracing off again at the end
    assert modes == [False, True, True, False, False]
    assert timing["tokens_ok"] and timing["walls"] == [1.0, 2.0, 2.0, 1.0]
    ab = timing["ab"]
    assert ab["ratio"] == 0.5
    assert (ab["on"]["requests_per_s"]["median"], ab["off"]["requests_per_s"]["median"]) == (1, 2)
    assert set(ab["off"]["cpu_split_ms"]) == {"loop", "engine_threads", "other"}
    # the summary: its on/off ratios over the passes, and the loop's CPU per mode
    result = {**_result(50, 1.0), "ab": ab}
    cell = summary.summarize_cell(1, "spread", [{"tracing_ab": result}] * 2, ["tracing_ab"])
    assert cell["tracing_ab_ratio"]["median"] == 0.5
    row = summary.summary_row(cell)
    assert row["tracing_ab_ratio"] == 0.5
    assert set(row["tracing_ab_loop_ms"]) == {"off", "on"}
    run = pipeline_cells.Run(0, 1, "spread", "tracing_ab")
    assert "tracing on/off 0.500" in summary.describe(run, result)
