"""benchmarks/bench_orchestrator.py run as a script in its quick mode, one pass (slow: the real
clock): it exits 0 (each side of every cell asserts that every output of every request reached
its caller) and its JSON holds together: every cell of each part, the figures each ratio is
made of, the hops its timed stages noted. The fake engine and the clock it uses are tested
where they live (tests/testing/)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import run_bounded

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_orchestrator.py"
QUICK_REQUESTS = 16  # the fake engine cells' requests in quick mode
HOP_REQUESTS = 50  # the hop latency's requests in quick mode


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    args = [sys.executable, str(SCRIPT), "--quick", "--passes", "1", "--idle-seconds", "0.2"]
    done = run_bounded(args, 600, "bench_orchestrator.py --quick to end")
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout)
    return out


@pytest.mark.slow
def test_the_fake_engine_cells_report_both_sides_and_the_hops_of_each_request(result):
    assert result["benchmark"] == "orchestrator" and result["passes"] == 1
    cells = result["fake_engine"]
    assert [c["stages"] for c in cells] == [1, 2, 3]
    for cell in cells:
        assert set(cell["cpu_us_per_step"]) == {"omni", "floor"}
        assert all(us > 0 for us in cell["cpu_us_per_step"].values())
        low, high = cell["wall_ratio_min_max"]
        assert low <= cell["wall_ratio_median"] <= high
        # the timed fake engine stages noted every hop of every request of the pass
        assert cell["hop"]["hops"] == QUICK_REQUESTS * (cell["stages"] - 1)
    # under the exact step clock: wall time only (its polling would count as CPU)
    exact = result["fake_engine_exact_steps"]
    assert [c["stages"] for c in exact] == [1, 2, 3]
    assert all("cpu_us_per_step" not in c and c["wall_ratio_median"] > 0 for c in exact)


@pytest.mark.slow
def test_the_fake_cpu_cells_split_each_sides_cost_into_fixed_and_per_output(result):
    cells = result["fake_cpu"]
    assert [c["stages"] for c in cells] == [1, 3]
    for cell in cells:
        for side in ("omni", "floor"):
            figures = cell[side]
            few, many = figures["us_per_request_1_tokens"], figures["us_per_request_16_tokens"]
            assert few > 0 and many > 0  # thread CPU was spent on each side
            # the fixed cost is the 1-token figure, the per-output cost the slope to 16
            assert figures["fixed_us_per_request"] == pytest.approx(few, abs=0.06)
            assert figures["us_per_output"] == pytest.approx((many - few) / 15, abs=0.02)


@pytest.mark.slow
def test_the_throughput_ratio_is_the_product_of_its_two_floors(result):
    cells = result["throughput"]
    assert [(c["stages"], c["concurrency"]) for c in cells] == [(1, 1), (1, 100), (3, 1), (3, 100)]
    for cell in cells:
        assert cell["ratio_cpu"] > 0 and cell["consumer_floor_ratio_cpu"] > 0
        # with one pass, omni/floor = omni/consumer floor x consumer floor/floor (3 digits)
        product = cell["ratio_cpu_vs_consumer_floor"] * cell["consumer_floor_ratio_cpu"]
        assert product == pytest.approx(cell["ratio_cpu"], rel=0.01, abs=0.002)


@pytest.mark.slow
def test_the_hop_memory_and_idle_figures_cover_what_they_say(result):
    # 3 stages: two hops per request
    assert result["hop_latency"]["hops"] == 2 * HOP_REQUESTS
    assert result["hop_latency"]["p50_ms"] <= result["hop_latency"]["p99_ms"]
    for key in ("memory", "memory_3_stages_in_last", "memory_1_stage"):
        assert result[key]["requests_in_flight"] == 200, key
        assert result[key]["python_heap_per_request_kib"] > 0, key
    # the stage holding them emitted nothing: only the last-stage case keeps outputs
    assert result["memory"]["kept_for_abort_kib_per_request"] == 0
    assert result["memory_3_stages_in_last"]["kept_for_abort_kib_per_request"] > 0
    assert result["idle"]["idle_wall_s"] > 0
    assert all(len(v) == 2 for v in result["targets"].values())


@pytest.mark.slow
def test_the_tracing_cells_compare_off_routed_and_traced_with_the_spans_each_made():
    args = [sys.executable, str(SCRIPT), "--tracing-only", "--quick", "--passes", "1"]
    done = run_bounded(args, 600, "bench_orchestrator.py --tracing-only --quick to end")
    assert done.returncode == 0, done.stderr[-3000:]
    tracing = json.loads(done.stdout)["tracing"]
    assert tracing["modes"] == ["off", "routed", "traced"]
    # nothing imported OpenTelemetry before the traced runs needed it
    assert tracing["opentelemetry_imported_before_traced_runs"] is False
    cells = tracing["cells"]
    assert [(c["stages"], c["concurrency"]) for c in cells] == [(1, 1), (1, 100), (3, 1), (3, 100)]
    for cell in cells:
        # off: no observer, no span; traced: a root and one span per stage, per request
        assert (cell["off"]["observers"], cell["off"]["spans_per_request"]) == (0, 0)
        assert cell["routed"]["spans_per_request"] == 0
        assert cell["traced"]["spans_per_request"] == 1 + cell["stages"]
        assert cell["traced_cpu_ratio"] > 0 and cell["routed_cpu_ratio"] > 0
