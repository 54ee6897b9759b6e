"""How the engine's set-up and a request's planning grow with the number of stages.

Two shapes of scripted pipeline (one output per stage, zero latency, one replica each):
``chain`` (stage k takes stage k-1's output; the last one is the output stage) and
``independent`` (every stage is an entry stage and an output stage). For each size, in a
fresh process, the time to load and validate the config from a YAML file (what ``omni-trio
validate`` does), to open the engine (every stage's pool started), to run one request
through every stage, and to close the engine. Each step reports wall and CPU seconds
(the machine is shared: CPU time is what other processes cannot inflate), the CPU seconds
of them spent in CPython's cyclic garbage collector (``gc_cpu_s``: its full collections
walk the whole heap, which grows with the stages), and CPU microseconds per stage with and
without the collector's part; ``growth`` is each step's CPU per stage (without the
collector's part) against that of the first size of at least 100 stages (smaller ones are
mostly fixed costs): 1.0 is linear. The request is checked: a
chain's output carries one token offset per stage, the independent pipeline gives one
finished output per stage. A cell that does not finish within ``--timeout`` seconds is
reported as such.

    python benchmarks/bench_config_scale.py [--sizes 10,100,1000,2000] [--shapes chain,independent]
                                            [--timeout 120]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

STEPS = ("load", "open", "request", "close")
PROMPT = [1, 2, 3]


def pipeline(n: int, shape: str) -> dict[str, Any]:
    """The config of an ``n``-stage ``chain`` or ``independent`` pipeline (plain data)."""
    stages: list[dict[str, Any]] = []
    for i in range(n):
        chained = shape == "chain" and i > 0
        stages.append(
            {
                "id": f"s{i}",
                "backend": "scripted",
                "inputs": [f"s{i - 1}"] if chained else [],
                "options": {"outputs": 1, "record": False},
                "final_output": shape != "chain" or i == n - 1,
            }
        )
    return {"name": f"{shape}-{n}", "stages": stages, "max_requests_in_flight": 4}


def _check(n: int, shape: str, outs: list[Any]) -> None:
    # the request went through every stage: else the figures would time something else
    if shape == "chain":
        last = outs[-1]
        assert last.stage_id == f"s{n - 1}" and last.finished, last
        assert list(last.token_ids) == [PROMPT[0] + n], (last.token_ids, n)
    else:
        finished = {o.stage_id for o in outs if o.finished}
        assert len(finished) == n, (len(finished), n)


class _Timer:
    """Wall, CPU and garbage-collector CPU seconds of each step."""

    def __init__(self) -> None:
        self.figures: dict[str, dict[str, float]] = {}
        self._gc = 0.0
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.process_time()
        else:
            self._gc += time.process_time() - self._gc_started

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def start(self) -> None:
        self._t, self._c, self._g = time.perf_counter(), time.process_time(), self._gc

    def stop(self, step: str) -> None:
        self.figures[step] = {
            "wall_s": round(time.perf_counter() - self._t, 4),
            "cpu_s": round(time.process_time() - self._c, 4),
            "gc_cpu_s": round(self._gc - self._g, 4),
        }


async def cell(n: int, shape: str, path: Path) -> dict[str, dict[str, float]]:
    """Load ``path``, open its engine, run one request, close: each step's seconds."""
    import omni_trio

    timer = _Timer()
    try:
        timer.start()
        cfg = omni_trio.load_config(path)
        timer.stop("load")
        timer.start()
        async with omni_trio.open_engine(cfg) as engine:
            timer.stop("open")
            timer.start()
            async with engine.generate(PROMPT) as stream:
                outs = [out async for out in stream]
            timer.stop("request")
            assert engine.statistics().requests_in_flight == 0
            _check(n, shape, outs)
            timer.start()
        timer.stop("close")
    finally:
        timer.close()
    return timer.figures


def run_cell(n: int, shape: str, timeout: float) -> dict[str, dict[str, float]] | None:
    """One cell in a fresh process (the heap of one size does not slow the next); None if
    it did not finish within ``timeout`` seconds."""
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{shape}-{n}.yaml"
        path.write_text(yaml.safe_dump(pipeline(n, shape), sort_keys=False))
        try:
            child = subprocess.run(
                [sys.executable, __file__, "--cell", shape, str(n), str(path)],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return None
    figures: dict[str, dict[str, float]] = json.loads(child.stdout)
    return figures


def _per_stage_us(figures: dict[str, float], n: int) -> tuple[float, float]:
    # (CPU per stage, the same without the collector's part)
    return figures["cpu_s"] / n * 1e6, (figures["cpu_s"] - figures["gc_cpu_s"]) / n * 1e6


def main(sizes: list[int], shapes: list[str], timeout: float) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes": sizes, "timeout_s": timeout}
    for shape in shapes:
        cells: dict[int, dict[str, dict[str, float]] | None] = {}
        for n in sizes:
            cells[n] = run_cell(n, shape, timeout)
            print(f"{shape} {n}: {json.dumps(cells[n])}", file=sys.stderr)
        done = [n for n, figures in cells.items() if figures is not None]
        base_n = next((n for n in done if n >= 100), done[0] if done else 0)
        rows: dict[str, Any] = {}
        for n, figures in cells.items():
            if figures is None:
                rows[str(n)] = {"finished": False}
                continue
            row: dict[str, Any] = {"finished": True}
            for step in STEPS:
                per_stage, without_gc = _per_stage_us(figures[step], n)
                base_figures = cells[base_n]
                assert base_figures is not None
                base = _per_stage_us(base_figures[step], base_n)[1]
                row[step] = {
                    **figures[step],
                    "cpu_us_per_stage": round(per_stage, 1),
                    "cpu_us_per_stage_without_gc": round(without_gc, 1),
                    "growth": round(without_gc / base, 2) if base else None,
                }
            rows[str(n)] = row
        out[shape] = rows
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000,2000")
    parser.add_argument("--shapes", default="chain,independent")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per cell")
    parser.add_argument("--cell", nargs=3, metavar=("SHAPE", "N", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        shape, n, path = args.cell
        print(json.dumps(trio.run(cell, int(n), shape, Path(path))))
    else:
        sizes = [int(s) for s in args.sizes.split(",")]
        print(json.dumps(main(sizes, args.shapes.split(","), args.timeout), indent=2))
