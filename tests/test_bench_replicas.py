"""benchmarks/bench_replicas.py run as a script in its quick mode (slow: the real clock): the
JSON's shape, the capacity of each stage, every request of the undisturbed cells finished, the
requests lost to the killed replica == those bound to it, the restarted and the added
replica."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import run_bounded

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_replicas.py"
POLICIES = ("least_loaded", "round_robin", "random")
CELLS = {*POLICIES, "kill", "kill_restart", "add"}
CELL_KEYS = {
    "requests_per_s",
    "outputs_per_s",
    "outputs_per_cpu_s",
    "wall_s",
    "cpu_s",
    "p50_ms",
    "p99_ms",
    "completed",
    "spread_min_max",
    "middle_per_replica",
    "live_middle_at_end",
}


def _check_cells(result: dict[str, Any], requests: int) -> None:
    assert json.loads(json.dumps(result)) == result  # plain JSON
    cells = result["cells"]
    assert set(cells) == CELLS
    for name, cell in cells.items():
        assert CELL_KEYS <= set(cell), name
        assert set(cell["spread_min_max"]) == {"s0", "s1", "s2"}
        assert cell["p50_ms"] <= cell["p99_ms"], name
    for name in (*POLICIES, "add"):
        assert cells[name]["completed"] == [requests], name
    for name in ("kill", "kill_restart"):
        cell = cells[name]
        # a replica of the middle stage had requests bound when it was killed, and exactly
        # those failed with ReplicaDeadError; every other request finished
        assert cell["lost_equals_bound"] == [True], name
        assert cell["lost"] == cell["bound_at_kill"] and cell["lost"][0] > 0, name
        assert cell["other_failures"] == [0], name
        assert cell["completed"][0] + cell["lost"][0] == requests, name
    assert cells["kill"]["live_middle_at_end"] == [3]
    restart = cells["kill_restart"]
    assert restart["live_after_restart"] == [4] and restart["live_middle_at_end"] == [4]
    assert restart["restart_s"][0] >= result["shape"]["restart_backoff_s"]
    add = cells["add"]
    assert add["live_middle_at_end"] == [5] and len(add["middle_per_replica"]) == 5
    assert sum(add["middle_per_replica"]) == requests
    assert add["added_served"][0] == add["middle_per_replica"][4]


@pytest.mark.slow
def test_the_script_prints_one_json_object_on_the_real_clock() -> None:
    done = run_bounded([sys.executable, str(SCRIPT), "--quick"], 300, "the benchmark to end")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["benchmark"] == "replicas" and result["passes"] == 1
    assert result["shape"]["requests"] == 100
    # the middle stage, twice as slow, is the bottleneck: 4 replicas x 8 slots / (16 x 0.02 s)
    capacity = result["shape"]["capacity_requests_per_s"]
    assert capacity == {"s0": 200.0, "s1": 100.0, "s2": 200.0}
    _check_cells(result, 100)
