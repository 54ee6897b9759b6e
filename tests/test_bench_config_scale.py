"""benchmarks/bench_config_scale.py's cell (load a pipeline file, open its engine, run one
request, close) on small pipelines of both shapes: every step is timed, and the request's
outputs are checked against what flows through the stages."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
# the benchmark is a script, not a package: import it from its directory
sys.path.insert(0, str(ROOT / "benchmarks"))
bench = importlib.import_module("bench_config_scale")


@pytest.mark.parametrize("shape", ["chain", "independent"])
async def test_a_cell_times_every_step_of_a_checked_request(autojump_clock, tmp_path, shape):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(bench.pipeline(7, shape)))
    figures = await bench.cell(7, shape, path)
    assert list(figures) == list(bench.STEPS)
    for step in figures.values():
        assert set(step) == {"wall_s", "cpu_s", "gc_cpu_s"}
        assert step["cpu_s"] >= step["gc_cpu_s"] >= 0


def test_the_check_refuses_a_request_that_skipped_stages():
    class Out:
        def __init__(self, stage_id: str, token_ids: tuple[int, ...]) -> None:
            self.stage_id, self.token_ids, self.finished = stage_id, token_ids, True

    bench._check(3, "chain", [Out("s2", (bench.PROMPT[0] + 3,))])
    with pytest.raises(AssertionError):
        bench._check(3, "chain", [Out("s2", (bench.PROMPT[0] + 2,))])
    with pytest.raises(AssertionError):
        bench._check(3, "independent", [Out("s0", (2,)), Out("s1", (2,))])
