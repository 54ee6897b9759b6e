"""Garbage collection pauses in a process serving vLLM stages, its startup heap frozen or not.

One ``open_engine`` of a chain of tiny vLLM stages (``--stages``, one core per stage or all on
core 0 with ``--layout``), then phases that alternate between the heap as it is and the heap
frozen by ``omni_trio.heap.frozen_heap`` (what ``serve_engine`` and the command line's
``run`` do once their engine is up). Each phase runs ``--seconds`` of load, batches of
``--requests`` requests x ``--tokens`` tokens per stage, and reports per collector
generation how many collections ran, their total and longest milliseconds (``gc.callbacks``),
then times one full collection (``gc.collect()``, the pause the startup heap makes) and the
requests per second. Prints one JSON object: each phase, the medians per mode and the ratios
frozen / as-is of the full collection's pause and of the collector's total time.

    python benchmarks/bench_heap.py [--stages 2] [--seconds 60] [--phases 4]

Progress and vLLM's own logging go to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
# vLLM logs to stdout by default: stdout is this benchmark's JSON
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

import trio

# benchmarks/ is on sys.path (this file runs as a script)
from harness.vllm_cells import omni_batch, omni_config

import omni_trio
from omni_trio.heap import frozen_heap


class Pauses:
    """The collector's runs while installed in ``gc.callbacks``: per generation, the count,
    the total and the longest seconds."""

    def __init__(self) -> None:
        self.runs: dict[int, list[float]] = {}
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.runs.setdefault(info["generation"], []).append(time.perf_counter() - self._t0)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            f"gen{g}": {
                "count": len(runs),
                "total_ms": round(1e3 * sum(runs), 2),
                "max_ms": round(1e3 * max(runs), 2),
            }
            for g, runs in sorted(self.runs.items())
        }

    def total_ms(self) -> float:
        return 1e3 * sum(sum(runs) for runs in self.runs.values())


async def load(engine: Any, last: str, requests: int, seconds: float, tag: str) -> int:
    """Batches of ``requests`` until ``seconds`` passed (at least one); how many ran."""
    done = 0
    t_end = time.perf_counter() + seconds
    batch = 0
    while batch == 0 or time.perf_counter() < t_end:
        await omni_batch(engine, last, requests, f"{tag}-{batch}")
        done += requests
        batch += 1
    return done


async def phase(engine: Any, last: str, a: argparse.Namespace, k: int) -> dict[str, Any]:
    pauses = Pauses()
    gc.callbacks.append(pauses)
    t0 = time.perf_counter()
    try:
        n = await load(engine, last, a.requests, a.seconds, f"p{k}")
    finally:
        gc.callbacks.remove(pauses)
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    gc.collect()
    full_ms = 1e3 * (time.perf_counter() - t1)
    return {
        "requests": n,
        "requests_per_s": round(n / wall, 1),
        "collections": pauses.summary(),
        "gc_total_ms": round(pauses.total_ms(), 2),
        "full_collection_ms": round(full_ms, 2),
        "tracked_objects": len(gc.get_objects()),
        "frozen_objects": gc.get_freeze_count(),
    }


def medians(phases: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(p[key] for p in phases))


async def main(a: argparse.Namespace) -> dict[str, Any]:
    config = omni_config(a.stages, a.layout, a.tokens, a.requests)
    last = config["stages"][-1]["id"]
    results: dict[str, Any] = {"benchmark": "heap", "args": vars(a), "phases": []}
    async with omni_trio.open_engine(config) as engine:
        await load(engine, last, a.requests, 0, "warm")  # one batch
        for k in range(a.phases):
            frozen = k % 2 == 1  # as-is first, then alternating
            if frozen:
                with frozen_heap():
                    result = await phase(engine, last, a, k)
            else:
                result = await phase(engine, last, a, k)
            results["phases"].append({"frozen": frozen, **result})
            print(f"phase {k} frozen={frozen}: {result}", file=sys.stderr, flush=True)
    modes = {
        mode: [p for p in results["phases"] if p["frozen"] == (mode == "frozen")]
        for mode in ("as_is", "frozen")
    }
    summary: dict[str, Any] = {}
    for mode, phases in modes.items():
        if phases:
            summary[mode] = {
                key: medians(phases, key)
                for key in ("full_collection_ms", "gc_total_ms", "requests_per_s")
            }
            summary[mode]["longest_collection_ms"] = max(
                (run["max_ms"] for p in phases for run in p["collections"].values()), default=0.0
            )
    if len(summary) == 2:
        summary["ratio_frozen_over_as_is"] = {
            key: round(summary["frozen"][key] / summary["as_is"][key], 4)
            for key in ("full_collection_ms", "gc_total_ms", "requests_per_s")
            if summary["as_is"][key]
        }
    results["summary"] = summary
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--layout", default="core0", choices=["core0", "spread"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0, help="load per phase")
    parser.add_argument("--phases", type=int, default=4, help="alternating as-is / frozen")
    print(json.dumps(trio.run(main, parser.parse_args()), indent=2))
