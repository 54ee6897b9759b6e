"""benchmarks/bench_qwen_omni.py: its pure helpers (percentiles, the cell order, generate()'s
codes as the talker streams them, the check against generate()'s replies, a cell's figures
and the ratios), and the script in its quick mode on the real pipeline and transformers
(slow, vllm): it exits 0 and its JSON holds together."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import run_bounded

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_qwen_omni.py"

# the benchmark is a script with sibling modules, not a package: import it from its directory
sys.path.insert(0, str(ROOT / "benchmarks"))
bench = importlib.import_module("bench_qwen_omni")


def _reply(prompt: int = 0, *, latency: float = 1.0, first: float | None = 0.25, **kw: Any) -> Any:
    fields = {"thinker_ids": [5, 6, 7], "codes": list(range(32)), "audio": np.zeros(4800)}
    fields.update(kw)
    return bench.Reply(
        prompt=prompt, latency_s=latency, first_audio_s=first, sample_rate=2400, **fields
    )


def test_percentiles_interpolate_and_cell_order_rotates() -> None:
    assert bench.percentile([], 50) is None
    assert bench.percentile([3.0], 90) == 3.0
    assert bench.p50_p90([4.0, 1.0, 3.0, 2.0]) == {"p50": 2.5, "p90": pytest.approx(3.7)}
    orders = [bench.cell_order(p) for p in range(3)]
    assert orders[0] == list(bench.CELLS)
    # every cell takes every position once in three passes
    for position in range(3):
        assert {order[position] for order in orders} == set(bench.CELLS)
    assert bench.cell_order(3) == orders[0]


def test_generates_codes_become_frames_in_the_talkers_order() -> None:
    # [1, 16 code groups, 2 frames]: group g of frame t is 100 * t + g
    codes = np.array([[[100 * t + g for t in range(2)] for g in range(16)]])
    assert bench.frames_of(codes) == [*range(16), *range(100, 116)]


def test_the_check_names_what_differs_and_where_the_audio_starts_to() -> None:
    audio = np.linspace(0, 1, 4800)
    refs = [_reply(0, audio=audio), _reply(1, thinker_ids=[9, 9], audio=audio)]
    late = audio.copy()
    late[3600:] += 0.5  # from 1.5 s on (2400 samples a second)
    runs = [
        bench.CellRun("omni_sequential", 1.0, {}, [_reply(0, audio=audio), _reply(1, audio=late)]),
        bench.CellRun("hf_sequential", 1.0, {}, [_reply(0, audio=audio + 1e-6)]),
    ]
    check = bench.check_runs(refs, runs)
    # the second reply of the first run has prompt 0's thinker ids, not prompt 1's
    assert check["mismatches"] == [
        {"run": 0, "cell": "omni_sequential", "request": 1, "differs": ["same_thinker_ids"]}
    ]
    assert check["same_thinker_ids"] is False and check["same_codes"] is True
    assert check["requests_checked"] == 3 and check["mismatch_count"] == 1
    assert check["max_abs_audio_diff"] == pytest.approx(0.5)
    assert check["earliest_audio_diff_s"] == pytest.approx(1.5)  # 1e-6 is float rounding
    short = bench.compare(refs[0], _reply(0, codes=[1], audio=audio[:10]))
    assert short["same_codes"] is False and short["same_audio_length"] is False
    assert short["max_abs_audio_diff"] is None and short["first_audio_diff_s"] is None


def test_a_cell_reports_per_pass_rates_percentiles_rtf_and_cpu_per_request() -> None:
    runs = [
        bench.CellRun(
            "omni_sequential",
            2.0,
            {"request": 3.0, "frontend": 2.0, "thinker": 1.0},
            [_reply(latency=1.0, first=0.2), _reply(latency=1.0, first=0.4)],
        ),
        bench.CellRun(
            "omni_sequential",
            4.0,
            {"request": 5.0, "frontend": 4.0, "thinker": 1.0},
            [_reply(latency=2.0, first=0.6), _reply(latency=2.0, first=None)],
        ),
    ]
    cell = bench.summarize_cell(runs)
    assert cell["requests"] == 4
    assert cell["requests_per_s"] == {"median": 0.75, "min": 0.5, "max": 1.0}
    assert cell["first_audio_s"]["p50"] == pytest.approx(0.4)  # the request without audio: out
    assert cell["latency_s"] == {"p50": 1.5, "p90": pytest.approx(2.0)}
    assert cell["audio_s_per_request"] == 2.0  # 4800 samples at 2400/s
    assert cell["rtf"]["p50"] == pytest.approx(0.75)
    assert cell["audio_s_per_wall_s"] == pytest.approx(1.5)  # 4 s / 2 s and 4 s / 4 s
    assert cell["cpu_s_per_request"] == pytest.approx(2.0)  # 1.5 and 2.5
    assert cell["cpu_s_per_request_by_part"] == {"frontend": 1.5, "thinker": 0.5}

    hf = [bench.CellRun("hf_sequential", 4.0, {"request": 4.0}, [_reply(latency=2.0)] * 2)] * 2
    concurrent = [bench.CellRun("omni_concurrent", 1.0, {"request": 1.0}, [_reply()] * 2)] * 2
    everything = [*runs, *hf, *concurrent]
    cells = {c: bench.summarize_cell([r for r in everything if r.cell == c]) for c in bench.CELLS}
    assert "cpu_s_per_request_by_part" not in cells["hf_sequential"]
    ratios = bench.ratios(cells, everything)
    # omni/hf per pass: 1.0/0.5 and 0.5/0.5
    assert ratios["sequential_rps"] == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert ratios["concurrent_rps"]["median"] == 4.0
    # hf/omni: above 1 when omni-trio is better
    assert ratios["latency_p50"] == pytest.approx(2.0 / 1.5)
    assert ratios["cpu_per_request"] == pytest.approx(1.0)


def test_quick_mode_and_flags() -> None:
    quick = bench.parse_args(["--quick"])
    assert (quick.passes, quick.requests, quick.concurrency, quick.prompts) == (1, 2, 2, 2)
    assert bench.parse_args([]).prompts == len(bench.PROMPTS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--prompts", "9"])


@pytest.mark.slow
@pytest.mark.vllm
def test_the_quick_run_compares_both_systems_on_the_same_codes() -> None:
    done = run_bounded([sys.executable, str(SCRIPT), "--quick"], 600, "bench_qwen_omni.py --quick")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["benchmark"] == "qwen_omni"
    assert set(result["cells"]) == set(bench.CELLS)
    assert [p["cell"] for p in result["passes"]] == bench.cell_order(0)
    for name, cell in result["cells"].items():
        assert cell["requests"] == 2, name
        assert cell["audio_s_per_request"] > 0, name
        assert cell["first_audio_s"]["p50"] <= cell["latency_s"]["p50"], name
    hf = result["cells"]["hf_sequential"]
    assert hf["first_audio_s"] == hf["latency_s"]  # generate() hands the audio over at the end
    assert all(result["ratios"][k]["median"] > 0 for k in ("sequential_rps", "concurrent_rps"))
    # greedy on both sides: the pipeline says what generate() says (the warm-up's
    # generate() replies are the references; 3 cells x 2 requests are checked)
    assert result["check"]["requests_checked"] == 6
    assert result["same_codes"] is True, result["check"]
