"""benchmarks/bench_replicas.py at small sizes: its pure helpers, every cell on the mock clock
(the JSON's shape, and requests lost to the killed replica == those bound to it), and the
script itself once on the real clock (slow)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import run_bounded

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_replicas.py"


# the benchmark is a script, not a package module: import it from its directory
sys.path.insert(0, str(SCRIPT.parent))
bench = importlib.import_module("bench_replicas")
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


def test_pass_order_runs_every_cell_once_and_rotates_the_first() -> None:
    orders = [bench.pass_order(p) for p in range(len(bench.CELLS))]
    assert all(sorted(o) == sorted(bench.CELLS) for o in orders)
    assert [o[0] for o in orders] == list(bench.CELLS)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert bench.percentile(values, 0.5) == 51.0
    assert bench.percentile(values, 0.99) == 100.0
    assert bench.percentile([3.0], 0.99) == 3.0


def test_capacity_is_slots_over_request_time_and_the_middle_stage_is_the_bottleneck() -> None:
    shape = bench.Shape()
    assert bench.capacity(shape) == {"s0": 200.0, "s1": 100.0, "s2": 200.0}
    assert bench.capacity(bench.Shape(slots=None)) is None


def test_config_sets_policy_seed_slots_and_restart_on_the_middle_stage_only() -> None:
    cfg = bench.replica_config(bench.Shape(), "random", restart=True)
    assert cfg.lb_policy == "random" and cfg.lb_seed == 1234
    assert cfg.max_requests_in_flight >= 1000
    assert [s.replicas for s in cfg.stages] == [4, 4, 4]
    assert [s.max_in_flight_per_replica for s in cfg.stages] == [8, 8, 8]
    assert [s.restart for s in cfg.stages] == ["never", "on-failure", "never"]


def _check_cells(result: dict[str, Any], requests: int) -> None:
    assert json.loads(json.dumps(result)) == result  # plain JSON
    cells = result["cells"]
    assert set(cells) == set(bench.CELLS)
    for name, cell in cells.items():
        assert CELL_KEYS <= set(cell), name
        assert set(cell["spread_min_max"]) == {"s0", "s1", "s2"}
    for name in bench.POLICIES + ("add",):
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
    assert restart["restart_s"][0] >= bench.Shape().restart_backoff_s
    add = cells["add"]
    assert add["live_middle_at_end"] == [5] and len(add["middle_per_replica"]) == 5
    assert sum(add["middle_per_replica"]) == requests
    assert add["added_served"][0] == add["middle_per_replica"][4]


async def test_every_cell_runs_and_loses_exactly_the_killed_replicas_requests(
    autojump_clock,
) -> None:
    result = await bench.replica_cells(bench.Shape(requests=100), passes=1)
    _check_cells(result, 100)
    # the middle stage is the bottleneck: the added replica takes part of its queue
    assert result["cells"]["add"]["added_served"][0] > 0


@pytest.mark.slow
def test_the_script_prints_one_json_object_on_the_real_clock() -> None:
    done = run_bounded([sys.executable, str(SCRIPT), "--quick"], 300, "the benchmark to end")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["benchmark"] == "replicas" and result["passes"] == 1
    assert result["shape"]["requests"] == 100
    _check_cells(result, 100)
