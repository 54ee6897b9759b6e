"""benchmarks/bench_config_scale.py run as a script on small pipelines of both shapes (slow: it
starts a process per cell): every step of every cell is timed, and each cell's request was
checked against what flows through the stages (a request that skipped a stage fails the cell's
process, and so the script)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .conftest import run_bounded

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_config_scale.py"
STEPS = ("load", "open", "request", "close")


@pytest.mark.slow
def test_every_step_of_a_checked_request_is_timed_for_both_shapes():
    args = [sys.executable, str(SCRIPT), "--sizes", "3,7", "--shapes", "chain,independent"]
    done = run_bounded(args, 300, "bench_config_scale.py to end")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["sizes"] == [3, 7]
    for shape in ("chain", "independent"):
        assert set(result[shape]) == {"3", "7"}
        for n, row in result[shape].items():
            assert row["finished"] is True, (shape, n)
            assert list(row) == ["finished", *STEPS]
            for step in STEPS:
                figures = row[step]
                assert figures["cpu_s"] >= figures["gc_cpu_s"] >= 0, (shape, n, step)
                assert figures["wall_s"] > 0 and figures["cpu_us_per_stage"] >= 0
        # no size of 100 stages or more: growth is against the first size
        assert all(result[shape]["3"][step]["growth"] in (1.0, None) for step in STEPS)
