"""benchmarks/_orchestrator_scripted.py: the three sides of a throughput cell move the same
outputs (omni-trio, the stages chained by hand, and chained by hand with the caller's
reading task), so their ratios compare the same work."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the benchmark is a script with sibling modules, not a package: import them from its directory
sys.path.insert(0, str(ROOT / "benchmarks"))
scripted = importlib.import_module("_orchestrator_scripted")


@pytest.mark.parametrize("n_stages", [1, 3])
async def test_each_side_delivers_every_output_of_every_request(autojump_clock, n_stages):
    for run in (scripted.run_omni, scripted.run_floor, scripted.run_floor_consumer):
        # each asserts internally that concurrency x outputs outputs reached the caller
        result = await run(n_stages, 7, 5)
        assert result["outputs_per_s"] > 0 and result["outputs_per_cpu_s"] > 0, run


async def test_a_cell_reports_the_ratio_against_both_floors(autojump_clock):
    (cell_1, *_rest) = await scripted.throughput_cells(outputs=4, passes=1, quick=True)
    assert cell_1["stages"] == 1 and cell_1["concurrency"] == 1
    assert cell_1["ratio_cpu"] > 0 and cell_1["ratio_cpu_vs_consumer_floor"] > 0
    # the bound the reading task puts on ratio_cpu is the consumer floor over the plain floor:
    # with one pass, omni/floor = omni/consumer floor x consumer floor/floor (3-digit rounding)
    bound = cell_1["consumer_floor_ratio_cpu"]
    assert bound > 0
    product = cell_1["ratio_cpu_vs_consumer_floor"] * bound
    assert product == pytest.approx(cell_1["ratio_cpu"], rel=0.01, abs=0.002)
