"""benchmarks/bench_diffusion.py: its pure helpers (the workload, pixel differences, a cell's
figures and ratios, the image check, the abort summaries) and the script in its quick mode on
the real tiny diffusion model and diffusers (slow): it exits 0, its JSON holds together, every
image equals diffusers' own call and nothing is left in the engines."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from .conftest import run_bounded

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_diffusion.py"

# the benchmark is a script with sibling modules, not a package: import it from its directory
sys.path.insert(0, str(ROOT / "benchmarks"))
bench = importlib.import_module("bench_diffusion")


def _image(value: int) -> np.ndarray:
    return np.full((1, 8, 8, 3), value, dtype=np.uint8)


def test_the_workload_chunks_and_pixel_differences() -> None:
    assert [bench.job(k).prompt for k in range(5)] == [*bench.PROMPTS, bench.PROMPTS[0]]
    assert bench.job(6).seed == 6
    assert list(bench.chunks(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(bench.chunks(range(4), 8)) == [[0, 1, 2, 3]]
    # uint8 differences do not wrap around
    assert bench.max_diff(_image(0), _image(255)) == 255
    assert bench.max_diff(_image(7), _image(7)) == 0
    with pytest.raises(ValueError, match="different shapes"):
        bench.max_diff(_image(0), np.zeros((2, 8, 8, 3), np.uint8))


def test_cells_pair_the_systems_pass_by_pass() -> None:
    # (system, c): wall of pass 1 and pass 2 (4 images each), ticks and rows
    table = {
        ("diffusers", 1): (1.0, 2.0, 0, 0),
        ("omni_request", 1): (2.0, 2.0, 20, 20),
        ("omni_step", 1): (1.0, 4.0, 20, 20),
        ("diffusers", 4): (0.5, 0.5, 0, 0),
        ("omni_request", 4): (0.5, 1.0, 20, 80),
        ("omni_step", 4): (0.25, 0.5, 40, 80),
    }
    images = {k: _image(k) for k in range(4)}
    runs = [
        bench.CellRun(system, c, walls[p], walls[p] / 2, images, walls[2], walls[3])
        for p in range(2)
        for (system, c), walls in table.items()
    ]
    report = bench.cells_report(runs, [1, 4])
    one, four = report["c=1"], report["c=4"]
    assert one["systems"]["diffusers"]["images_per_s"] == {"median": 3.0, "min": 2.0, "max": 4.0}
    assert one["systems"]["diffusers"]["cpu_s_per_image"] == pytest.approx(0.1875)
    assert "mean_batch" not in one["systems"]["diffusers"]
    assert four["systems"]["omni_step"]["mean_batch"] == 2.0
    # omni_request/diffusers per pass: 0.5 and 1.0; omni_step/omni_request: 2.0 and 0.5
    assert one["ratios"]["omni_request_vs_diffusers"] == {"median": 0.75, "min": 0.5, "max": 1.0}
    assert one["ratios"]["step_vs_request"] == {"median": 1.25, "min": 0.5, "max": 2.0}
    # CPU per image (half the wall here): omni_request over diffusers 2.0 and 1.0
    cpu = one["ratios"]["omni_request_cpu_vs_diffusers"]
    assert cpu == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert "diffusers_vs_its_c1" not in one["ratios"]
    # each system at c=4 over itself at c=1, pass by pass: 2 and 4
    assert four["ratios"]["diffusers_vs_its_c1"] == {"median": 3.0, "min": 2.0, "max": 4.0}
    assert four["ratios"]["omni_step_vs_its_c1"] == {"median": 6.0, "min": 4.0, "max": 8.0}


def test_the_check_reports_each_systems_largest_difference() -> None:
    refs = {k: _image(10 * k) for k in range(3)}
    runs = [
        bench.CellRun("diffusers", 1, 1.0, 1.0, {0: _image(0), 1: _image(10)}),
        bench.CellRun("omni_step", 1, 1.0, 1.0, {1: _image(11), 2: _image(27)}),
    ]
    check = bench.check_images(refs, runs)
    assert check == {"images_checked": 4, "max_abs_diff_uint8": {"diffusers": 0, "omni_step": 7}}


def test_abort_summaries_leave_out_victims_that_ended_first() -> None:
    cut = bench.Cut
    cuts = [
        *(cut("omni_step", 0.1, 0.001 * k, 0.0005, 10 + k, True, 0) for k in range(1, 102)),
        cut("omni_step", 0.9, 5.0, missed=True),
        cut("omni_request", 0.2, 0.002, 0.001, 5, False, 1),
        cut("diffusers_interrupt", 0.3, 0.02, victim_steps=7),
    ]
    report = bench.abort_report(cuts)
    step = report["omni_step"]
    assert step["runs"] == 101 and step["ended_before_abort"] == 1
    assert step["to_ended_ms"] == {"p50": pytest.approx(51.0), "p99": pytest.approx(100.0)}
    assert step["to_return_ms"]["p50"] == pytest.approx(0.5)
    assert step["victim_steps"] == {"median": 61, "min": 11, "max": 111}
    assert step["shared"] == 101 and step["neighbour_max_diff"] == 0
    assert report["omni_request"]["shared"] == 0
    assert report["omni_request"]["neighbour_max_diff"] == 1
    theirs = report["diffusers_interrupt"]
    assert theirs["runs"] == 1 and theirs["victim_steps"]["median"] == 7
    assert "to_return_ms" not in theirs and "shared" not in theirs
    assert report["ratios_to_ended_p50"]["diffusers_interrupt_over_omni_request"] == (
        pytest.approx(10.0)
    )


def test_quick_mode_and_flags() -> None:
    quick = bench.parse_args(["--quick"])
    assert (quick.passes, quick.images, quick.concurrency, quick.abort_runs) == (1, 4, [1, 4], 3)
    assert bench.parse_args([]).concurrency == [1, 4, 8]
    with pytest.raises(SystemExit):
        bench.parse_args(["--size", "60"])


@pytest.mark.slow
def test_the_quick_run_compares_both_modes_with_diffusers_on_the_same_images() -> None:
    done = run_bounded([sys.executable, str(SCRIPT), "--quick"], 600, "bench_diffusion.py --quick")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["benchmark"] == "diffusion"
    assert set(result["cells"]) == {"c=1", "c=4"}
    for name, cell in result["cells"].items():
        assert set(cell["systems"]) == set(bench.SYSTEMS), name
        for system, figures in cell["systems"].items():
            assert figures["images"] == 4 and figures["images_per_s"]["median"] > 0, system
        assert all(r["median"] > 0 for r in cell["ratios"].values()), name
    # 4 requests in flight on an engine: batched (a batch of 1 is every request alone)
    assert result["cells"]["c=4"]["systems"]["omni_step"]["mean_batch"] > 1
    # the same images as diffusers' own call for each prompt and seed (float rounding: 1)
    check = result["check"]
    assert check["images_checked"] == 2 * 3 * 4
    assert all(d <= 1 for d in check["max_abs_diff_uint8"].values()), check
    abort = result["abort"]
    for side in bench.ABORT_SIDES:
        trials = abort[side]
        assert trials["runs"] + trials["ended_before_abort"] == 3, side
        assert trials["victim_steps"]["max"] < 20, side  # every timed victim stopped early
    for side in bench.ENGINES:
        # the neighbour finished with its own image, whatever its victim did
        assert abort[side]["neighbour_max_diff"] <= 1, side
    assert all(
        left == {"requests_in_flight": 0, "running": 0, "waiting": 0}
        for left in result["left_after_run"].values()
    )
